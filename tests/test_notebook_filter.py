"""Learners keep their outputs and can still update (issue 33): the clean filter `make lab` configures.

course_lib/tooling/notebook_filter.py is git's clean filter for notebooks/, exercises/ and solutions/: git
sees a run chapter as the course commits it. These tests need no browser: a chapter-like
notebook is run with nbclient in a learner's clone, git must call it unmodified, and `git pull`
and `make update` must bring a new commit on top of it. tests/test_lab_session.py does the same
through JupyterLab in a real browser.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_lib.tooling import notebook_filter as nf

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "course_lib" / "tooling" / "notebook_filter.py"
COMMITTED = sorted(p for d in nf.FOLDERS for p in (ROOT / d).glob("*.ipynb"))


def git(where: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    ident = ["-c", "user.name=course", "-c", "user.email=course@example.invalid", "-c", "init.defaultBranch=main"]
    return subprocess.run(["git", *ident, "-C", str(where), *args], capture_output=True, text=True, check=check)


def filtered(raw: str) -> str:
    return nf.clean(raw.encode()).decode()


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_committed_notebook_is_what_the_filter_keeps_of_it(path):
    """Otherwise git would call the notebook modified as soon as it looked at it through the filter."""
    raw = path.read_text(encoding="utf-8")
    assert filtered(raw) == raw, "the filter changes this notebook: store it as notebook_filter.clean() writes it"


def test_the_filter_keeps_exactly_the_outputs_nbval_compares():
    nb = nbformat.v4.new_notebook()
    nb.metadata.update(language_info={"name": "python", "version": "3.11.7"}, widgets={"x": {}})
    checked = nbformat.v4.new_code_cell("print(1)\nprint(2)", metadata={"tags": ["nbval-check-output"]})
    checked.execution_count = 7
    checked.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text="1\n"),
        nbformat.v4.new_output("stream", name="stdout", text="2\n"),
        nbformat.v4.new_output(
            "execute_result", {"text/plain": "3", nf.WIDGET_VIEW: {"model_id": "m"}}, execution_count=7
        ),
    ]
    timing = {"iopub.status.busy": "2026-11-26T12:00:00Z"}
    plain = nbformat.v4.new_code_cell("x = 1", metadata={"collapsed": True, "execution": timing}, execution_count=3)
    plain.outputs = [nbformat.v4.new_output("stream", name="stdout", text="out\n")]
    nb.cells = [nbformat.v4.new_markdown_cell("# title"), checked, plain]
    cleaned = json.loads(filtered(nbformat.writes(nb)))
    assert cleaned["metadata"] == {"language_info": {"name": "python"}}
    kept, stripped = cleaned["cells"][1], cleaned["cells"][2]
    assert kept["execution_count"] == 1
    assert kept["outputs"] == [
        {"name": "stdout", "output_type": "stream", "text": ["1\n", "2\n"]},  # one stream, as JupyterLab saves it
        {"data": {"text/plain": ["3"]}, "execution_count": 1, "metadata": {}, "output_type": "execute_result"},
    ]
    assert (stripped["outputs"], stripped["execution_count"], stripped["metadata"]) == ([], None, {})
    assert filtered(filtered(nbformat.writes(nb))) == filtered(nbformat.writes(nb))  # a clean filter is idempotent


@pytest.mark.parametrize("raw", ["", "not json", '{"a": 1}', '{"nbformat": 4, "cells": [', "[1, 2]"])
def test_what_is_not_a_notebook_passes_through_unchanged(raw):
    assert nf.clean(raw.encode()) == raw.encode()


def test_outside_a_git_checkout_make_lab_says_so_and_goes_on(tmp_path):
    assert "not a git checkout" in nf.install(tmp_path)
    done = subprocess.run([sys.executable, str(SCRIPT), "install", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0 and "not a git checkout" in done.stdout


def test_make_lab_configures_the_filter_and_make_update_uses_it():
    make = (ROOT / "Makefile").read_text()
    lab = re.search(r"^lab:.*?(?=^\S)", make, re.S | re.M).group(0)
    assert 'course_lib/tooling/notebook_filter.py install "$(CURDIR)"' in lab and "file-browser-path=/" in lab
    update = re.search(r"^update:.*?(?=^\S|\Z)", make, re.S | re.M)[0]
    assert 'course_lib/tooling/notebook_filter.py update "$(CURDIR)"' in update
    settings = re.search(r"^\$\(LAB_SETTINGS\):.*?@echo (.*?) > \$@", make, re.S | re.M).group(1)
    overrides = json.loads(" ".join(re.findall(r"'([^']*)'", settings)))
    assert overrides["@jupyter-widgets/jupyterlab-manager:plugin"] == {"saveState": True}


# --------------------------------------------------------------------------- a learner's clone

CHAPTER = "notebooks/00_tiny.ipynb"
EXERCISE = "exercises/00_tiny_exercises.ipynb"
OTHER = "notebooks/01_other.ipynb"


def chapter(title: str) -> nbformat.NotebookNode:
    """A chapter in miniature: prose, a compared output, a progress bar (a widget), a plain print."""
    from course_lib.tooling.colab import KERNELSPEC, LANGUAGE_INFO

    nb = nbformat.v4.new_notebook(metadata={"kernelspec": KERNELSPEC, "language_info": LANGUAGE_INFO})
    checked = nbformat.v4.new_code_cell("print('fp16 max', 65504.0)", metadata={"tags": ["nbval-check-output"]})
    checked.outputs = [nbformat.v4.new_output("stream", name="stdout", text="fp16 max 65504.0\n")]
    checked.execution_count = 1
    nb.cells = [
        nbformat.v4.new_markdown_cell(f"# {title}"),
        checked,
        nbformat.v4.new_code_cell("from tqdm.auto import tqdm\nfor _ in tqdm(range(3), desc='train'):\n    pass"),
        nbformat.v4.new_code_cell("import sys\nprint(sys.version)"),
    ]
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i}"
    return nb


def write(path: Path, nb: nbformat.NotebookNode) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)  # as JupyterLab's contents manager writes it


@pytest.fixture
def clones(tmp_path):
    """The course's origin with a chapter, an exercise and another chapter, and a learner's clone of it
    configured as `make lab` configures it (no .venv in it: the filter runs with python3)."""
    origin, learner = tmp_path / "origin", tmp_path / "learner"
    git(tmp_path, "init", "-q", str(origin))
    (origin / nf.SCRIPT).parent.mkdir(parents=True)
    (origin / nf.SCRIPT).write_bytes(SCRIPT.read_bytes())
    write(origin / CHAPTER, chapter("00 tiny"))
    write(origin / OTHER, chapter("01 other"))
    exercise = chapter("00 exercises")
    exercise.cells[3].source = "def answer():\n    raise NotImplementedError"
    write(origin / EXERCISE, exercise)
    git(origin, "add", "-A")
    git(origin, "commit", "-q", "-m", "the course")
    git(tmp_path, "clone", "-q", str(origin), str(learner))
    assert "read without their outputs" in nf.install(learner)
    assert nf.install(learner)  # twice: idempotent
    attributes = (learner / ".git" / "info" / "attributes").read_text().splitlines()
    assert [line for line in attributes if "filter=" in line] == list(nf.PATTERNS)
    return origin, learner


def run_like_a_learner(path: Path) -> None:
    """Run All in a real kernel, then save: outputs, counts, widget state and the kernel's metadata land in the file."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)


