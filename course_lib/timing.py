"""Measuring time and memory correctly: the one implementation every chapter uses.

The rules every measurement here follows: warm up first (cuDNN autotuning, lazy allocations and
first-call compilation are not the steady state); synchronize before reading a clock (CUDA calls
return before the work is done); time several runs and report the median with its spread.

    t = time_fn(lambda: model(x), warmup=3, iters=10)   # Timing: median, quartiles, n
    peak_memory_bytes(lambda: train_step(x, y))         # peak CUDA memory of one step
"""

from __future__ import annotations

import gc
import statistics
import textwrap
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .device import pick_device

__all__ = ["time_fn", "compare", "peak_memory_bytes"]


def synchronize(device: torch.device) -> None:
    """Wait until every queued kernel on `device` has finished (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass
class Timing:
    """Several timed runs of one function, in milliseconds, with their spread."""

    times_ms: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def quartiles_ms(self) -> tuple[float, float]:
        """(25th, 75th) percentile: half of the runs lie between them."""
        if len(self.times_ms) < 2:
            return self.times_ms[0], self.times_ms[0]
        q = statistics.quantiles(self.times_ms, n=4, method="inclusive")
        return q[0], q[2]

    @property
    def rel_spread(self) -> float:
        """Interquartile range / median: 0.05 means the middle half of the runs lie within 5%."""
        lo, hi = self.quartiles_ms
        return (hi - lo) / self.median_ms if self.median_ms else 0.0

    def __str__(self) -> str:
        lo, hi = self.quartiles_ms
        return f"median {self.median_ms:.3f} ms (middle half {lo:.3f}-{hi:.3f}, n={len(self.times_ms)})"


def time_fn(
    fn: Callable[[], object], *, warmup: int = 3, iters: int = 10, device: torch.device | str | None = None
) -> Timing:
    """Chapters 01, 02: time `fn` properly: warm-up, synchronised clocks, `iters` samples.

    On CUDA each sample is bracketed by CUDA events (GPU time, no host jitter); elsewhere by
    time.perf_counter after a synchronize.
    """
    dev = torch.device(device) if device is not None else pick_device()
    for _ in range(warmup):
        fn()
    synchronize(dev)
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            synchronize(dev)
            times.append((time.perf_counter() - t0) * 1e3)
    return Timing(times)


def compare(timings: dict[str, Timing], base: str, width: int = 100) -> str:
    """Chapter 02: each timing against `base` in words: faster or slower, by what factor, and
    whether the difference is larger than the spread (the middle halves do not overlap) or within
    it, in which case this run cannot tell the two apart. Lines wrap at `width` characters."""
    ref = timings[base]
    lo0, hi0 = ref.quartiles_ms
    out = []
    for name, t in timings.items():
        if name == base:
            continue
        lo, hi = t.quartiles_ms
        ratio = t.median_ms / ref.median_ms
        speed = f"{1 / ratio:.2f}x faster" if ratio < 1 else f"{ratio:.2f}x slower"
        verdict = (
            "the middle halves overlap: the difference is within the spread, so this run cannot tell them apart"
            if lo <= hi0 and lo0 <= hi
            else "the middle halves do not overlap: the difference is larger than the spread"
        )
        out.append(
            textwrap.fill(
                f"{name}: median {t.median_ms:.1f} ms against {ref.median_ms:.1f} ms for {base}, {speed}; {verdict}.",
                width,
                subsequent_indent="    ",
            )
        )
    return "\n".join(out)


def peak_memory_bytes(fn: Callable[[], object], device: torch.device | str | None = None) -> int | None:
    """Chapter 04: peak CUDA memory allocated while `fn` runs; None off CUDA (no allocator stats)."""
    dev = torch.device(device) if device is not None else pick_device()
    if dev.type != "cuda":
        fn()
        return None
    synchronize(dev)
    gc.collect()  # what an earlier measurement left in a reference cycle must not count in this one
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    synchronize(dev)
    return torch.cuda.max_memory_allocated(dev)
