"""Exercise 06's checks accept right answers and reject wrong ones, judged as the grader judges them.

Each check runs through course_lib.tooling.grading.run_check (inputs and references in this
process, answers through JSON). The reference solutions pass on fresh inputs; hard-coded
answers, the plausible mistakes (questions asked in the wrong order, the wrong row read, no
warm-up, a mean, a missing synchronize) and the forbidden shortcut fail, each with a message
that says what went wrong.
"""

from __future__ import annotations

import random
import statistics
import time

import pytest
from checking import fails, judged_cells, passes, verdict
from test_checks import passes_in_a_separate_kernel, separate_kernel  # the kernel in another process

from course_lib.chapters.ch06.traces import diagnose_trace
from course_lib.tooling.checks import ch06

# --------------------------------------------------------------------------- task 1: the bottleneck


def _data(p):
    return sum(r["cpu_ms"] for r in p["ops"] if r["name"].startswith("enumerate(DataLoader)"))


def diagnose_step(p):
    if _data(p) >= 0.3 * p["step_ms"]:
        return "data", "more_workers"
    if sum(r["device_ms"] for r in p["ops"]) < 0.5 * p["step_ms"]:
        return "overhead", "fewer_launches"
    heaviest = max(p["ops"], key=lambda r: r["device_ms"])
    low = any(t in ("c10::BFloat16", "c10::Half") for t in heaviest["input_types"])
    return "compute", "fewer_flops" if low else "amp"


def test_every_scenario_is_drawn_and_far_from_the_thresholds():
    rng = random.Random(0)
    for _ in range(200):
        for kind, want in (("data", "data"), ("overhead", "overhead"), ("amp", "amp"), ("fewer_flops", "fewer_flops")):
            p = ch06._profile(kind, rng)
            step, busy = p["step_ms"], sum(r["device_ms"] for r in p["ops"])
            assert _data(p) / step > 0.4 or _data(p) / step < 0.1
            assert busy / step > 0.75 or busy / step < 0.4
            got = diagnose_trace(p)
            assert (got[0] if kind in ("data", "overhead") else got[1]) == want


def test_diagnose_step_accepts_the_three_questions():
    passes("06.diagnose_step", diagnose_step, times=2)
    passes("06.diagnose_step", lambda p: list(diagnose_step(p)), times=1)  # a list is a pair too


def test_diagnose_step_rejects_hard_coded_answers():
    for answer in (
        ("data", "more_workers"),
        ("overhead", "fewer_launches"),
        ("compute", "amp"),
        ("compute", "fewer_flops"),
    ):
        assert f"returned {answer!r}" in fails("06.diagnose_step", lambda p, a=answer: a)


def test_diagnose_step_rejects_the_questions_in_the_wrong_order():
    def idle_first(p):  # a GPU waiting for data is idle too: asking about kernels first hides the DataLoader
        if sum(r["device_ms"] for r in p["ops"]) < 0.5 * p["step_ms"]:
            return "overhead", "fewer_launches"
        return diagnose_step(p)

    assert "expected ('data', 'more_workers')" in fails("06.diagnose_step", idle_first)


def test_diagnose_step_rejects_reading_the_wrong_row_or_the_wrong_dtype():
    def busiest_cpu_row(p):  # aten::item's long CPU time is the CPU waiting for a busy GPU
        verdict_ = diagnose_step(p)
        if verdict_[0] != "compute":
            return verdict_
        top = max(p["ops"], key=lambda r: r["cpu_ms"])
        return "compute", "fewer_flops" if "c10::BFloat16" in top["input_types"] or "c10::Half" in top[
            "input_types"
        ] else "amp"

    def any_fp32_op(p):  # the loss and the optimizer stay fp32 under autocast: they say nothing
        verdict_ = diagnose_step(p)
        if verdict_[0] != "compute":
            return verdict_
        return "compute", "amp" if any("float" in r["input_types"] for r in p["ops"]) else "fewer_flops"

    def always_amp(p):
        return ("compute", "amp") if diagnose_step(p)[0] == "compute" else diagnose_step(p)

    def bf16_only(p):  # forgets fp16
        verdict_ = diagnose_step(p)
        if verdict_[0] != "compute":
            return verdict_
        heaviest = max(p["ops"], key=lambda r: r["device_ms"])
        return "compute", "fewer_flops" if "c10::BFloat16" in heaviest["input_types"] else "amp"

    for wrong in (busiest_cpu_row, any_fp32_op, always_amp):
        assert "expected ('compute', 'fewer_flops')" in fails("06.diagnose_step", wrong)
    statuses = {verdict("06.diagnose_step", bf16_only, seed=seed)[0] for seed in range(6)}
    assert "failed" in statuses  # fp16 profiles are drawn too


