"""Checks for exercise 00 (setup and hardware). Inputs are drawn fresh by the grader; the
reference answers are computed in the grader's process (see course_lib.tooling.grading).
The kernel side is course_lib/tooling/probes/ch00.py."""

from __future__ import annotations

import random
import statistics
from time import perf_counter, sleep  # bound now: a learner who patches time.sleep inline sees no duration

from ...device import recommend_precision
from ..grading import Check, CheckFailure, expect_dict, expect_list, expect_number, register

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


def _timing_case(rng: random.Random) -> dict:
    """Step durations whose median, mean, minimum and warm-up-including median all differ clearly.

    Timed calls: multiples of a centre m (8-16 ms) spread below and above it, and one outlier of
    ~8.5 m; warm-up calls take 6-8 m (like cuDNN autotuning). So min ~ 0.55 m, mean ~ 2.1 m, and
    the median of warm-ups + timed calls is 1.65 m, 1.8 m or ~3.9 m: only the median of the timed
    calls lands near m, with room for a busy machine's late wake-ups in between.
    """
    m = rng.uniform(0.008, 0.016)
    warmup = rng.randint(3, 5)
    timed = [f * rng.uniform(0.97, 1.03) for f in (0.55, 0.7, 0.85, 1.0, 1.5, 1.8)] + [rng.uniform(8.0, 9.0)]
    rng.shuffle(timed)
    warm = [rng.uniform(6.0, 8.0) for _ in range(warmup)]
    return {"warmup": warmup, "iters": len(timed), "seconds": [round(m * f, 6) for f in warm + timed]}


@register
class MedianStepMs(Check):
    name, args, points = "00.median_step_ms", ("median_step_ms",), 2
    hint = (
        "Call fn() `warmup` times without timing it, then time each of the next `iters` calls separately "
        "(time.perf_counter before and after) and return the median of those times in milliseconds."
    )
    time_limit = 30.0

    def cases(self, rng: random.Random) -> list:
        return [_timing_case(rng) for _ in range(2)]

    def public(self, case: dict) -> dict:
        return {"warmup": case["warmup"], "iters": case["iters"]}  # the durations stay here

    def host(self, case: dict, request: object) -> None:
        """The probe's fn() asks for one call: sleep its duration, and record the call and what it took."""
        if request != {"call": "fn"}:
            raise CheckFailure(f"{self.name} answers only fn's calls, not {request!r}")
        slept = case.setdefault("_slept_ms", [])  # one entry per call of fn, counted here, not in the kernel
        seconds = case["seconds"]
        t0 = perf_counter()
        sleep(seconds[min(len(slept), len(seconds) - 1)])
        slept.append(1000 * (perf_counter() - t0))

    def describe(self, case: dict) -> str:
        return f"median_step_ms(fn, warmup={case['warmup']}, iters={case['iters']})"

    def judge(self, cases: list, results: list) -> None:
        for case, r in zip(cases, expect_list(results, "median_step_ms's answers", len(cases))):
            w, n, ms = case["warmup"], case["iters"], [1000 * s for s in case["seconds"]]
            call = self.describe(case)
            slept = case.get("_slept_ms", [])  # the grader's own record of fn's calls (host)
            if len(slept) != w + n:
                raise CheckFailure(f"{call} called fn {len(slept)} times; expected warmup + iters = {w + n}")
            got = expect_number(expect_dict(r, call, ("ms",))["ms"], f"{call}, the number of ms it returned")
            want = statistics.median(ms[w:])
            # sleep() overshoots, by several ms on a busy machine (the grader runs two notebooks at once):
            # the allowance above is 25% + 2.5 ms over what the timed calls really slept, as the grader
            # measured them (each counted at most 5 ms over the asked-for time), 10% below
            took = [min(max(a, b), b + 5.0) for a, b in zip(slept, ms, strict=True)]
            real = statistics.median(took[w:])
            if want * 0.9 <= got <= real * 1.25 + 2.5:
                continue
            # say which familiar mistake the answer is closest to, if it is close to one (from what the
            # calls really took: a busy machine's late wake-ups would move them out of reach)
            mistakes = {
                "that is the mean, which the one slow call pulls up; return the median": statistics.mean(took[w:]),
                "that includes the warm-up calls, which are slow on purpose; time only the last `iters` "
                "calls": statistics.median(took),
                "that is the fastest call; the median is the typical one": min(took[w:]),
                "that looks like seconds; return milliseconds": real / 1000,
            }
            why, value = min(mistakes.items(), key=lambda kv: abs(got - kv[1]) / kv[1])
            if abs(got - value) > 0.1 * value:
                why = "the median of the timed calls is the number asked for"
            raise CheckFailure(f"{call} returned {got!r} ms, but the median timed call took about {want:.1f} ms: {why}")
