"""Records chapter 09's open performance questions on a GPU: one profiled step of each workload.

    python -m course_lib.chapters.ch09.record_questions --json data/reference/questions_<gpu>.json

Why the course's small CNN gets slower with AMP on a big GPU ("simplecnn"), why fp16 trains ResNet-50
faster than bf16 ("resnet50"), and what holds GPT-2 small's MFU ("gpt"): each step is the core's
`amp_step`, timed by `time_fn` and profiled by torch.profiler, whose trace is summed by kind of kernel
(`kernel_summary`) and per ATen op (`op_table`). course_lib.chapters.ch09.recorded_profiles reads the
file. On a CPU the same code runs at toy size, to test it, not to record. The trace readers, the
back-to-back timer and the GPT set-up are chapter 11's recorder's too (record_roofline, record_fp8).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

from course_lib.chapters.ch01.matmul import peak_tflops
from course_lib.device import pick_device
from course_lib.models import GPT, GPTConfig, SimpleCNN, resnet50
from course_lib.reference import record
from course_lib.timing import synchronize, time_fn
from course_lib.train import AMP_DTYPES, amp_step

__all__: list[str] = []  # a recorder: the chapter reads its file through recorded_profiles


def one_step(model, opt, scaler, x, y, precision: str, forward=None) -> Callable[[], object]:
    """The core's amp_step on one micro-batch (x, y) in `precision` ("fp32", "bf16", "fp16"), as a
    call without arguments: what time_fn and the profiler repeat."""
    dtype = AMP_DTYPES[precision]
    return lambda: amp_step(model, opt, scaler, [(x, y)], dtype, forward=forward)


def back_to_back_ms(fn: Callable[[], object], iters: int, device: torch.device, reps: int = 5, warmup: int = 3) -> dict:
    """ms per call of fn over `iters` calls queued back to back (no sync between them), `reps` samples
    of the core's time_fn: what a kernel costs when the queue is full, not the round trip of one launch."""
    for _ in range(warmup):
        fn()

    def calls() -> None:
        for _ in range(iters):
            fn()

    per_call = [ms / iters for ms in time_fn(calls, warmup=0, iters=reps, device=device).times_ms]
    return {"ms": statistics.median(per_call), "ms_min": min(per_call), "ms_max": max(per_call)}


def profile_trace(step: Callable[[], object], device: torch.device, steps: int = 3, shapes: bool = False) -> dict:
    """Profile `steps` calls of step (after two warm-up calls) and return the Chrome trace as a dict."""
    from torch.profiler import ProfilerActivity, profile, schedule

    warmup = 2
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        with profile(
            activities=acts,
            schedule=schedule(wait=0, warmup=warmup, active=steps),
            record_shapes=shapes,
            on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
        ) as prof:
            for _ in range(warmup + steps):
                step()
                synchronize(device)
                prof.step()
        return json.loads(path.read_text())


KERNEL_CLASSES = (  # first match wins; names as CUDA/cuDNN/cuBLAS/Triton kernels are called
    ("triton (fused)", r"^triton"),
    ("batch_norm", r"batch_norm|batchnorm|bn_fw|bn_bw|bn_|_bn|welford"),
    ("attention", r"flash|fmha|attention|sdpa|softmax_warp"),
    ("optimizer", r"adam|multi_tensor|foreach|fused_sgd|sgd"),
    ("conv/gemm", r"gemm|xmma|cutlass|nvjet|conv|implicit|dgrad|wgrad|sm\d\d_|cudnn|winograd|fft|ampere_|hopper_"),
    ("reduce", r"reduce|sum_|norm_kernel|max_|cross_entropy|log_softmax|nll"),
    ("copy/cast", r"copy|cast|convert|transpose|nchw|nhwc|memcpy|memset|fill"),
    ("elementwise", r"elementwise|vectorized|unrolled|relu|gelu|mul|add|div|threshold"),
)
_DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def kernel_class(name: str) -> str:
    """The kind of a GPU kernel, from its name (KERNEL_CLASSES)."""
    low = name.lower()
    return next((c for c, pat in KERNEL_CLASSES if re.search(pat, low)), "other")


