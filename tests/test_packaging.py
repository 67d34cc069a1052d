"""What a Colab user installs: floors only, never a pin or a ceiling (Colab keeps its own torch)."""
import re
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
    assert names["torch"] == "torch>=2.4" and names["torchvision"].startswith("torchvision>=")


def test_environment_yml_installs_from_pyproject_instead_of_listing_packages_again():
    env = (ROOT / "environment.yml").read_text()
    assert "-e .[lab,test]" in env and "torch" not in env
