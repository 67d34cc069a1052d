"""Checks for exercise 00 (setup and hardware). Each tests behaviour on fresh random inputs."""
from __future__ import annotations

import random
import time

from ...device import recommend_precision
from ..grading import CheckFailure, register

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

# Compute capabilities of real NVIDIA GPUs, Kepler to Blackwell.
REAL_CAPABILITIES = [(3, 7), (5, 0), (5, 2), (6, 0), (6, 1), (7, 0), (7, 2), (7, 5), (8, 0), (8, 6),
                     (8, 7), (8, 9), (9, 0), (10, 0), (12, 0)]


@register("00.choose_precision", args=("choose_precision",), points=2,
          hint="Native bf16 needs compute capability >= (8, 0); fp16 Tensor Cores start at (7, 0); "
               "only fp16 needs a GradScaler. Compare tuples directly: (7, 5) >= (7, 0) is True.")
def _choose_precision(choose_precision) -> None:
    for cc in random.sample(REAL_CAPABILITIES, len(REAL_CAPABILITIES)):
        want = recommend_precision(capability=cc)
        got = choose_precision(cc)
        if tuple(got) != (want.precision, want.use_grad_scaler):
            raise CheckFailure(f"choose_precision({cc}) returned {got!r}, expected "
                               f"{(want.precision, want.use_grad_scaler)!r}")


@register("00.median_step_ms", args=("median_step_ms",), points=2,
          hint="Call fn() `warmup` times without timing it, then time each of the next `iters` calls "
               "separately (time.perf_counter before and after) and return the median in milliseconds.")
def _median_step_ms(median_step_ms) -> None:
    warmup, iters = random.randint(1, 3), random.choice([5, 7])
    # Warm-up calls are slow (like cuDNN autotuning); one timed call is an outlier (like a GC pause).
    fast = 0.004
    durations = [0.06] * warmup + [fast] * iters
    durations[warmup + random.randrange(iters)] = 0.08
    calls: list[int] = []

    def fn():
        time.sleep(durations[min(len(calls), len(durations) - 1)])
        calls.append(1)

    got = median_step_ms(fn, warmup=warmup, iters=iters)
    if len(calls) != warmup + iters:
        raise CheckFailure(f"fn was called {len(calls)} times; expected warmup + iters = {warmup + iters}")
    if not isinstance(got, (int, float)):
        raise CheckFailure(f"expected a number of milliseconds, got {type(got).__name__}")
    if got > 1000 * fast * 3:
        raise CheckFailure(f"got {got:.1f} ms but a typical step takes ~{1000 * fast:.0f} ms: are warm-up calls "
                           "timed, or is it the mean (pulled up by the one slow call) instead of the median?")
    if got < 1000 * fast * 0.9:
        raise CheckFailure(f"got {got:.2f} ms, less than one step really takes ({1000 * fast:.0f} ms): "
                           "is it in seconds instead of milliseconds, or divided by the wrong count?")
