"""Checks for exercise 00 (setup and hardware). Inputs are drawn fresh by the grader; the
reference answers are computed in the grader's process (see course_lib.tooling.checkbase).
The task side is course_lib/tooling/probes/ch00.py."""

from __future__ import annotations

import random
import statistics
from time import perf_counter, sleep  # bound now: a learner who patches time.sleep inline sees no duration

from ...device import recommend_precision
from ..checkbase import Check, CheckFailure, expect_dict, expect_list, expect_number, register
from . import timed

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

# Compute capabilities of real NVIDIA GPUs, Kepler to Blackwell.
REAL_CAPABILITIES = [
    (3, 7),
    (5, 0),
    (5, 2),
    (6, 0),
    (6, 1),
    (7, 0),
    (7, 2),
    (7, 5),
    (8, 0),
    (8, 6),
    (8, 7),
    (8, 9),
    (9, 0),
    (10, 0),
    (12, 0),
]


@register
class ChoosePrecision(Check):
    name, args, points = "00.choose_precision", ("choose_precision",), 2
    hint = (
        "Native bf16 needs compute capability >= (8, 0); fp16 Tensor Cores start at (7, 0); only fp16 "
        "needs a GradScaler. Compare tuples directly: (7, 5) >= (7, 0) is True."
    )
    forbidden = ("course_lib",)
    forbidden_why = "write the rule yourself instead of calling course_lib.device"

    def cases(self, rng: random.Random) -> list:
        # every real GPU generation, plus made-up future ones, in a fresh order
        made_up = [(rng.randint(8, 15), rng.randint(0, 9)) for _ in range(3)] + [(rng.randint(1, 6), rng.randint(0, 9))]
        return [list(cc) for cc in rng.sample(REAL_CAPABILITIES, len(REAL_CAPABILITIES)) + made_up]

    def describe(self, case: list) -> str:
        return f"choose_precision({tuple(case)})"

    def judge(self, cases: list, results: list) -> None:
        for cc, got in zip(cases, expect_list(results, "choose_precision's answers", len(cases))):
            want = recommend_precision(capability=tuple(cc))
            expected = (want.precision, want.use_grad_scaler)
            shown = tuple(got) if isinstance(got, list) else got
            if not (isinstance(got, list) and len(got) == 2):
                raise CheckFailure(
                    f"choose_precision({tuple(cc)}) returned {shown!r}; expected a pair (precision, "
                    f"use_grad_scaler), here {expected!r}"
                )
            if shown != expected:
                raise CheckFailure(f"choose_precision({tuple(cc)}) returned {shown!r}, expected {expected!r}")


def _timing_case(rng: random.Random, m: float | None = None) -> dict:
    """Step durations around a median m whose mean, minimum and warm-up-including median all differ clearly.

    Timed calls: multiples of m spread below it (0.15-0.75 m), two at it, one above it (3.1 m) and one
    outlier of 8.9 m; 4-5 warm-up calls take ~3.4 m (like cuDNN autotuning). So the minimum is ~0.15 m,
    the mean ~2.2 m and the median of warm-ups + timed calls 3.1-3.3 m: on the long case (m of 68-75 ms)
    each lies further from m, and from each other, than a call's round trip to the grader can add
    (timed.TRANSIT_MS), so each mistake is told apart. The second call at m lets one call be slowed
    past any allowance without failing a correct timer (timed.bounds).
    """
    m = rng.uniform(0.068, 0.075) if m is None else m
    warmup = rng.randint(4, 5)
    steps = [f * rng.uniform(0.97, 1.03) for f in (0.15, 0.5, 0.75, 1.0, 1.0, 3.1, 8.9)]
    rng.shuffle(steps)
    warm = [rng.uniform(3.25, 3.5) for _ in range(warmup)]
    return {"warmup": warmup, "iters": len(steps), "seconds": [round(m * f, 6) for f in warm + steps]}


