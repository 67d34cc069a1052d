"""Task side of exercise 10's checks (see course_lib.tooling.probes): the learner's prediction,
called on one case. The measurement and the right answer stay in the grader."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["block_saved_bytes"]


def block_saved_bytes(case: dict, block_saved_bytes_fn: Callable) -> Any:
    return block_saved_bytes_fn(case["batch"], case["seq"], case["n_embd"], case["n_head"], case["precision"])