def status(learner: Path) -> str:
    return git(learner, "status", "--porcelain").stdout


def test_a_run_chapter_stays_unmodified_and_git_pull_updates_it(clones):
    pytest.importorskip("jupyter_server", reason="JupyterLab is not installed here (make lab installs it)")
    from course_lib.tooling.lab import refresh_git

    origin, learner = clones
    committed = (learner / CHAPTER).read_text()
    run_like_a_learner(learner / CHAPTER)
    ran = nbformat.read(learner / CHAPTER, as_version=4)
    assert ran.cells[2].outputs and ran.metadata.get("widgets"), "the run left no progress bar or widget state"
    assert filtered((learner / CHAPTER).read_text()) == committed, "the filter does not give back the committed file"
    answered = nbformat.read(learner / EXERCISE, as_version=4)
    answered.cells[3].source = "def answer():\n    return 42"
    write(learner / EXERCISE, answered)

    # JupyterLab's save hook (course_lib/tooling/lab.py) lets git compare the saved notebooks again.
    for path in (CHAPTER, EXERCISE):
        refresh_git({"type": "notebook"}, os_path=str(learner / path))
    assert status(learner) == f" M {EXERCISE}\n", "only the answered exercise may show as modified"
    assert git(learner, "diff", "--", CHAPTER).stdout == ""

    update = nbformat.read(origin / CHAPTER, as_version=4)
    update.cells[0].source = "# 00 tiny, revised"
    write(origin / CHAPTER, update)
    (origin / "NEWS.md").write_text("a new section\n")
    git(origin, "commit", "-qam", "revise chapter 00")
    git(origin, "add", "NEWS.md")
    git(origin, "commit", "-qm", "news")

    pulled = git(learner, "pull", "-q", check=False)
    assert pulled.returncode == 0, pulled.stderr
    assert (learner / "NEWS.md").exists()
    assert nbformat.read(learner / CHAPTER, as_version=4).cells[0].source == "# 00 tiny, revised"
    assert nbformat.read(learner / EXERCISE, as_version=4).cells[3].source.endswith("return 42"), "the answer is lost"
    assert status(learner) == f" M {EXERCISE}\n"


