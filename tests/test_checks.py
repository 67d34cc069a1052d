"""Every exercise check of chapters 00-02 accepts right answers and rejects wrong ones.

Each check is run exactly as the grader judges it (course_lib.tooling.grading.run_check: inputs
and references in this process, answers through JSON). For every check: the reference solution
passes on fresh inputs, and plausible mistakes, hard-coded answers and forbidden shortcuts fail
with a message that says what is wrong. Functions that stand for notebook code are defined in a
module named __main__, as a notebook cell defines them, so the shortcut detector sees them.
"""

from __future__ import annotations

import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from checking import fails, judged_cells, passes, verdict

from course_lib.chapters.ch01 import format_limits as FL
from course_lib.chapters.ch01 import formats as F
from course_lib.chapters.ch02.autocast_dtypes import module_dtypes
from course_lib.tooling.checks import checks_for

ROOT = Path(__file__).resolve().parents[1]


def notebook_function(source: str, name: str, **names) -> object:
    """A function defined as a notebook cell defines it: in module __main__."""
    namespace = {"__name__": "__main__", "math": math, "torch": torch, "np": np, **names}
    exec(source, namespace)
    return namespace[name]


# --------------------------------------------------------------------------- chapter 00


def choose_precision(cc):
    if cc >= (8, 0):
        return "bf16", False
    if cc >= (7, 0):
        return "fp16", True
    return "fp32", False


def test_choose_precision_accepts_the_rule_and_rejects_common_mistakes():
    passes("00.choose_precision", choose_precision)
    fails("00.choose_precision", lambda cc: ("bf16", False) if cc >= (7, 5) else choose_precision(cc))  # T4 trap
    fails("00.choose_precision", lambda cc: ("fp16", False) if (7, 0) <= cc < (8, 0) else choose_precision(cc))
    fails("00.choose_precision", lambda cc: ("bf16", False))  # a hard-coded answer
    msg = fails("00.choose_precision", lambda cc: choose_precision(cc) if cc[0] < 10 else ("fp32", False))
    assert "returned ('fp32', False), expected ('bf16', False)" in msg  # repr of both, for future GPUs too


def test_choose_precision_names_the_library_shortcut():
    """course_lib is absent from the process that judges the task: the shortcut's import fails there."""
    status, msg = judged_cells(
        "00.choose_precision",
        "from course_lib.device import recommend_precision",
        "def choose_precision(cc):\n    r = recommend_precision(capability=cc)\n"
        "    return r.precision, r.use_grad_scaler",
    )
    assert status == "failed" and "needs course_lib" in msg and "write the rule yourself" in msg, msg


def _timed(fn, warmup, iters, pick):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return pick(times)


@pytest.mark.slow
@pytest.mark.timing
def test_median_step_ms_accepts_the_median_and_rejects_every_shortcut():
    passes("00.median_step_ms", lambda fn, warmup, iters: _timed(fn, warmup, iters, statistics.median), times=1)
    passes(
        "00.median_step_ms", lambda fn, warmup, iters: np.float32(_timed(fn, warmup, iters, statistics.median)), times=1
    )  # a numpy scalar is a number too

    def constant(fn, warmup, iters):
        for _ in range(warmup + iters):
            fn()
        return 5.0

    def with_warmups(fn, warmup, iters):
        return _timed(fn, 0, warmup + iters, statistics.median)

    assert "returned 5.0 ms" in fails("00.median_step_ms", constant)
    assert "fastest call" in fails("00.median_step_ms", lambda fn, warmup, iters: _timed(fn, warmup, iters, min))
    assert "mean" in fails("00.median_step_ms", lambda fn, warmup, iters: _timed(fn, warmup, iters, statistics.mean))
    assert "warm-up" in fails("00.median_step_ms", with_warmups)
    assert "seconds" in fails(
        "00.median_step_ms", lambda fn, warmup, iters: _timed(fn, warmup, iters, statistics.median) / 1000
    )
    assert "called fn" in fails("00.median_step_ms", lambda fn, warmup, iters: _timed(fn, 0, iters, statistics.median))


# --------------------------------------------------------------------------- chapter 01


def decode_fp16(bits):
    sign = -1.0 if bits >> 15 else 1.0
    e, m = (bits >> 10) & 0x1F, bits & 0x3FF
    if e == 31:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * math.ldexp(m, -24)
    return sign * math.ldexp(1024 + m, e - 25)


def round_to_bf16(bits):
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x7FFFFF:
        return 0x7FC0
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def fp_fate(x, fmt):
    return FL.fate(x, fmt)