def test_diagnose_step_names_a_fix_that_does_not_exist():
    msg = fails("06.diagnose_step", lambda p: (diagnose_step(p)[0], "buy a GPU"))
    assert "with the fix one of" in msg


def test_diagnose_step_names_the_library_shortcut():
    status, msg = judged_cells(
        "06.diagnose_step",
        "from course_lib.chapters.ch06 import traces",
        "def diagnose_step(p):\n    return traces.diagnose_trace(p)\n",
    )
    assert status == "failed" and "needs course_lib" in msg and "which this task asks you not to use" in msg, msg


# --------------------------------------------------------------------------- task 2: the timing helper


def time_it(fn, sync, warmup=3, iters=10, pick=None):
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1000)
    q1, median, q3 = statistics.quantiles(times, n=4)
    return {"median_ms": pick(times) if pick else median, "q1_ms": q1, "q3_ms": q3}


@pytest.mark.slow
@pytest.mark.timing
def test_time_it_accepts_the_helper_and_any_quartile_method():
    passes("06.time_it", time_it, times=1)

    def numpy_quartiles(fn, sync, warmup=3, iters=10):
        import numpy as np

        for _ in range(warmup):
            fn()
        sync()
        times = []
        for _ in range(iters):
            sync()  # an extra sync before the clock starts is harmless
            t0 = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - t0) * 1000)
        q1, median, q3 = np.percentile(times, [25, 50, 75])
        return {"median_ms": median, "q1_ms": q1, "q3_ms": q3}

    passes("06.time_it", numpy_quartiles, times=1)


def test_time_it_rejects_a_hard_coded_answer():
    def constant(fn, sync, warmup=3, iters=10):
        for _ in range(warmup + iters):
            fn()
            sync()
        return {"median_ms": 16.0, "q1_ms": 11.0, "q3_ms": 22.0}

    assert "returned median_ms=16.0" in fails("06.time_it", constant, seed=1)


@pytest.mark.slow
@pytest.mark.timing
def test_time_it_rejects_no_warmup_a_mean_and_a_missing_sync():
    def no_warmup(fn, sync, warmup=3, iters=10):
        return time_it(fn, sync, 0, iters)

    assert "called fn" in fails("06.time_it", no_warmup)

    assert "mean" in fails(
        "06.time_it", lambda fn, sync, warmup=3, iters=10: time_it(fn, sync, warmup, iters, statistics.mean)
    )

    def no_sync(fn, sync, warmup=3, iters=10):
        return time_it(fn, lambda: None, warmup, iters)

    assert "never called sync()" in fails("06.time_it", no_sync)

    def sync_only_at_the_end(fn, sync, warmup=3, iters=10):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
        sync()
        q1, median, q3 = statistics.quantiles(times, n=4)
        return {"median_ms": median, "q1_ms": q1, "q3_ms": q3}

    assert "between the warm-up and the first timed call" in fails("06.time_it", sync_only_at_the_end)

    def no_sync_after_warmup(fn, sync, warmup=3, iters=10):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - t0) * 1000)
        q1, median, q3 = statistics.quantiles(times, n=4)
        return {"median_ms": median, "q1_ms": q1, "q3_ms": q3}

    assert "between the warm-up and the first timed call" in fails("06.time_it", no_sync_after_warmup)


@pytest.mark.slow
@pytest.mark.timing
def test_time_it_rejects_seconds_and_a_missing_spread():
    def seconds(fn, sync, warmup=3, iters=10):
        return {k: v / 1000 for k, v in time_it(fn, sync, warmup, iters).items()}

    assert "seconds" in fails("06.time_it", seconds)

    def no_spread(fn, sync, warmup=3, iters=10):
        r = time_it(fn, sync, warmup, iters)
        return {"median_ms": r["median_ms"], "q1_ms": r["median_ms"], "q3_ms": r["median_ms"]}

    msg = fails("06.time_it", no_spread)
    assert "quartile of the timed calls" in msg

    def a_tuple(fn, sync, warmup=3, iters=10):
        r = time_it(fn, sync, warmup, iters)
        return r["median_ms"], r["q1_ms"], r["q3_ms"]

    assert "expected a dict" in fails("06.time_it", a_tuple)


# --------------------------------------------------------------------------- the durations stay in the grader

