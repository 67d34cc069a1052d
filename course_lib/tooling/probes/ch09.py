"""Task side of exercise 09's checks (see course_lib.tooling.probes)."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["speed_up", "first_overflow", "mfu"]

# mfu's arguments, in the order the task gives them
MFU_ARGS = ("n_params", "n_layer", "n_embd", "seq_len", "batch", "step_ms", "peak_tflops")


def speed_up(case: dict, speed_up_fn: Callable) -> Any:
    return speed_up_fn(dict(case))  # a copy: the settings the learner changes are returned, not edited in place


def first_overflow(case: list, first_overflow_fn: Callable) -> Any:
    return first_overflow_fn([dict(r) for r in case])


def mfu(case: dict, mfu_fn: Callable) -> Any:
    return mfu_fn(*(case[k] for k in MFU_ARGS))