def bf16_dot_errors(x, y):
    ref = torch.dot(x.double(), y.double())
    xb, yb = x.bfloat16(), y.bfloat16()
    s = torch.zeros((), dtype=torch.bfloat16)
    for a, b in zip(xb, yb):
        s = s + a * b
    return [(abs(v.double() - ref) / abs(ref)).item() for v in (torch.dot(xb.float(), yb.float()), s)]


def dot_sequential_fp32_accumulator(x, y):  # also right: another fp32 summation order
    ref = torch.dot(x.double(), y.double()).item()
    s = np.float32(0)
    for a, b in zip(x.bfloat16().float().tolist(), y.bfloat16().float().tolist()):
        s = np.float32(s + np.float32(a * b))
    return abs(float(s) - ref) / abs(ref), bf16_dot_errors(x, y)[1]


WRONG_CH01 = {
    "01.decode_fp16": {
        "forgets subnormals": lambda b: (
            decode_fp16(b)
            if (b >> 10) & 0x1F or not b & 0x3FF
            else (-1.0 if b >> 15 else 1.0) * math.ldexp(1024 + (b & 0x3FF), -25)
        ),
        "bias 16": lambda b: decode_fp16(b) / 2 if (b >> 10) & 0x1F != 31 else decode_fp16(b),
        "subnormal exponent -15": lambda b: decode_fp16(b) / 2 if not (b >> 10) & 0x1F else decode_fp16(b),
        "no inf or NaN": lambda b: (
            (-1.0 if b >> 15 else 1.0)
            * (
                math.ldexp(b & 0x3FF, -24)
                if not (b >> 10) & 0x1F
                else math.ldexp(1024 + (b & 0x3FF), ((b >> 10) & 0x1F) - 25)
            )
        ),
        "loses -0.0": lambda b: decode_fp16(b) or 0.0,
        "a string": lambda b: str(decode_fp16(b)),
    },
    "01.round_to_bf16": {
        "truncation": lambda b: b >> 16,
        "round half up": lambda b: (
            0x7FC0 if (b & 0x7F800000) == 0x7F800000 and b & 0x7FFFFF else ((b + 0x8000) >> 16) & 0xFFFF
        ),
        "NaN unaware": lambda b: ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF,
    },
    "01.fp_fate": {
        "overflow above max": lambda x, f: "overflow" if abs(x) > F.get_format(f).max else FL.fate(x, f),
        "no subnormals": lambda x, f: "underflow" if FL.fate(x, f) == "subnormal" else FL.fate(x, f),
        "underflow below smallest subnormal": lambda x, f: (
            "underflow" if abs(x) < F.get_format(f).smallest_subnormal else FL.fate(x, f)
        ),
        "bf16 treated as fp16": lambda x, f: FL.fate(x, "fp16"),
    },
    "01.bf16_dot_errors": {
        "inputs not rounded": lambda x, y: (
            (
                abs(torch.dot(x, y).double() - torch.dot(x.double(), y.double())) / torch.dot(x.double(), y.double())
            ).item(),
            bf16_dot_errors(x, y)[1],
        ),
        "naive with torch.dot": lambda x, y: (
            bf16_dot_errors(x, y)[0],
            (
                abs(torch.dot(x.bfloat16(), y.bfloat16()).double() - torch.dot(x.double(), y.double()))
                / torch.dot(x.double(), y.double())
            ).item(),
        ),
        "absolute errors": lambda x, y: [e * torch.dot(x.double(), y.double()).item() for e in bf16_dot_errors(x, y)],
        "one number": lambda x, y: bf16_dot_errors(x, y)[0],
    },
}
RIGHT_CH01 = {
    "01.decode_fp16": decode_fp16,
    "01.round_to_bf16": round_to_bf16,
    "01.fp_fate": fp_fate,
    "01.bf16_dot_errors": bf16_dot_errors,
}


@pytest.mark.parametrize("name", RIGHT_CH01)
def test_chapter_01_checks_accept_the_reference_solution(name):
    passes(name, RIGHT_CH01[name], times=2)


def test_bf16_dot_check_accepts_any_fp32_summation_order():
    passes("01.bf16_dot_errors", dot_sequential_fp32_accumulator, times=1)


@pytest.mark.parametrize("name, mistake", [(n, m) for n, ms in WRONG_CH01.items() for m in ms])
def test_chapter_01_checks_reject_a_plausible_mistake(name, mistake):
    fails(name, WRONG_CH01[name][mistake])


