"""Judging a learner's timer by what the grader measured itself (checks 00.median_step_ms, 06.time_it).

The learner's timer runs in the kernel; each call of its `fn` (and `sync`) is an ask to the grader,
whose `host` sleeps a duration only the grader knows. What the timer measures for one call is that
sleep plus the round trip to the grader: the way out (from reading the clock to the grader taking
the ask) and the way back (from the reply to reading the clock again). Under load both grow: a busy
machine runs the kernel late, a busy grader thread answers late, and the grader's sleeps wake late.

Nothing the kernel says is trusted (it may rewrite its probe too), so the round trip is bounded from
the grader's side: `host` records when each ask arrived and when it was answered (`record_ask`). A
correct timer's clock starts after the reply to the ask before the call left the grader, and stops
before the ask after the call arrives. So what it measured of a call lies between

    lo      what the grader measured of the call itself (its sleep, late wake-up included), and
    window  from the reply to the ask before the call to the arrival of the ask after it (`window_ms`),

and the judge accepts an answer between the same quantile of both (`bounds`). A kernel that dawdles
between its calls widens the windows without measuring anything more, so no call is credited more
than TRANSIT_MS over the quantile, but for one call, any one, credited its whole window: one long
stall of the kernel fails no correct timer. The cases are drawn so that every familiar wrong answer
(the mean, the median with the warm-up calls, the fastest call, seconds) lies further than that
from the right one, and a failure names the mistake that the answer is (`nearest_mistake`).
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["TRANSIT_MS", "record_ask", "window_ms", "credited", "bounds", "likely", "nearest_mistake"]

# The most round-trip time (way out + way back) credited to one timed call. Measured between the
# asks of a 2-core grader grading two notebooks at once with both cores kept busy: 0.5 ms typically,
# 2-18 ms at the 90th percentile, 5-45 ms at the 99th, now and then 70-130 ms. The cases are drawn so
# that every familiar mistake lies further than this from the right answer.
TRANSIT_MS = 50.0
REL, ABS_MS = 0.03, 0.5  # slack around the bounds: rounding, and how a learner's clock is read


def record_ask(case: dict, kind: str, arrival: float, reply: float) -> None:
    """`host`: one ask of `kind` arrived at perf_counter() `arrival` and was answered at `reply`."""
    case.setdefault("_asks", []).append([kind, arrival, reply])


def window_ms(case: dict, first: int, last: int) -> float:
    """The most the kernel can have measured from before asks[first] to after asks[last]: from the
    reply to the ask before `first` to the arrival of the ask after `last` (unbounded at an end).
    0 where the grader has no record of those asks: then nothing is credited."""
    asks = case.get("_asks", [])
    if not 0 <= first <= last < len(asks):
        return 0.0
    start = asks[first - 1][2] if first > 0 else -math.inf
    end = asks[last + 1][1] if last + 1 < len(asks) else math.inf
    return 1000 * (end - start)


def credited(lo_ms: float, window: float) -> float:
    """The most the kernel can have measured of one call: its window, with at most TRANSIT_MS of round trip."""
    return max(lo_ms, min(window, lo_ms + TRANSIT_MS))


def _ranks(n: int, p: float) -> tuple[int, int]:
    """The order statistics (0-based) between which every usual definition of the p-quantile of n
    values lies: statistics.quantiles' 'exclusive' (its default) and 'inclusive' (numpy's)."""
    positions = [p * (n + 1), 1 + p * (n - 1)]  # 1-based
    first = min(max(math.floor(min(positions)), 1), n)
    last = min(max(math.ceil(max(positions)), 1), n)
    return first - 1, last - 1


def bounds(lo: Sequence[float], windows: Sequence[float], p: float = 0.5) -> tuple[float, float]:
    """The range the p-quantile of the kernel's measurements of the calls can have, with some slack.

    Below: that quantile of `lo`. Above: that quantile of the calls' windows, each with its round trip
    credited up to TRANSIT_MS over the larger of its `lo` and the quantile's (a call below the quantile
    that a slow trip lifted above it does not fail a correct timer), and one call, any one, credited
    its whole window (a pause of the kernel, however long, on one call does not either). So no answer
    passes beyond the next call's `lo` plus TRANSIT_MS: the cases put two calls at each quantile."""
    first, last = _ranks(len(lo), p)
    floor = sorted(lo)[last]
    hi = [max(a, min(w, max(a, floor) + TRANSIT_MS)) for a, w in zip(lo, windows)]
    top = max(sorted(hi[:j] + [max(hi[j], windows[j])] + hi[j + 1 :])[last] for j in range(len(hi)))
    return sorted(lo)[first] * (1 - REL) - ABS_MS, top * (1 + REL) + ABS_MS


def likely(lo: Sequence[float], windows: Sequence[float]) -> list[float]:
    """Each call about as a kernel that does not dawdle timed it: its window holds the call's own trip
    out and back and, around them, the trips back before it and out after it, so about half of its
    window's round trip is the call's own (credited up to TRANSIT_MS)."""
    return [a + min(max(w - a, 0.0), 2 * TRANSIT_MS) / 2 for a, w in zip(lo, windows)]


def nearest_mistake(got: float, mistakes: dict[str, tuple[float, float, float]]) -> str | None:
    """The familiar mistake that `got` is, or None. Each mistake comes as its value on the calls' `lo`
    (as a kernel that dawdled, or saw no round trip, timed them), on their `likely` times and on the
    most `credited` to them. A mistake is a candidate if `got` lies between the first and the last
    (10% either side); of the candidates, the nearest to the range from its first to its second value
    is the one, or if several hold `got`, the nearest to its first."""

    def distance(values: tuple[float, float, float]) -> tuple[bool, float, float]:
        low, typical, high = values
        outside = not 0.9 * low <= got <= 1.1 * high
        off = max(low - got, got - typical, 0.0) / (typical or 1e-9)
        return outside, off, abs(got - low) / (low or 1e-9)

    why, values = min(mistakes.items(), key=lambda kv: distance(kv[1]))
    return None if distance(values)[0] else why