def kernel_summary(trace: dict, steps: int, top: int = 25) -> dict:
    """GPU time per step by kernel class and the `top` kernels (µs per step, calls per step)."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in _DEVICE_EVENTS:
            by_name[e["name"]].append(e["dur"])
    classes: dict[str, float] = defaultdict(float)
    for n, d in by_name.items():
        classes[kernel_class(n)] += sum(d) / steps
    kernels = sorted(
        (
            {"name": n[:160], "class": kernel_class(n), "us": sum(d) / steps, "calls": len(d) / steps}
            for n, d in by_name.items()
        ),
        key=lambda r: -r["us"],
    )
    return {
        "gpu_us_per_step": sum(classes.values()),
        "kernels_per_step": sum(len(d) for d in by_name.values()) / steps,
        "by_class_us": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
        "top": kernels[:top],
    }


def op_table(trace: dict, steps: int, top: int = 60) -> list[dict]:
    """Per innermost ATen op that launched kernels: name, input dims and types, calls and device µs per
    step (kernels linked to their op by the launch's correlation id). A CPU trace: self CPU time."""
    cuda = any(e.get("cat") in _DEVICE_EVENTS for e in trace["traceEvents"])
    evs = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    ops = sorted((e for e in evs if e.get("cat") == "cpu_op"), key=lambda e: (e.get("tid"), e["ts"], -e["dur"]))
    # kineto links a kernel to the op on top of the stack at its launch by "External id"; the launch
    # (cudaLaunchKernel) shares the kernel's "correlation" and is the fallback
    by_ext = {o.get("args", {}).get("External id"): o for o in ops if o.get("args", {}).get("External id") is not None}
    kernels = [k for k in evs if k.get("cat") in _DEVICE_EVENTS]
    missing = {
        k.get("args", {}).get("correlation") for k in kernels if k.get("args", {}).get("External id") not in by_ext
    }
    by_tid: dict = defaultdict(list)
    for o in ops:
        by_tid[o.get("tid")].append(o)
    corr_op: dict = {}
    for ln in (e for e in evs if e.get("cat") in ("cuda_runtime", "cuda_driver")):
        if ln.get("args", {}).get("correlation") not in missing:
            continue
        around = [o for o in by_tid.get(ln.get("tid"), ()) if o["ts"] <= ln["ts"] <= o["ts"] + o["dur"]]
        if around:  # the innermost op around the launch
            corr_op[ln["args"]["correlation"]] = min(around, key=lambda o: o["dur"])
    dev_us: dict[int, float] = defaultdict(float)
    for k in kernels:
        a = k.get("args", {})
        o = by_ext.get(a.get("External id")) or corr_op.get(a.get("correlation"))
        if o is not None:
            dev_us[id(o)] += k["dur"]
    rows: dict[tuple, dict] = {}
    for o in ops:
        us = dev_us.get(id(o), 0.0) if cuda else o["dur"]
        if cuda and not us:
            continue
        args = o.get("args", {})
        key = (o["name"], json.dumps(args.get("Input Dims")), json.dumps(args.get("Input type")))
        r = rows.setdefault(
            key,
            {"op": o["name"], "dims": args.get("Input Dims"), "types": args.get("Input type"), "calls": 0, "us": 0.0},
        )
        r["calls"] += 1 / steps
        r["us"] += us / steps
    return sorted(rows.values(), key=lambda r: -r["us"])[:top]


def toy_gpt_config(device: torch.device) -> GPTConfig:
    """GPT-2 small on a GPU; off it, a toy GPT that tests the code in seconds."""
    if device.type == "cuda":
        return GPTConfig()
    return GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64)


def gpt_setup(device: torch.device, batch: int, seq: int, fused: bool = True, compiled: bool = False):
    """A seeded GPT, AdamW (fused or foreach), a random batch, and the forward that returns the loss:
    (model, opt, x, y, forward)."""
    torch.manual_seed(0)
    c = toy_gpt_config(device)
    model = GPT(c).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, **({"fused": True} if fused else {"foreach": True}))
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, c.vocab_size, (batch, seq), device=device, generator=g)
    y = torch.randint(0, c.vocab_size, (batch, seq), device=device, generator=g)
    fwd_model = torch.compile(model) if compiled else model
    return model, opt, x, y, (lambda a, b: fwd_model(a, b)[1])


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _timed_profile(step: Callable[[], object], device: torch.device, warmup: int, iters: int, **summary) -> dict:
    """time_fn's median and quartiles of `step`, and its profiled kernels and ops."""
    t = time_fn(step, warmup=warmup, iters=iters, device=device)
    trace = profile_trace(step, device, steps=3, shapes=True)
    return {
        "ms_per_step": t.median_ms,
        "ms_q1": t.quartiles_ms[0],
        "ms_q3": t.quartiles_ms[1],
        "kernels": kernel_summary(trace, 3, **summary),
        "ops": op_table(trace, 3, top=25),
    }