def test_make_update_pulls_over_outputs_saved_elsewhere_and_keeps_them_where_nothing_changed(clones):
    origin, learner = clones
    # two chapters run in another front end: outputs in the files, git never told
    for path in (CHAPTER, OTHER):
        ran = nbformat.read(learner / path, as_version=4)
        ran.cells[3].outputs = [nbformat.v4.new_output("stream", name="stdout", text="3.11\n")]
        ran.cells[3].execution_count = 4
        write(learner / path, ran)
    assert status(learner) == f" M {CHAPTER}\n M {OTHER}\n"  # before: git pull refused an update of either

    update = nbformat.read(origin / OTHER, as_version=4)
    update.cells[0].source = "# 01 other, revised"
    write(origin / OTHER, update)
    git(origin, "commit", "-qam", "revise chapter 01")
    done = subprocess.run([sys.executable, str(SCRIPT), "update", str(learner)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert nbformat.read(learner / OTHER, as_version=4).cells[0].source == "# 01 other, revised"
    assert nbformat.read(learner / CHAPTER, as_version=4).cells[3].outputs, "outputs of an unchanged chapter went"
    assert status(learner) == ""


def test_make_update_stops_with_advice_where_an_update_would_replace_an_answer(clones):
    origin, learner = clones
    ran = nbformat.read(learner / CHAPTER, as_version=4)  # a chapter run elsewhere: git never told
    ran.cells[3].outputs = [nbformat.v4.new_output("stream", name="stdout", text="3.11\n")]
    write(learner / CHAPTER, ran)
    answered = nbformat.read(learner / EXERCISE, as_version=4)
    answered.cells[3].source = "def answer():\n    return 42"
    write(learner / EXERCISE, answered)
    update = nbformat.read(origin / EXERCISE, as_version=4)
    update.cells[0].source = "# 00 exercises, revised"
    write(origin / EXERCISE, update)
    git(origin, "commit", "-qam", "revise exercise 00")
    done = subprocess.run([sys.executable, str(SCRIPT), "update", str(learner)], capture_output=True, text=True)
    assert done.returncode != 0
    assert "git stash && make update && git stash pop" in done.stdout
    assert nbformat.read(learner / EXERCISE, as_version=4).cells[3].source.endswith("return 42")
    # the advice works: the answer comes back on top of the update
    for step in (["stash", "-q"], ["pull", "-q"], ["stash", "pop", "-q"]):
        assert git(learner, *step, check=False).returncode == 0
    back = nbformat.read(learner / EXERCISE, as_version=4)
    assert back.cells[0].source == "# 00 exercises, revised" and back.cells[3].source.endswith("return 42")
    assert nbformat.read(learner / CHAPTER, as_version=4).cells[3].outputs, "the stash took a run chapter's outputs"


def test_a_clone_without_the_filter_is_plain_git(tmp_path, clones):
    origin, _ = clones
    plain = tmp_path / "plain"
    git(tmp_path, "clone", "-q", str(origin), str(plain))
    ran = nbformat.read(plain / CHAPTER, as_version=4)
    ran.cells[3].outputs = [nbformat.v4.new_output("stream", name="stdout", text="3.11\n")]
    write(plain / CHAPTER, ran)
    assert not nf.configured(plain) and nf.refresh(plain) == []
    assert status(plain) == f" M {CHAPTER}\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    assert (
        "00_tiny"
        in subprocess.run(["git", "-C", str(plain), "diff", "--stat"], capture_output=True, text=True, env=env).stdout
    )


# --------------------------------------------------------------------------- every chapter, as make test runs it


def test_a_run_whose_compared_outputs_match_byte_for_byte_reads_as_unchanged():
    """conftest.py judges every notebook nbval ran to its end with this: a learner's Run All of it
    must leave `git status` clean. Split prints and another execution count are not a change."""
    from course_lib.tooling.nbtools import reads_as_modified_after_run

    committed = (ROOT / "notebooks" / "04_accumulation.ipynb").read_text(encoding="utf-8")
    nb = nbformat.reads(committed, as_version=4)
    index = next(i for i, c in enumerate(nb.cells) if "nbval-check-output" in c.metadata.get("tags", []))
    text = "".join(nb.cells[index].outputs[0].text)
    first, rest = text.split("\n", 1)
    split = [
        nbformat.v4.new_output("stream", name="stdout", text=first + "\n"),
        nbformat.v4.new_output("stream", name="stdout", text=rest),
    ]
    assert not reads_as_modified_after_run(committed, {index: split})
    assert not reads_as_modified_after_run(committed, {})


def test_a_compared_output_that_changed_by_one_character_is_a_change_to_git():
    from course_lib.tooling.nbtools import reads_as_modified_after_run

    committed = (ROOT / "notebooks" / "04_accumulation.ipynb").read_text(encoding="utf-8")
    nb = nbformat.reads(committed, as_version=4)
    index, cell = next((i, c) for i, c in enumerate(nb.cells) if "nbval-check-output" in c.metadata.get("tags", []))
    text = json.dumps(cell.outputs)
    digit = next(ch for ch in text if ch.isdigit())
    outputs = json.loads(text.replace(digit, str((int(digit) + 1) % 10), 1))
    assert reads_as_modified_after_run(committed, {index: [nbformat.from_dict(o) for o in outputs]})
