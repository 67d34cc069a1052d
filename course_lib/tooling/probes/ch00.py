"""Task side of exercise 00's checks (see course_lib.tooling.probes): no answers, no durations."""

from __future__ import annotations

from typing import Any, Callable

from . import ask

__all__ = ["choose_precision", "median_step_ms"]


def choose_precision(case: list, choose_precision_fn: Callable) -> Any:
    return choose_precision_fn(tuple(case))  # a compute capability is a tuple in the task


def median_step_ms(case: dict, median_step_ms_fn: Callable) -> dict:
    """The learner's timer on an `fn` whose every call the grader sleeps through, for a time only it knows.

    fn closes over nothing: the durations, the call count and the measured sleeps stay in the grader
    (`MedianStepMs.host`), so the only way to learn how long fn takes is to time it."""

    def fn() -> None:
        ask({"call": "fn"})

    return {"ms": median_step_ms_fn(fn, warmup=case["warmup"], iters=case["iters"])}