def q_simplecnn(device: torch.device, batch: int) -> dict:
    """The course's small CNN: why AMP is slower on a big GPU. Data on the device, so only the step."""
    cuda, out = device.type == "cuda", {}
    for label, prec, cl in (("fp32", "fp32", False), ("bf16", "bf16", False), ("bf16 + channels_last", "bf16", True)):
        torch.manual_seed(0)
        model = SimpleCNN().to(device)
        x = torch.randn(batch, 1, 28, 28, device=device)
        if cl:
            model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (batch,), device=device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = one_step(model, opt, torch.amp.GradScaler(device.type, enabled=False), x, y, prec)
        torch.backends.cudnn.benchmark = cuda
        t = time_fn(step, warmup=5, iters=30 if cuda else 3, device=device)
        loop = back_to_back_ms(step, iters=20 if cuda else 2, device=device, reps=3)
        trace = profile_trace(step, device, steps=3, shapes=True)
        torch.backends.cudnn.benchmark = False
        out[label] = {
            "batch": batch,
            "ms_per_step": t.median_ms,
            "ms_q1": t.quartiles_ms[0],
            "ms_q3": t.quartiles_ms[1],
            "ms_per_step_back_to_back": loop["ms"],
            "kernels": kernel_summary(trace, 3, top=15),
            "ops": op_table(trace, 3, top=25),
        }
    return out


def q_resnet50(device: torch.device, batch: int) -> dict:
    """fp16 against bf16 on ResNet-50 (channels_last, AMP): step time and where the GPU time goes."""
    cuda, out = device.type == "cuda", {}
    size = 224 if cuda else 64
    for prec in ("fp16", "bf16"):
        torch.manual_seed(0)
        model = resnet50().to(device).to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        scaler = torch.amp.GradScaler(device.type, enabled=prec == "fp16")
        x = torch.randn(batch, 3, size, size, device=device).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device=device)
        torch.backends.cudnn.benchmark = cuda
        row = _timed_profile(one_step(model, opt, scaler, x, y, prec), device, 5, 15 if cuda else 2)
        torch.backends.cudnn.benchmark = False
        out[prec] = {"batch": batch, "image_size": size, **row, "images_per_s": batch / row["ms_per_step"] * 1e3}
        del model, opt, x
        _release(device)
    return out


def q_gpt(device: torch.device, batches: tuple[int, ...], deadline: float = float("inf")) -> dict:
    """GPT-2 small with the full recipe (bf16 autocast, SDPA, torch.compile, fused AdamW): MFU, and
    where the GPU time of a step goes (GEMMs, attention, fused Triton kernels, optimizer, idle). A batch
    reached after `deadline` (time.monotonic) is skipped, once one has been measured."""
    cuda = device.type == "cuda"
    seq = 1024 if cuda else 64
    peak = peak_tflops(torch.cuda.get_device_name(device), "bf16") if cuda else None
    out: dict = {"rows": [], "mfu_peak_tflops": peak}
    for batch in batches:
        if time.monotonic() > deadline and out["rows"]:
            out["rows"].append({"batch": batch, "note": "skipped: the call's deadline"})
            continue
        torch._dynamo.reset()
        model, opt, x, y, fwd = gpt_setup(device, batch, seq, compiled=cuda)
        step = one_step(model, opt, torch.amp.GradScaler(device.type, enabled=False), x, y, "bf16", forward=fwd)
        t0 = time.monotonic()
        step()
        synchronize(device)
        compile_s = time.monotonic() - t0
        t = time_fn(step, warmup=3, iters=10 if cuda else 2, device=device)
        flops_tok = model.flops_per_token(seq)
        c = model.config
        attn_tok = 12 * c.n_layer * c.n_embd * seq
        tokens = batch * seq
        ks = kernel_summary(profile_trace(step, device, steps=3), 3, top=20)
        gemm_us = ks["by_class_us"].get("conv/gemm", 0.0)
        attn_us = ks["by_class_us"].get("attention", 0.0)
        out["rows"].append(
            {
                "batch": batch,
                "seq": seq,
                "compile_s": compile_s,
                "ms_per_step": t.median_ms,
                "ms_q1": t.quartiles_ms[0],
                "ms_q3": t.quartiles_ms[1],
                "tokens_per_s": tokens / t.median_ms * 1e3,
                "flops_per_token": flops_tok,
                "mfu": flops_tok * tokens / (t.median_ms * 1e-3) / (peak * 1e12) if peak else None,
                "gpu_busy": ks["gpu_us_per_step"] / (t.median_ms * 1e3),
                "gemm_tflops": (flops_tok - attn_tok) * tokens / (gemm_us * 1e-6) / 1e12 if gemm_us else None,
                "attention_tflops": attn_tok * tokens / (attn_us * 1e-6) / 1e12 if attn_us else None,
                "kernels": ks,
            }
        )
        del model, opt, step
        _release(device)
    return out