def test_decode_shows_a_representative_counterexample_and_the_matching_hint():
    assert "(normal) mean" in fails("01.decode_fp16", lambda b: float(b))  # wholly wrong: a normal number
    assert "no implicit leading 1" in fails("01.decode_fp16", WRONG_CH01["01.decode_fp16"]["forgets subnormals"])
    assert "keep the sign" in fails("01.decode_fp16", WRONG_CH01["01.decode_fp16"]["loses -0.0"])
    assert "which is not a number" in fails("01.decode_fp16", WRONG_CH01["01.decode_fp16"]["a string"])


@pytest.mark.parametrize(
    "name, source, module",
    [
        (
            "01.decode_fp16",
            "def decode_fp16(bits):\n    return torch.tensor([bits]).to(torch.int16).view(torch.float16).item()",
            "torch",
        ),
        (
            "01.decode_fp16",
            "import struct\ndef decode_fp16(bits):\n    return struct.unpack('<e', bits.to_bytes(2, 'little'))[0]",
            "struct",
        ),
        (
            "01.decode_fp16",
            "def decode_fp16(bits):\n    return float(np.frombuffer(bits.to_bytes(2, 'little'), np.float16)[0])",
            "numpy",
        ),
        (
            "01.decode_fp16",
            "def decode_fp16(bits):\n    return print.__self__.__import__('str' + 'uct')"
            ".unpack('<e', bits.to_bytes(2, 'little'))[0]",
            "struct",
        ),
        (
            "01.round_to_bf16",
            "def round_to_bf16(bits):\n"
            "    x = torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)\n"
            "    return x.to(torch.bfloat16).view(torch.int16).item() & 0xFFFF",
            "torch",
        ),
    ],
)
def test_by_hand_tasks_name_the_library_shortcut(name, source, module):
    """The shortcut's module is absent from the process that judges a "by hand" task, however it is reached."""
    status, msg = judged_cells(name, "import math, torch\nimport numpy as np", source)
    assert status == "failed" and module in msg and "which this task asks you not to use" in msg, msg
    assert "plain Python" in msg


# --------------------------------------------------------------------------- chapter 02


def predict_ref(op, device_type, autocast_dtype, input_dtypes):
    if op in ("linear", "matmul"):
        return autocast_dtype
    if op == "mse_loss" or (device_type == "cuda" and op in ("softmax", "layer_norm", "sum")):
        return torch.float32
    return torch.float32 if torch.float32 in input_dtypes else input_dtypes[0]


def test_predict_dtype_accepts_the_rule_and_rejects_wrong_rules():
    passes("02.predict_dtype", predict_ref, times=1)
    fails("02.predict_dtype", lambda op, d, dt, ins: dt)  # "everything runs in 16 bits"
    fails("02.predict_dtype", lambda op, d, dt, ins: ins[0])  # "autocast changes nothing"
    fails(
        "02.predict_dtype", lambda op, d, dt, ins: torch.float32 if op == "mse_loss" else predict_ref("add", d, dt, ins)
    )
    fails("02.predict_dtype", lambda op, d, dt, ins: str(predict_ref(op, d, dt, ins)))  # a string, not a dtype
    from course_lib.chapters.ch02.autocast_policy import fake_cuda_available

    if fake_cuda_available() or torch.cuda.is_available():  # the CUDA lists applied on the CPU too
        fails("02.predict_dtype", lambda op, d, dt, ins: predict_ref(op, "cuda", dt, ins))


def test_predict_dtype_names_the_library_shortcut():
    shortcut = "def predict_dtype(op, d, dt, ins):\n    return output_dtype(op, d, dt, ins, fake=d == 'cuda')"
    status, msg = judged_cells(
        "02.predict_dtype", "from course_lib.chapters.ch02.autocast_policy import output_dtype", shortcut
    )
    assert status == "failed" and "needs course_lib" in msg and "which this task asks you not to use" in msg, msg


