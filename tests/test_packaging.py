"""What a Colab user installs: floors only, never a pin or a ceiling (Colab keeps its own torch)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def dependencies() -> list[str]:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]


def test_every_dependency_is_a_floor_without_pins_or_ceilings():
    for dep in dependencies():
        ops = re.findall(r"(===|==|~=|!=|<=|>=|<|>)", dep)
        assert ops == [">="], f"{dep!r}: use a floor (>=) only"


def test_torch_and_torchvision_are_dependencies_with_floors():
    names = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0]: d for d in dependencies()}
    assert names["torch"].startswith("torch>=") and names["torchvision"].startswith("torchvision>=")


def test_environment_yml_installs_from_pyproject_instead_of_listing_packages_again():
    env = (ROOT / "environment.yml").read_text()
    assert "-e .[lab,test]" in env and "torch" not in env


# The newest API the course calls, per module path, and the torch release that made it public.
# Raise the floor in pyproject.toml, not this table, when the course starts to use something newer.
NEWEST_APIS = {
    "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard": (2, 6),  # FSDP2 public in 2.6
    "torch.get_autocast_dtype(": (2, 4),
    "torch.amp.GradScaler(": (2, 3),
}


def test_the_declared_torch_floor_has_every_api_the_course_calls():
    floor = next(d for d in dependencies() if d.startswith("torch>="))
    declared = tuple(int(p) for p in floor.split(">=")[1].split(".")[:2])
    sources = "".join(p.read_text() for p in (ROOT / "course_lib").rglob("*.py")) + "".join(
        p.read_text() for p in (ROOT / "notebooks").glob("*.ipynb")
    )
    for api, since in NEWEST_APIS.items():
        assert api in sources, f"{api!r} is no longer used: drop it from the table"
        assert declared >= since, f"{api!r} needs torch>={since[0]}.{since[1]}; pyproject.toml declares {floor}"


def test_make_test_floor_pins_exactly_the_declared_floors():
    # `make test-floor` installs against these lines: raising a floor in pyproject.toml moves the target
    done = subprocess.run(
        [sys.executable, "tools/floor_constraints.py", "pyproject.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    floors = [d.replace(">=", "==") for d in dependencies() if d.startswith(("torch>=", "torchvision>="))]
    assert done.stdout.split() == floors


def test_make_help_lists_every_target_and_clean_removes_build():
    """A contributor's first command is `make help`: a target it does not list is a target nobody finds."""
    make = (ROOT / "Makefile").read_text()
    targets = {t for t in re.findall(r"^([a-z][a-z-]*):(?!=)", make, re.M)}
    shown = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    missing = [t for t in sorted(targets) if not re.search(rf"make {re.escape(t)}\b", shown)]
    assert not missing, f"make help does not list: {missing}"
    assert {"test-fast", "test-chapter", "test-under-load", "clean"} <= targets
    clean = re.search(r"^clean:\n\t(.+)$", make, re.M).group(1)
    assert "build" in clean.split() and "--durations=20" in make


def test_make_test_chapter_finds_a_chapters_notebooks_and_tests():
    paths = subprocess.run(
        [sys.executable, "tools/chapter_tests.py", "07"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert paths[:3] == [
        "notebooks/07_loading.ipynb",
        "exercises/07_loading_exercises.ipynb",
        "solutions/07_loading_exercises.ipynb",
    ]
    assert {"tests/test_checks_ch07.py", "tests/test_loading.py", "tests/test_grade_a_chapter.py"} <= set(paths)
    wrong = subprocess.run([sys.executable, "tools/chapter_tests.py", "7"], cwd=ROOT, capture_output=True, text=True)
    assert wrong.returncode != 0 and "two digits" in wrong.stderr
