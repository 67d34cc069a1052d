"""One chapter's solution and untouched exercise through the batch grader: `make test-chapter N=07`.

`make test` grades every chapter's solution and exercise at once, in the class of tests/test_grader.py;
a contributor changing one chapter runs this instead (conftest.py selects it with `--chapter NN` and
leaves it out otherwise).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_grader import course_copy, grade

pytestmark = pytest.mark.slow  # the batch grader on one chapter: left out by make test-fast

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p.name[:2] for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.per_chapter
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_solution_scores_full_marks_and_the_exercise_zero(chapter, tmp_path):
    (solution,) = (ROOT / "solutions").glob(f"{chapter}_*.ipynb")
    course, home, subs = course_copy(tmp_path / "course"), tmp_path / "home", tmp_path / "subs"
    home.mkdir()
    for who, folder in (("solution", ROOT / "solutions"), ("exercise", ROOT / "exercises")):
        (subs / who).mkdir(parents=True)
        shutil.copy(folder / solution.name, subs / who / solution.name)
    proc = grade(course, subs, tmp_path / "out", home)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "out" / "gradebook.json").read_text())
    mine = [r for r in rows if r["student"] == "solution"]
    judged = [r for r in mine if not (r["status"] == "not graded" and "needs torch" in r["message"])]  # an old torch
    assert judged and all(r["passed"] for r in judged), [(r["exercise"], r["message"]) for r in mine]
    assert all((r["points"], r["status"]) == (0, "not attempted") for r in rows if r["student"] == "exercise")