TIME_IT = """
import statistics, time
def time_it(fn, sync, warmup=3, iters=10):
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1000)
    q1, median, q3 = statistics.quantiles(times, n=4)
    return {"median_ms": median, "q1_ms": q1, "q3_ms": q3}
"""
# Shortcuts that read the durations instead of timing: each found them in what the kernel held before.
READS_THE_CLOSURE = """
import statistics
def time_it(fn, sync, warmup=3, iters=10):
    cells = [c.cell_contents for c in fn.__closure__ or ()]
    seconds = next(v for v in cells if isinstance(v, list) and len(v) == warmup + iters)
    for _ in range(warmup + iters):
        fn()
        sync()
    q1, median, q3 = statistics.quantiles([1000 * s for s in seconds[warmup:]], n=4)
    return {"median_ms": median, "q1_ms": q1, "q3_ms": q3}
"""
PATCHES_SLEEP = """
import statistics, time
def time_it(fn, sync, warmup=3, iters=10):
    asked, real = [], time.sleep
    time.sleep = lambda s: (asked.append(s), real(s))[1]
    try:
        for _ in range(warmup):
            fn()
        sync()
        asked.clear()
        for _ in range(iters):
            fn()
            sync()
    finally:
        time.sleep = real
    q1, median, q3 = statistics.quantiles([1000 * s for s in asked], n=4)
    return {"median_ms": median, "q1_ms": q1, "q3_ms": q3}
"""
SCANS_GC = """
import gc, statistics
def time_it(fn, sync, warmup=3, iters=10):
    for _ in range(warmup + iters):
        fn()
        sync()
    case = next(o for o in gc.get_objects() if isinstance(o, dict) and o.get("warmup") == warmup
                and isinstance(o.get("seconds"), list))
    q1, median, q3 = statistics.quantiles([1000 * s for s in case["seconds"][warmup:]], n=4)
    return {"median_ms": median, "q1_ms": q1, "q3_ms": q3}
"""


@pytest.mark.slow
@pytest.mark.timing
def test_time_it_passes_in_a_separate_kernel_that_never_sees_the_durations():
    passes_in_a_separate_kernel("06.time_it", TIME_IT)


@pytest.mark.slow
@pytest.mark.timing
@pytest.mark.parametrize("source", [READS_THE_CLOSURE, PATCHES_SLEEP, SCANS_GC], ids=["closure", "patched sleep", "gc"])
def test_time_it_rejects_reading_the_durations_in_the_kernel(source):
    status, message = separate_kernel("06.time_it", source)
    assert status == "failed", message


@pytest.mark.timing
@pytest.mark.parametrize("source", [READS_THE_CLOSURE, PATCHES_SLEEP], ids=["closure", "patched sleep"])
def test_time_it_rejects_reading_the_durations_inline_too(source):
    namespace = {"__name__": "__main__"}
    exec(source, namespace)
    fails("06.time_it", namespace["time_it"])


@pytest.mark.timing
def test_time_it_reference_cannot_be_stretched_by_waiting_before_sync():
    """The grader measures each call from queued to done; a helper that dawdles before sync() and then
    answers a constant does not move the reference to its constant."""

    def dawdles(fn, sync, warmup=3, iters=10):
        for _ in range(warmup):
            fn()
        sync()
        for _ in range(iters):
            fn()
            time.sleep(0.06)
            sync()
        return {"median_ms": 60.0, "q1_ms": 60.0, "q3_ms": 60.0}

    assert "returned median_ms=60.0" in fails("06.time_it", dawdles)


def test_time_it_public_case_holds_no_durations_and_host_counts_calls():
    from course_lib.tooling.checkbase import CheckFailure
    from course_lib.tooling.checks import get_check

    check = get_check("06.time_it")
    case = check.cases(random.Random(0))[0]
    assert check.public(case) == {"warmup": case["warmup"], "iters": case["iters"]}
    check.host(case, {"call": "fn"})
    check.host(case, {"call": "sync"})
    assert case["_device"]["log"] == "fs" and case["_device"]["ran_ms"][0] >= 1000 * case["seconds"][0]
    with pytest.raises(CheckFailure):
        check.host(case, {"call": "fn", "calls": 1})  # a count sent by the kernel is not taken


# --------------------------------------------------------------------------- answers of the wrong shape


@pytest.mark.parametrize("answer", [(), ("data",), ("data", "more_workers", "now")])
def test_diagnose_step_rejects_anything_but_a_pair(answer):
    assert "expected a pair (bottleneck, fix)" in fails("06.diagnose_step", lambda p: answer)


@pytest.mark.parametrize("value", [[], [12.0], "12", float("nan")])
def test_time_it_rejects_quartiles_that_are_not_finite_numbers(value):
    def wrong(fn, sync, warmup=3, iters=10):
        r = time_it(fn, sync, warmup, iters)
        return {**r, "q1_ms": value}

    assert "which is not a number of ms" in fails("06.time_it", wrong)