def questions(device: torch.device, deadline: float = float("inf")) -> dict:
    """The three questions' payload: {"simplecnn", "resnet50", "gpt"}, full size on a GPU, toy size off it."""
    cuda = device.type == "cuda"
    return {
        "simplecnn": q_simplecnn(device, 256 if cuda else 32),
        "resnet50": q_resnet50(device, 128 if cuda else 2),
        "gpt": q_gpt(device, (16, 32) if cuda else (2,), deadline),
    }


def summary(payload: dict) -> str:
    """What a recording printed: one line per SimpleCNN mode, ResNet-50 precision and GPT batch."""
    lines = []
    for k, v in payload["simplecnn"].items():
        kk = v["kernels"]
        lines.append(
            f"SimpleCNN {k}: {v['ms_per_step']:.3f} ms/step (back to back {v['ms_per_step_back_to_back']:.3f}), "
            f"GPU busy {kk['gpu_us_per_step'] / 1e3:.3f} ms in {kk['kernels_per_step']:.0f} kernels"
        )
    for k, v in payload["resnet50"].items():
        lines.append(
            f"ResNet-50 {k} + CL: {v['images_per_s']:.0f} img/s; GPU ms by class: "
            + ", ".join(f"{c} {us / 1e3:.1f}" for c, us in v["kernels"]["by_class_us"].items())
        )
    for r in payload["gpt"]["rows"]:
        if "mfu" in r:
            lines.append(
                f"GPT batch {r['batch']}: {r['ms_per_step']:.1f} ms, MFU {r['mfu'] or 0:.3f}, "
                f"busy {r['gpu_busy']:.2f}, "
                f"GEMM {r['gemm_tflops'] or 0:.0f} TFLOP/s, attention {r['attention_tflops'] or 0:.0f} TFLOP/s"
            )
    return "\n".join(lines)


def run_recorder(
    module: str,
    doc: str,
    study: Callable[[torch.device, float], dict],
    summary: Callable[[dict], str],
    argv: list[str] | None = None,
) -> int:
    """What every GPU recorder of chapters 09 and 11 does from its command line: parse --json, --device and
    --deadline (seconds after which optional parts are skipped), run `study(device, deadline)` (the deadline
    as a time.monotonic() value, infinity without one), print `summary` of its payload and record both with
    the command that made them (course_lib.reference.record)."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.splitlines()[0])
    p.add_argument("--json", help="also write the payload with its provenance (data/reference/<name>_<gpu>.json)")
    p.add_argument("--device", default="auto")
    p.add_argument("--deadline", type=float, default=None, help="seconds after which optional parts are skipped")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.deadline if args.deadline else float("inf")
    payload = study(pick_device(args.device), deadline)
    words = " ".join(argv if argv is not None else sys.argv[1:])
    record(f"python -m {module} {words}", summary(payload), args.json, **payload)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_recorder("course_lib.chapters.ch09.record_questions", __doc__, questions, summary, argv)


if __name__ == "__main__":
    sys.exit(main())