def _sqdist_factory(cast_inputs=True, fwd=True, bwd=True, grad_factor=1.0, swap_device=False):
    def make(device_type):
        dev = ("cuda" if device_type == "cpu" else "cpu") if swap_device else device_type

        class SqDist(torch.autograd.Function):
            @staticmethod
            def forward(ctx, a, b):
                ctx.save_for_backward(a, b)
                return (a * a).sum(1, keepdim=True) + (b * b).sum(1) - 2 * a @ b.T

            @staticmethod
            def backward(ctx, g):
                a, b = ctx.saved_tensors
                return (grad_factor * 2 * (g.sum(1, keepdim=True) * a - g @ b), 2 * (g.sum(0)[:, None] * b - g.T @ a))

        if fwd:
            deco = torch.amp.custom_fwd(device_type=dev, cast_inputs=torch.float32 if cast_inputs else None)
            SqDist.forward = staticmethod(deco(SqDist.__dict__["forward"].__func__))
        if bwd:
            SqDist.backward = staticmethod(torch.amp.custom_bwd(device_type=dev)(SqDist.__dict__["backward"].__func__))
        return SqDist

    return make


def test_make_sqdist_accepts_the_reference_and_rejects_unsafe_versions():
    passes("02.make_sqdist", _sqdist_factory(), times=2)
    assert "float32" in fails("02.make_sqdist", _sqdist_factory(fwd=False, bwd=False))  # no decorators
    fails("02.make_sqdist", _sqdist_factory(cast_inputs=False))  # forward runs under autocast
    assert "custom_bwd" in fails("02.make_sqdist", _sqdist_factory(bwd=False))  # backward under autocast
    fails("02.make_sqdist", _sqdist_factory(swap_device=True))  # decorated for the other device
    assert "gradient for a" in fails("02.make_sqdist", _sqdist_factory(grad_factor=0.5))
    assert "Function subclass" in fails("02.make_sqdist", lambda device_type: "not a Function")


def islands_ref(model, x, device_type, dtype):
    found = []

    def hook(name):
        def record(mod, args, out):
            if args[0].dtype in (torch.float16, torch.bfloat16) and out.dtype == torch.float32:
                found.append(name)

        return record

    hooks = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if not list(m.children())]
    with torch.autocast(device_type, dtype=dtype):
        model(x)
    for h in hooks:
        h.remove()
    return found


UPCASTS_ON_CPU = (nn.ReflectionPad1d, nn.ReplicationPad1d)


def structural_rule(model, x, device_type, dtype):
    """Never runs autocast: walks the layers knowing chapter 02's CPU and CUDA lists by type."""
    found, low = [], False
    cuda_fp32 = (nn.GroupNorm, nn.Softmax, nn.Upsample)
    for name, m in model.named_modules():
        if list(m.children()):
            continue
        if isinstance(m, nn.Conv1d):
            low = True
        elif low and (isinstance(m, UPCASTS_ON_CPU) or (device_type == "cuda" and isinstance(m, cuda_fp32))):
            found.append(name)
            low = False
    return found


def test_find_fp32_islands_accepts_the_reference_and_rejects_wrong_answers():
    passes("02.find_fp32_islands", islands_ref, times=2)

    def every_fp32_output(model, x, device_type, dtype):  # forgets to look at the input dtype
        rows = module_dtypes(model, x, device_type=device_type, dtype=dtype)
        return [r.name for r in rows if r.out_dtype == torch.float32]

    fails("02.find_fp32_islands", every_fp32_output)
    fails("02.find_fp32_islands", lambda model, x, device_type, dtype: [])
    fails("02.find_fp32_islands", lambda model, x, device_type, dtype: islands_ref(model, x, device_type, dtype) * 2)


def test_find_fp32_islands_defeats_a_rule_that_never_runs_autocast():
    rejected = sum(verdict("02.find_fp32_islands", structural_rule, seed=seed)[0] == "failed" for seed in range(10))
    assert rejected >= 9, f"the structural rule passed {10 - rejected} of 10 fresh checks"


def test_every_check_has_points_and_a_hint():
    for chapter in ("00", "01", "02"):
        assert checks_for(chapter) and all(c.hint and c.points >= 2 for c in checks_for(chapter))


@pytest.mark.timing
def test_median_step_ms_allows_for_sleeps_that_overshoot_on_a_busy_machine():
    """CI: every sleep ran ~5 ms late while the grader ran two notebooks; the true median then passes,
    judged against what the grader measured the calls really slept; 10 ms above it still fails, late or on time."""
    from course_lib.tooling.checkbase import CheckFailure
    from course_lib.tooling.checks import ch00

    check = next(c for c in checks_for("00") if c.name == "00.median_step_ms")
    case = ch00._timing_case(random.Random(3))
    ms = [1000 * x for x in case["seconds"]]
    late = [m + 5.0 for m in ms]
    got = statistics.median(late[case["warmup"] :])
    check.judge([{**case, "_slept_ms": late}], [{"ms": got}])
    with pytest.raises(CheckFailure, match="median timed call"):
        check.judge([{**case, "_slept_ms": late}], [{"ms": got + 10.0}])
    with pytest.raises(CheckFailure):
        check.judge([{**case, "_slept_ms": ms}], [{"ms": got + 10.0}])


