"""Checks for exercise 06 (profiling). The profiles are drawn fresh by the grader from four
scenarios, with the chapter's diagnosis (course_lib.chapters.ch06.traces.diagnose_trace) as the reference;
the timing check hands the learner's helper a fake asynchronous device whose work only ends
when `sync()` waits for it, so a helper that forgets to synchronize measures nothing. That device
is the grader (TimeIt.host): the task side (course_lib/tooling/probes/ch06.py) only asks it to
queue work or to wait, so the durations are never in the task process."""

from __future__ import annotations

import random
import statistics
from time import perf_counter, sleep  # bound now: a learner who patches time.sleep inline sees no duration

from ...chapters.ch06.traces import FIXES, diagnose_trace
from ..checkbase import Check, CheckFailure, expect_dict, expect_list, expect_number, register
from . import timed

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
    forbidden_why = (
        "write the three questions yourself instead of calling course_lib.chapters.ch06.traces.diagnose_trace"
    )

    def cases(self, rng: random.Random) -> list:
        kinds = ["data", "overhead", "amp", "fewer_flops"] * 3
        rng.shuffle(kinds)
        return [_profile(k, rng) for k in kinds]

    def describe(self, case: dict) -> str:
        return f"diagnose_step({_describe_profile(case)})"

    def judge(self, cases: list, results: list) -> None:
        for case, got in zip(cases, expect_list(results, "diagnose_step's answers", len(cases))):
            want = list(diagnose_trace(case))
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
    0.7 m (four: the lower quartile), m (two: the median) and 2.85 m (three: the upper quartile), one at
    0.5 m and one slow outlier at 8.7 m; 4-5 slow warm-up calls (~3 m), as the first calls of a GPU
    step are. On the long case (m of 72-80 ms) the mean (2.05 m) and the median with the warm-ups
    (2.85 m) lie further from m, and from each other, than a call's round trip to the grader can add
    (timed.TRANSIT_MS), so each mistake is told apart. Past each quantile's call another call lies
    close: one call slowed past any allowance does not fail a correct timer (timed.bounds)."""
    warmup = rng.randint(4, 5)
    steps = [0.5, 0.7, 0.7, 0.7, 0.7, 1.0, 1.0, 2.85, 2.85, 2.85, 8.7]
    steps = [f * rng.uniform(0.98, 1.02) for f in steps]
    rng.shuffle(steps)
    warm = [rng.uniform(2.95, 3.15) for _ in range(warmup)]
    return {"warmup": warmup, "iters": len(steps), "seconds": [round(m * f, 6) for f in warm + steps]}


def _device(case: dict) -> dict:
    """The grader's record of the fake device's use on one case (TimeIt.host writes it): the order of
    the calls ("f"/"s"); per fn call when it was queued, when its work was due to end, and once a sync
    has waited for it how long it took from queued to done (ran_ms) and on the device (dev_ms)."""
    return case.setdefault(
        "_device", {"log": "", "busy_until": 0.0, "launched": [], "ends": [], "ran_ms": [], "dev_ms": []}
    )


MEAN = "that is the mean, which the one slow call pulls up; return the median"
WITH_WARMUP = "that includes the slow warm-up calls; time only the last `iters` calls"
SECONDS = "that looks like seconds; return milliseconds"


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
        # a short and a long step (at most 3.5 s in all), far enough apart that no single number passes as
        # both medians, even with all the round trip credited (timed.TRANSIT_MS)
        cases = [_timing_case(rng, rng.uniform(0.008, 0.011)), _timing_case(rng, rng.uniform(0.072, 0.080))]
        rng.shuffle(cases)
        return cases

    def public(self, case: dict) -> dict:
        return {"warmup": case["warmup"], "iters": case["iters"]}  # the durations stay here

    def host(self, case: dict, request: object) -> None:
        """fn() queues one call's work on the fake device; sync() returns once everything queued has run.

        Kept here, not in the task process (`_device`), with when each ask arrived and was answered
        (timed.record_ask)."""
        d = _device(case)
        arrival = perf_counter()
        if request == {"call": "fn"}:
            seconds, k = case["seconds"], d["log"].count("f")
            d["busy_until"] = max(arrival, d["busy_until"]) + seconds[min(k, len(seconds) - 1)]
            d["launched"].append(arrival)
            d["ends"].append(d["busy_until"])
            d["ran_ms"].append(None)
            d["dev_ms"].append(None)
            d["log"] += "f"
            timed.record_ask(case, "fn", arrival, perf_counter())
            return
        if request != {"call": "sync"}:
            raise CheckFailure(f"{self.name} answers only fn's and sync's calls, not {request!r}")
        d["log"] += "s"
        wait = d["busy_until"] - perf_counter()
        if wait > 0:
            sleep(wait)
        done = perf_counter()
        late = done - d["busy_until"] if wait > 0 else 0.0  # a sleep that woke up late kept the device busy
        for k, queued in enumerate(d["launched"]):
            if d["ran_ms"][k] is None:
                d["ran_ms"][k] = 1000 * (done - queued)
                d["dev_ms"][k] = 1000 * (d["ends"][k] + late - queued)
        timed.record_ask(case, "sync", arrival, perf_counter())

    def describe(self, case: dict) -> str:
        return f"time_it(fn, sync, warmup={case['warmup']}, iters={case['iters']})"

    def _calls(self, case: dict) -> tuple[list[float], list[float]]:
        """(lo, windows) of the timed calls as the task process can have timed them, from fn() to the end of its
        sync(): at least each one's time on the device as the grader ran it, at most its window, from the
        reply before its fn() to the next fn() (see timed.py)."""
        w, d = case["warmup"], _device(case)
        kinds = [a[0] for a in case.get("_asks", [])]
        fns = [i for i, kind in enumerate(kinds) if kind == "fn"]
        lo, windows = [], []
        for k in range(w, len(d["dev_ms"])):
            lo.append(d["dev_ms"][k])
            if len(fns) != len(d["dev_ms"]):  # no record of the asks: nothing credited
                windows.append(lo[-1])
                continue
            first = fns[k]
            last = fns[k + 1] - 1 if k + 1 < len(fns) else len(kinds) - 1  # its sync(s), up to the next fn()
            windows.append(timed.window_ms(case, first, last))
        return lo, windows

    def judge(self, cases: list, results: list) -> None:
        results = expect_list(results, "time_it's answers", len(cases))
        # the long case first: there every familiar mistake is furthest from the right answer
        for case, r in sorted(zip(cases, results), key=lambda cr: -sum(cr[0]["seconds"])):
            w, n, call, device = case["warmup"], case["iters"], self.describe(case), _device(case)
            log = device["log"]  # what the grader saw, not what the task process reports
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
            lo, windows = self._calls(case)
            hi = [timed.credited(a, b) for a, b in zip(lo, windows)]
            low, high = timed.bounds(lo, windows, 0.5)
            if not low <= got["median_ms"] <= high:
                value = got["median_ms"]
                # which familiar mistake the answer is, if it is one (timed.nearest_mistake); a warm-up call
                # timed on its own counted from what it was asked to take, with as much round trip
                warm = [1000 * s for s in case["seconds"][:w]]
                likely = timed.likely(lo, windows)
                trip = statistics.median(b - a for a, b in zip(lo, likely)), timed.TRANSIT_MS
                mistakes = {
                    MEAN: (statistics.mean(lo), statistics.mean(likely), statistics.mean(hi)),
                    WITH_WARMUP: tuple(
                        statistics.median([x + extra for x in warm] + calls)
                        for extra, calls in ((0.0, lo), (trip[0], likely), (trip[1], hi))
                    ),
                    SECONDS: tuple(statistics.median(v) / 1000 * k for v, k in ((lo, 0.5), (likely, 1), (hi, 2))),
                }
                why = timed.nearest_mistake(value, mistakes) or "the median of the timed calls is asked for"
                want = statistics.median(lo)
                most = f", at most {high:.1f} ms with the round trips to the grader" if value > high else ""
                raise CheckFailure(
                    f"{call} returned median_ms={value!r}, but the median timed call took about {want:.1f} ms"
                    f"{most}: {why}"
                )
            for key, p in (("q1_ms", 0.25), ("q3_ms", 0.75)):
                low, high = timed.bounds(lo, windows, p)
                if not low <= got[key] <= high:
                    raise CheckFailure(
                        f"{call} returned {key}={got[key]!r}, but the {key[:2]} quartile of the timed "
                        f"calls is about {statistics.quantiles(lo, n=4, method='inclusive')[int(4 * p) - 1]:.1f} ms"
                    )
