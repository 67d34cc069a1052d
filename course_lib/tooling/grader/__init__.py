"""The grader's side of grading, never shown to a learner's code: the batch grader and the end of the
wire that judges a task process.

    cli.py        a folder of submissions in, a gradebook out (`python -m course_lib.tooling.grader`, make grade)
    wire.py       one task judged in a task process of its own, whatever it does (inline check() too)
    sandbox.py    where a task process runs: namespaces showing only the learner library, or a session
    classview.py  per task: passed, failed, not attempted and the most common failures, after a run

This folder and tooling/checks/ are what no sandbox sees (sandbox.GRADER_ONLY).
"""

from .cli import main

__all__ = ["main"]