# --------------------------------------------------------------------------- the durations stay in the grader


def separate_kernel(name: str, source: str, seed: int | None = None) -> tuple[str, str]:
    """(status, message) for `source`, a notebook cell defining the task's function, judged as the batch
    grader judges it: in a task process of its own, shown only the public cases, whose probe's
    `probes.ask` reaches this process, where the check's `host` answers it."""
    return judged_cells(name, source, seed=seed)


MEDIAN_STEP_MS = """
import statistics, time
def median_step_ms(fn, warmup=3, iters=10):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)
"""
# Shortcuts that read the durations instead of timing: each found them in what the kernel held before.
READS_THE_CLOSURE = """
import statistics
def median_step_ms(fn, warmup=3, iters=10):
    cells = [c.cell_contents for c in fn.__closure__ or ()]
    seconds = next(v for v in cells if isinstance(v, list) and len(v) == warmup + iters)
    for _ in range(warmup + iters):
        fn()
    return 1000 * statistics.median(seconds[warmup:])
"""
PATCHES_SLEEP = """
import statistics, time
def median_step_ms(fn, warmup=3, iters=10):
    asked, real = [], time.sleep
    time.sleep = lambda s: (asked.append(s), real(s))[1]
    try:
        for _ in range(warmup + iters):
            fn()
    finally:
        time.sleep = real
    return 1000 * statistics.median(asked[warmup:])
"""
SCANS_GC = """
import gc, statistics
def median_step_ms(fn, warmup=3, iters=10):
    for _ in range(warmup + iters):
        fn()
    found = [o for o in gc.get_objects() if isinstance(o, dict) and o.get("warmup") == warmup
             and isinstance(o.get("seconds"), list)]
    return 1000 * statistics.median(found[0]["seconds"][warmup:])
"""
READS_FN_GLOBALS = """
import statistics
def median_step_ms(fn, warmup=3, iters=10):
    for _ in range(warmup + iters):
        fn()
    lists = [v for v in fn.__globals__.values() if isinstance(v, list) and len(v) == warmup + iters
             and all(isinstance(x, float) for x in v)]
    return 1000 * statistics.median(lists[0][warmup:])
"""


def passes_in_a_separate_kernel(name: str, source: str, tries: int = 3) -> None:
    """At least one of `tries` runs passes. Each call's time as the learner measures it holds the kernel's
    wake-up after the grader's reply, which the grader cannot see: on a machine shared by several test
    runs (load well above its cores) that alone can add ~10 ms to most calls of one run."""
    messages = []
    for _ in range(tries):
        status, message = separate_kernel(name, source)
        if status == "passed":
            return
        messages.append(message)
    raise AssertionError(f"{name} failed {tries} times in a separate kernel: {messages}")


@pytest.mark.slow
@pytest.mark.timing
def test_median_step_ms_passes_in_a_separate_kernel_that_never_sees_the_durations():
    passes_in_a_separate_kernel("00.median_step_ms", MEDIAN_STEP_MS)


@pytest.mark.parametrize(
    "source",
    [READS_THE_CLOSURE, PATCHES_SLEEP, SCANS_GC, READS_FN_GLOBALS],
    ids=["closure", "patched sleep", "gc", "fn globals"],
)
@pytest.mark.slow
@pytest.mark.timing
def test_median_step_ms_rejects_reading_the_durations_in_the_kernel(source):
    status, message = separate_kernel("00.median_step_ms", source)
    assert status == "failed", message


@pytest.mark.parametrize(
    "source", [READS_THE_CLOSURE, PATCHES_SLEEP, READS_FN_GLOBALS], ids=["closure", "patched sleep", "fn globals"]
)
@pytest.mark.timing
def test_median_step_ms_rejects_reading_the_durations_inline_too(source):
    fails("00.median_step_ms", notebook_function(source, "median_step_ms"))


def test_median_step_ms_public_case_holds_no_durations():
    check = next(c for c in checks_for("00") if c.name == "00.median_step_ms")
    for case in check.cases(random.Random(0)):
        assert check.public(case) == {"warmup": case["warmup"], "iters": case["iters"]}


