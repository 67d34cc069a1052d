"""The inline check() says what the batch grader says, on every notebook of the class.

tests/test_grader.py grades the class of tests/grading_class.py with the batch grader and finds each
row equal to its fair grade; here each of those notebooks is judged as check() judges it in a
learner's kernel (course_lib.tooling.grading.judge_cells, which a fresh judging process runs with the
cells IPython's history holds), and must get the same grade. A file of its own, so that `make test`'s
two processes run it beside the class's grading.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from grading_class import FORGERIES, HABITS, HONEST, hostile

from course_lib.tooling import grading
from course_lib.tooling.grader import sandbox

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sandbox.available(), reason="needs user namespaces")]
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("group", ["HONEST", "HABITS", "FORGERIES", "hostile"])
def test_the_inline_check_gives_each_notebook_of_the_class_its_fair_grade(group, tmp_path, monkeypatch):
    fixtures = ROOT / "tests" / "fixtures"
    monkeypatch.setenv(
        "COURSE_EXTRA_CHECKS", os.pathsep.join([str(fixtures / "checks_ch99.py"), str(fixtures / "checks_ch97.py")])
    )
    monkeypatch.setenv("COURSE_EXTRA_PROBES", str(fixtures / "probes_ch99.py"))
    entries = {"HONEST": HONEST, "HABITS": HABITS, "FORGERIES": FORGERIES}.get(group) or hostile(
        tmp_path / "marker", 9, tmp_path, tmp_path, tmp_path
    )
    jobs = [
        (student, task, e.cells, status)
        for student, e in entries.items()
        if e.inline and not isinstance(e.cells, str)
        for task, (_, status) in e.expect.items()
    ]
    with ThreadPoolExecutor(2) as pool:
        # the batch grader's --cell-timeout in tests/test_grader.py: a statement that hangs costs 15 s, not 60
        said = list(pool.map(lambda job: grading.judge_cells(job[1], job[2], cell_limit=15)[:2], jobs))
    differ = [(s, t, status, got) for (s, t, _, status), got in zip(jobs, said) if got[0] != status]
    assert not differ, differ
