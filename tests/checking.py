"""Helpers for the check tests (tests/test_checks*.py): judge an answer exactly as the grader does.

Every helper goes through course_lib.tooling.grading.run_check (inputs and references in this
process, answers across JSON); what a task forbids is judged from a notebook's source in a task
process of its own (`judged_cells`), as the grader judges it. Import them as
`from checking import verdict, passes, fails`: pytest puts tests/ on sys.path. The seed is
keyword-only, and the number of answers must match
the check's arguments, so that a stray positional seed is an error, not an extra answer that the
check rejects and a `fails` that passes for the wrong reason.
"""

from __future__ import annotations

import random

from course_lib.tooling.checks import get_check
from course_lib.tooling.grading import judge_cells, run_check


def verdict(name: str, *objects, seed: int | None = None) -> tuple[str, str]:
    """Run check `name` on `objects`; return its (status, message).

    status is "passed", "failed", "timed out" or "not attempted", as the grader reports it. With a
    seed the cases are drawn from random.Random(seed); without one they are fresh each call.
    """
    wanted = get_check(name).args
    assert len(objects) == len(wanted), f"{name} takes {len(wanted)} answer(s): {', '.join(wanted)}"
    status, message, _ = run_check(name, *objects, rng=random.Random(seed) if seed is not None else None)
    return status, message


def passes(name: str, *objects, times: int = 3) -> None:
    """Assert that check `name` accepts `objects` on `times` fresh draws of cases; return None.

    Fresh cases each time, because the check must never reject a right answer on any draw.
    """
    for _ in range(times):
        status, message = verdict(name, *objects)
        assert status == "passed", message


def fails(name: str, *objects, seed: int | None = None) -> str:
    """Assert that check `name` rejects `objects` (status "failed"); return the check's message.

    The cases come from random.Random(seed) when a seed is given, else they are fresh.
    """
    status, message = verdict(name, *objects, seed=seed)
    assert status == "failed", f"{name} accepted a wrong answer: {message}"
    return message


def judged_cells(name: str, *cells: str, seed: int | None = None) -> tuple[str, str]:
    """(status, message) for a notebook made of `cells` (code cells as typed), judged as the batch
    grader and the inline check judge it: the statements the task needs, in a task process of its own."""
    status, message, _, _ = judge_cells(name, list(cells), rng=random.Random(seed) if seed is not None else None)
    return status, message