def test_median_step_ms_counts_calls_itself_and_answers_only_fn():
    from course_lib.tooling.checkbase import CheckFailure

    check = next(c for c in checks_for("00") if c.name == "00.median_step_ms")
    case = check.cases(random.Random(0))[0]
    check.host(case, {"call": "fn"})
    assert len(case["_slept_ms"]) == 1 and case["_slept_ms"][0] >= 1000 * case["seconds"][0]
    with pytest.raises(CheckFailure):
        check.host(case, {"call": "fn", "calls": 99})  # a count sent by the kernel is not taken


# --------------------------------------------------------------------------- answers of the wrong shape


@pytest.mark.parametrize("answer", [(), ("bf16",), ("bf16", False, "extra"), "bf16"])
def test_choose_precision_rejects_anything_but_a_pair(answer):
    assert "expected a pair (precision, use_grad_scaler)" in fails("00.choose_precision", lambda cc: answer)


@pytest.mark.parametrize("answer", [[], [12.0], "12", math.nan])
def test_median_step_ms_rejects_an_answer_that_is_not_a_finite_number(answer):
    def returns(fn, warmup, iters):
        for _ in range(warmup + iters):
            fn()
        return answer

    assert "expected a" in fails("00.median_step_ms", returns)


@pytest.mark.parametrize("answer", [[], [1e-3], [1e-3, 1e-2, 1e-1]])
def test_bf16_dot_errors_rejects_a_list_of_the_wrong_length(answer):
    assert "expected a pair of numbers" in fails("01.bf16_dot_errors", lambda x, y: answer)


def test_bf16_dot_errors_rejects_nan_errors():
    # NaN is never "further than the tolerance" from anything: it must be refused before comparing
    assert "expected a finite number" in fails("01.bf16_dot_errors", lambda x, y: [math.nan, math.nan])


def test_fp_fate_rejects_an_empty_answer():
    assert "so the answer is" in fails("01.fp_fate", lambda x, fmt: [])


@pytest.mark.parametrize("out", [[], [[1.0, 2.0]], 3.0])
def test_make_sqdist_judge_rejects_an_output_of_the_wrong_shape(out):
    """backward(g) refuses a wrong-shaped output in the kernel already; the judge checks the shape anyway,
    before comparing, so an answer that arrives empty or short is named as such."""
    from course_lib.tooling.checkbase import CheckFailure
    from course_lib.tooling.checks import get_check

    check = get_check("02.make_sqdist")
    case = check.cases(random.Random(0))[0]
    grads = {f"grad_{k}": {"array": case[k], "dtype": "float64"} for k in ("a", "b")}
    answer = {
        "out": out if isinstance(out, float) else {"array": out, "dtype": "float64"},
        "out_dtype": {"dtype": "float64"},
        **grads,
    }
    with pytest.raises(CheckFailure, match=r"expected the output to be a \(\d, \d\) tensor of squared distances"):
        check.judge([case], [answer])


def test_make_sqdist_rejects_nan_outputs_under_autocast():
    def nan_under_autocast(device_type):
        class Nan(torch.autograd.Function):  # right outside autocast, NaN inside, with the right gradients
            @staticmethod
            def forward(ctx, a, b):
                ctx.save_for_backward(a, b)
                out = ((a.double()[:, None] - b.double()[None]) ** 2).sum(-1)
                return out.float() * math.nan if torch.is_autocast_enabled(device_type) else out.to(a.dtype)

            @staticmethod
            def backward(ctx, g):
                a, b = ctx.saved_tensors
                return 2 * (g.sum(1, keepdim=True) * a - g @ b), 2 * (g.sum(0)[:, None] * b - g.T @ a)

        return Nan

    assert "inf/NaN" in fails("02.make_sqdist", nan_under_autocast)


def test_find_fp32_islands_says_what_an_empty_list_misses():
    msg = fails("02.find_fp32_islands", lambda model, x, device_type, dtype: [])
    assert "returned []; expected [" in msg and "missed" in msg


# --------------------------------------------------------------------------- the kernel side holds no check module


@pytest.mark.parametrize("chapter", ["00", "01", "02", "06", "09"])
def test_probes_run_without_the_check_modules(chapter):
    """The grader's kernel has no course_lib/tooling/checks: the probes must not need it, nor its references."""
    code = (
        f"import sys, course_lib.tooling.probes.ch{chapter}\n"
        "bad = [m for m in sys.modules if m.startswith('course_lib.tooling.checks')]\n"
        "assert not bad, bad"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-600:]
    assert all("run" not in type(c).__dict__ for c in checks_for(chapter))