# The familiar mistakes, in the words a failure names them
MEAN = "that is the mean, which the one slow call pulls up; return the median"
WITH_WARMUP = "that includes the warm-up calls, which are slow on purpose; time only the last `iters` calls"
FASTEST = "that is the fastest call; the median is the typical one"
SECONDS = "that looks like seconds; return milliseconds"


@register
class MedianStepMs(Check):
    name, args, points = "00.median_step_ms", ("median_step_ms",), 2
    hint = (
        "Call fn() `warmup` times without timing it, then time each of the next `iters` calls separately "
        "(time.perf_counter before and after) and return the median of those times in milliseconds."
    )
    time_limit = 30.0

    def cases(self, rng: random.Random) -> list:
        # a short and a long step (at most 2.8 s in all), far enough apart that no single number passes as
        # both medians, even with all the round trip credited (timed.TRANSIT_MS)
        cases = [_timing_case(rng, rng.uniform(0.004, 0.006)), _timing_case(rng, rng.uniform(0.068, 0.075))]
        rng.shuffle(cases)
        return cases

    def public(self, case: dict) -> dict:
        return {"warmup": case["warmup"], "iters": case["iters"]}  # the durations stay here

    def host(self, case: dict, request: object) -> None:
        """The probe's fn() asks for one call: sleep its duration, and record the call, what it took and when."""
        if request != {"call": "fn"}:
            raise CheckFailure(f"{self.name} answers only fn's calls, not {request!r}")
        arrival = perf_counter()
        slept = case.setdefault("_slept_ms", [])  # one entry per call of fn, counted here, not in the task process
        seconds = case["seconds"]
        sleep(seconds[min(len(slept), len(seconds) - 1)])
        reply = perf_counter()
        slept.append(1000 * (reply - arrival))
        timed.record_ask(case, "fn", arrival, reply)

    def describe(self, case: dict) -> str:
        return f"median_step_ms(fn, warmup={case['warmup']}, iters={case['iters']})"

    def judge(self, cases: list, results: list) -> None:
        results = expect_list(results, "median_step_ms's answers", len(cases))
        # the long case first: there every familiar mistake is furthest from the right answer
        for case, r in sorted(zip(cases, results), key=lambda cr: -sum(cr[0]["seconds"])):
            w, n = case["warmup"], case["iters"]
            call = self.describe(case)
            slept = case.get("_slept_ms", [])  # the grader's own record of fn's calls (host)
            if len(slept) != w + n:
                raise CheckFailure(f"{call} called fn {len(slept)} times; expected warmup + iters = {w + n}")
            got = expect_number(expect_dict(r, call, ("ms",))["ms"], f"{call}, the number of ms it returned")
            # each call as the task process can have timed it: at least what the grader slept (late wake-ups on a
            # busy machine included), at most that plus the round trip to the grader (see timed.py)
            lo = list(slept)
            windows = [timed.window_ms(case, k, k) for k in range(w + n)]
            low, high = timed.bounds(lo[w:], windows[w:])
            if low <= got <= high:
                continue
            # which familiar mistake the answer is, if it is one (timed.nearest_mistake)
            mistakes = {
                MEAN: lambda v: statistics.mean(v[w:]),
                WITH_WARMUP: statistics.median,
                FASTEST: lambda v: min(v[w:]),
                SECONDS: lambda v: statistics.median(v[w:]) / 1000,
            }
            hi, likely = [timed.credited(a, b) for a, b in zip(lo, windows)], timed.likely(lo, windows)
            spans = {k: (f(lo), f(likely), f(hi)) for k, f in mistakes.items()}
            spans[SECONDS] = (spans[SECONDS][0] / 2, spans[SECONDS][1], spans[SECONDS][2] * 2)  # ms / 1000, roughly
            why = timed.nearest_mistake(got, spans)
            want = statistics.median(lo[w:])
            most = f", at most {high:.1f} ms with the round trips to the grader" if got > high else ""
            raise CheckFailure(
                f"{call} returned {got!r} ms, but the median timed call took about {want:.1f} ms{most}: "
                + (why or "the median of the timed calls is the number asked for")
            )
