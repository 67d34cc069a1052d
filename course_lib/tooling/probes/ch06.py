"""Task side of exercise 06's checks (see course_lib.tooling.probes).

time_it's `fn` and `sync` stand for a CUDA launch and torch.cuda.synchronize(): each asks the grader
(`TimeIt.host`), which queues fn's work for a time only it knows and answers sync when that work has
run. Nothing in this kernel holds the durations, so the helper has to time the calls to know them."""

from __future__ import annotations

from typing import Any, Callable

from . import ask

__all__ = ["diagnose_step", "time_it"]


def diagnose_step(case: dict, diagnose_step_fn: Callable) -> Any:
    return diagnose_step_fn(case)  # the profile, as trace_summary reports one


def time_it(case: dict, time_it_fn: Callable) -> dict:
    def fn() -> None:  # like a CUDA launch: queues the work and returns at once
        ask({"call": "fn"})

    def sync() -> None:  # like torch.cuda.synchronize(): returns when everything queued has run
        ask({"call": "sync"})

    return {"result": time_it_fn(fn, sync, warmup=case["warmup"], iters=case["iters"])}
