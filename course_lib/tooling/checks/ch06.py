"""Checks for exercise 06 (profiling). The profiles are drawn fresh by the grader from four
scenarios, with the chapter's diagnosis (course_lib.chapters.traces.diagnose) as the reference;
the timing check hands the learner's helper a fake asynchronous device whose work only ends
when `sync()` waits for it, so a helper that forgets to synchronize measures nothing. That device
is the grader (TimeIt.host): the kernel side (course_lib/tooling/probes/ch06.py) only asks it to
queue work or to wait, so the durations are never in the learner's kernel."""

from __future__ import annotations

import random
import statistics
from time import perf_counter, sleep  # bound now: a learner who patches time.sleep inline sees no duration

from ...chapters.traces import FIXES, diagnose
from ..grading import Check, CheckFailure, expect_dict, expect_list, expect_number, register

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

DATA_ROW = "enumerate(DataLoader)#_{}DataLoaderIter.__next__"
FORWARD = [
    ("aten::conv2d", 2),
    ("aten::linear", 2),
    ("aten::batch_norm", 1),
    ("aten::relu", 1),
    ("aten::cross_entropy_loss", 1),
]
BACKWARD = [
    ("autograd::engine::evaluate_function: ConvolutionBackward0", 2),
    ("autograd::engine::evaluate_function: AddmmBackward0", 2),
    ("autograd::engine::evaluate_function: NativeBatchNormBackward0", 1),
    ("autograd::engine::evaluate_function: ReluBackward0", 1),
    ("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 1),
]
OPTIMIZER = [("Optimizer.step#AdamW.step", 1), ("Optimizer.zero_grad#AdamW.zero_grad", 1)]
LOW = ("c10::BFloat16", "c10::Half")


def _row(name: str, calls: float, cpu_ms: float, device_ms: float, kernels: float, types: list[str]) -> dict:
    return {
        "name": name,
        "calls": calls,
        "cpu_ms": round(cpu_ms, 4),
        "device_ms": round(device_ms, 4),
        "kernels": kernels,
        "input_types": types,
    }


def _profile(kind: str, rng: random.Random) -> dict:
    """A trace_summary-like profile of one GPU training step with the bottleneck `kind` built in."""
    step = rng.uniform(20, 200)
    low = rng.choice(LOW)
    busy = step * (rng.uniform(0.1, 0.35) if kind in ("data", "overhead") else rng.uniform(0.8, 0.97))
    heavy_types = ([low, low, low] if kind == "fewer_flops" else ["float", "float", "float"]) + ["ScalarList"]
    many = kind == "overhead"  # thousands of tiny kernels, each op slow to issue
    rows = FORWARD + BACKWARD + OPTIMIZER
    weights = [rng.uniform(3, 6) if heavy == 2 else rng.uniform(0.3, 1.0) for _, heavy in rows]
    ops = []
    for (name, heavy), w in zip(rows, weights):
        device = busy * w / sum(weights)
        calls = rng.choice([16, 32, 64, 128]) if many else rng.choice([1, 2, 3, 4])
        kernels = calls * (rng.randint(2, 8) if many else rng.randint(1, 3))
        cpu = (step - busy) * w / sum(weights) * rng.uniform(1, 1.5) if many else kernels * rng.uniform(0.005, 0.02)
        if heavy == 2:  # the matmuls and convolutions: where the compute goes
            types = heavy_types
        elif name.startswith(("Optimizer", "aten::cross_entropy", "autograd::engine::evaluate_function: torch")):
            types = ["float", "float"]  # the loss and the optimizer stay in fp32 under autocast
        else:
            types = [low if kind == "fewer_flops" else "float", "Scalar"]
        ops.append(_row(name, calls, cpu, device, kernels, types))
    if kind == "data":
        ops.append(
            _row(
                DATA_ROW.format(rng.choice(["Single", "MultiProcessing"])), 1, step * rng.uniform(0.45, 0.8), 0.0, 0, []
            )
        )
    else:  # a batch that was ready: a short DataLoader row
        ops.append(_row(DATA_ROW.format("MultiProcessing"), 1, step * rng.uniform(0.005, 0.08), 0.0, 0, []))
    if kind in ("amp", "fewer_flops"):  # the CPU ran ahead and waits for the busy GPU in the loss read-back
        ops.append(_row("aten::item", 1, step * rng.uniform(0.3, 0.7), 0.002, 1, ["float"]))
    rng.shuffle(ops)
    ops.sort(key=lambda r: -max(r["cpu_ms"], r["device_ms"]))
    return {"device": "cuda", "steps": 3, "step_ms": round(step, 3), "ops": ops}


def _describe_profile(p: dict) -> str:
    data = sum(r["cpu_ms"] for r in p["ops"] if r["name"].startswith("enumerate(DataLoader)"))
    busy = sum(r["device_ms"] for r in p["ops"])
    return (
        f"a profile with step_ms={p['step_ms']:.1f}, DataLoader {data / p['step_ms']:.0%} of the step, "
        f"kernels busy {busy / p['step_ms']:.0%}"
    )


@register
class DiagnoseStep(Check):
    name, args, points = "06.diagnose_step", ("diagnose_step",), 3
    hint = (
        "Ask the chapter's three questions in order. 1: the DataLoader row's cpu_ms >= 30% of step_ms -> "
        "('data', 'more_workers'). 2: all rows' device_ms summed < 50% of step_ms -> ('overhead', "
        "'fewer_launches'). 3: otherwise look at the row with the most device_ms: its input_types in bf16/fp16 "
        "-> ('compute', 'fewer_flops'), else ('compute', 'amp'). A big cpu_ms alone (aten::item) is the CPU "
        "waiting, not working."
    )
    forbidden = ("course_lib",)
    forbidden_why = "write the three questions yourself instead of calling course_lib.chapters.traces.diagnose"

    def cases(self, rng: random.Random) -> list:
        kinds = ["data", "overhead", "amp", "fewer_flops"] * 3
        rng.shuffle(kinds)
        return [_profile(k, rng) for k in kinds]

    def describe(self, case: dict) -> str:
        return f"diagnose_step({_describe_profile(case)})"

    def judge(self, cases: list, results: list) -> None:
        for case, got in zip(cases, expect_list(results, "diagnose_step's answers", len(cases))):
            want = list(diagnose(case))
            if got == want:
                continue
            shown = tuple(got) if isinstance(got, list) else got
            if not (isinstance(got, list) and len(got) == 2 and got[1] in FIXES):
                raise CheckFailure(
                    f"{self.describe(case)} returned {shown!r}; expected a pair (bottleneck, fix) "
                    f"with the fix one of {sorted(FIXES)}, here {tuple(want)!r}"
                )
            raise CheckFailure(f"{self.describe(case)} returned {shown!r}, expected {tuple(want)!r}")


def _timing_case(rng: random.Random, m: float) -> dict:
    """Durations whose median, mean and quartiles differ clearly: timed calls in clusters around
    0.7 m (the lower quartile), m (the median) and 1.4 m (the upper quartile), one at 0.5 m and one
    slow outlier at 8 m; slow warm-up calls (5-7 m), as the first calls of a GPU step are."""
    warmup = rng.randint(2, 4)
    timed = [0.5, 0.7, 0.7, 0.7, 0.7, 1.0, 1.4, 1.4, 1.4, 1.4, 8.0]
    timed = [f * rng.uniform(0.98, 1.02) for f in timed]
    rng.shuffle(timed)
    warm = [rng.uniform(5.0, 7.0) for _ in range(warmup)]
    return {"warmup": warmup, "iters": len(timed), "seconds": [round(m * f, 6) for f in warm + timed]}


def _close(got: float, asked: float, real: float) -> bool:
    # a sleep overshoots (more on a busy machine), never undershoots: 15% + 4 ms above what the calls
    # really took as the grader measured them, 10% below what they were asked to take
    return asked * 0.9 - 0.5 <= got <= real * 1.15 + 4.0


def _device(case: dict) -> dict:
    """The grader's record of the fake device's use on one case (TimeIt.host writes it)."""
    return case.setdefault("_device", {"log": "", "busy_until": 0.0, "launched": [], "ran_ms": []})


@register
class TimeIt(Check):
    name, args, points = "06.time_it", ("time_it",), 3
    hint = (
        "Call fn() `warmup` times, then sync() once, so the warm-up's work is finished before any clock starts. "
        "Then for each of `iters` calls: read time.perf_counter(), call fn(), call sync(), read the clock again. "
        "Return {'median_ms': ..., 'q1_ms': ..., 'q3_ms': ...} of those times in milliseconds "
        "(statistics.quantiles(times, n=4) gives the quartiles)."
    )
    time_limit = 40.0

    def cases(self, rng: random.Random) -> list:
        # a short and a long step, far enough apart that no single number passes as both medians
        cases = [_timing_case(rng, rng.uniform(0.008, 0.011)), _timing_case(rng, rng.uniform(0.020, 0.026))]
        rng.shuffle(cases)
        return cases

    def public(self, case: dict) -> dict:
        return {"warmup": case["warmup"], "iters": case["iters"]}  # the durations stay here

    def host(self, case: dict, request: object) -> None:
        """fn() queues one call's work on the fake device; sync() returns once everything queued has run.

        Kept here, not in the kernel: the order of the calls ("f"/"s"), when each call was queued and,
        when a sync has waited for it, how long it took from being queued to being done."""
        d = _device(case)
        if request == {"call": "fn"}:
            seconds, k, now = case["seconds"], d["log"].count("f"), perf_counter()
            d["busy_until"] = max(now, d["busy_until"]) + seconds[min(k, len(seconds) - 1)]
            d["launched"].append(now)
            d["ran_ms"].append(None)
            d["log"] += "f"
            return
        if request != {"call": "sync"}:
            raise CheckFailure(f"{self.name} answers only fn's and sync's calls, not {request!r}")
        d["log"] += "s"
        wait = d["busy_until"] - perf_counter()
        if wait > 0:
            sleep(wait)
        done = perf_counter()
        for k, queued in enumerate(d["launched"]):
            if d["ran_ms"][k] is None:
                d["ran_ms"][k] = 1000 * (done - queued)

    def describe(self, case: dict) -> str:
        return f"time_it(fn, sync, warmup={case['warmup']}, iters={case['iters']})"

    def judge(self, cases: list, results: list) -> None:
        for case, r in zip(cases, expect_list(results, "time_it's answers", len(cases))):
            w, n, call, device = case["warmup"], case["iters"], self.describe(case), _device(case)
            log = device["log"]  # what the grader saw, not what the kernel reports
            if log.count("f") != w + n:
                raise CheckFailure(f"{call} called fn {log.count('f')} times; expected warmup + iters = {w + n}")
            if "s" not in log:
                raise CheckFailure(
                    f"{call} never called sync(): fn() only queues its work, like a CUDA launch, so "
                    "without sync() the clock measures how fast work is queued, not how long it runs"
                )
            calls = log.split("f")  # calls[i] = what happened between the i-th and the (i+1)-th call of fn
            if "s" not in calls[w]:
                raise CheckFailure(
                    f"{call} did not call sync() between the warm-up and the first timed call: the "
                    "warm-up's queued work then runs inside the first timed call"
                )
            missing = [i for i in range(w + 1, w + n + 1) if "s" not in calls[i]]
            if missing:
                raise CheckFailure(
                    f"{call}: timed call {missing[0] - w} of {n} was not followed by sync() before "
                    "the next call or the end: its clock stopped before its work had run"
                )
            got = expect_dict(r, call, ("result",))["result"]
            if not isinstance(got, dict) or not {"median_ms", "q1_ms", "q3_ms"} <= set(got):
                raise CheckFailure(f"{call} returned {got!r}; expected a dict with 'median_ms', 'q1_ms' and 'q3_ms'")
            for k in ("median_ms", "q1_ms", "q3_ms"):
                expect_number(got[k], f"{call} returned {k}={got[k]!r}, which is not a number of ms")
            ms = [1000 * s for s in case["seconds"][w:]]
            # each timed call as the grader measured it, from queued to done, counted at most 5 ms over
            # its duration (a helper that dawdles before sync() cannot stretch the reference)
            real = [min(max(a, b), b + 5.0) for a, b in zip(device["ran_ms"][w:], ms, strict=True)]
            q1, median, q3 = statistics.quantiles(ms, n=4, method="inclusive")
            real_q1, real_median, real_q3 = statistics.quantiles(real, n=4, method="inclusive")
            if not _close(got["median_ms"], median, real_median):
                value = got["median_ms"]
                mistakes = {
                    "that is the mean, which the one slow call pulls up; return the median": statistics.mean(ms),
                    "that includes the slow warm-up calls; time only the last `iters` calls": statistics.median(
                        1000 * s for s in case["seconds"]
                    ),
                }
                why, near = min(mistakes.items(), key=lambda kv: abs(value - kv[1]) / kv[1])
                if median / 2000 <= value <= median / 500:
                    why = "that looks like seconds; return milliseconds"
                elif abs(value - near) > 0.3 * near:
                    why = "the median of the timed calls is asked for"
                raise CheckFailure(
                    f"{call} returned median_ms={value!r}, but the median timed call took about {median:.1f} ms: {why}"
                )
            for key, want, real_want in (("q1_ms", q1, real_q1), ("q3_ms", q3, real_q3)):
                if not _close(got[key], want, real_want):
                    raise CheckFailure(
                        f"{call} returned {key}={got[key]!r}, but the {key[:2]} quartile of the timed "
                        f"calls is about {want:.1f} ms"
                    )
