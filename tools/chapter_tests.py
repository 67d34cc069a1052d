"""The test paths of one chapter, for `make test-chapter N=07`.

    python3 tools/chapter_tests.py 07   ->   notebooks/07_loading.ipynb exercises/07_... solutions/07_...
                                             tests/test_checks_ch07.py tests/test_loading.py ...

A chapter's tests are its three notebooks (run by nbval), and every test file that imports its
home, `course_lib.chapters.chNN`, or names its checks ("NN.task", `checks_for("NN")`): the tests
of its modules and of its exercises, found by reading them rather than by a list that would drift.
With `--chapter NN`, pytest also grades the chapter's solution and exercise with the batch grader
(tests/test_grade_a_chapter.py). Needs nothing but Python.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def chapter_paths(chapter: str) -> list[str]:
    """Every test path of chapter `chapter` ("07"), relative to the repository, notebooks first."""
    if not re.fullmatch(r"\d{2}", chapter):
        raise SystemExit(f"usage: make test-chapter N=07 (two digits), not {chapter!r}")
    folders = ("notebooks", "exercises", "solutions")
    paths = [p for folder in folders for p in sorted((ROOT / folder).glob(f"{chapter}_*.ipynb"))]
    if not paths:
        raise SystemExit(f"there is no chapter {chapter}: no notebooks/{chapter}_*.ipynb")
    home = re.compile(
        rf"course_lib[./]chapters[./]ch{chapter}\b|tooling[./]checks[./]ch{chapter}\b"
        rf"|checks import .*\bch{chapter}\b|checks_for\(\"{chapter}\"\)|\"{chapter}\.[a-z]\w*\""
    )
    tests = [p for p in sorted((ROOT / "tests").glob("test_*.py")) if home.search(p.read_text(encoding="utf-8"))]
    checks = ROOT / "tests" / f"test_checks_ch{chapter}.py"
    if checks.exists() and checks not in tests:
        tests.insert(0, checks)
    return [p.relative_to(ROOT).as_posix() for p in paths + tests + [ROOT / "tests" / "test_grade_a_chapter.py"]]


if __name__ == "__main__":
    print(" ".join(chapter_paths(sys.argv[1] if len(sys.argv) > 1 else "")))
