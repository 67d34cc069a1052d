"""GPU studies the chapters read from data/reference/: the open performance questions, the memory
sweep chapter 10's model is checked against, chapter 11's roofline and fp8 data (issue 32).

    python tools/gpu_study.py questions --json data/reference/perf_questions_<gpu>.json
    python tools/gpu_study.py memory    --json data/reference/memory_sweep_<gpu>.json
    python tools/gpu_study.py roofline  --json data/reference/roofline_<gpu>.json
    python tools/gpu_study.py fp8gpt    --json data/reference/fp8_gpt_<gpu>.json

Every subcommand also runs on a CPU at toy size (to test this script, not to record). Each file
carries the provenance of course_lib.reference.record. A recorder, not course material: the
chapters that read these files hold the teaching code.
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from course_lib.chapters.ch01.matmul import peak_tflops  # noqa: E402
from course_lib.chapters.ch02.saved_tensors import saved_tensor_bytes
from course_lib.models import GPT, MLP, GPTConfig, SimpleCNN, resnet50  # noqa: E402
from course_lib.reference import record  # noqa: E402
from course_lib.timing import time_fn  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CUDA = DEV.type == "cuda"
DEADLINE = [float("inf")]  # monotonic time after which optional parts are skipped


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def time_loop(fn: Callable[[], object], iters: int, reps: int = 5, warmup: int = 3) -> dict:
    """ms per call of fn, timed over `iters` back-to-back calls (no sync between them), `reps` times:
    what a kernel costs when the queue is full, not the round trip of one launch."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(reps):
        if CUDA:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t) * 1e3 / iters)
    return {"ms": statistics.median(out), "ms_min": min(out), "ms_max": max(out)}


def gpu_name() -> str:
    return torch.cuda.get_device_name() if CUDA else ""


# ----------------------------------------------------------------------------- traces


def profile_trace(step: Callable[[], object], steps: int = 3, warmup: int = 2, shapes: bool = False) -> dict:
    """Profile `steps` calls of step (after `warmup`) and return the Chrome trace as a dict."""
    from torch.profiler import ProfilerActivity, profile, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
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
                sync()
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


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((c for c, pat in KERNEL_CLASSES if re.search(pat, low)), "other")


def kernel_summary(trace: dict, steps: int, top: int = 25) -> dict:
    """GPU time per step by kernel class and the `top` kernels (µs per step, calls per step)."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
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
    step (kernels linked to their op by the launch's correlation id). On a CPU: self CPU time."""
    evs = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    ops = sorted((e for e in evs if e.get("cat") == "cpu_op"), key=lambda e: (e.get("tid"), e["ts"], -e["dur"]))
    # kineto links a kernel to the op on top of the stack at its launch by "External id"; the launch
    # (cudaLaunchKernel) shares the kernel's "correlation" and is the fallback
    by_ext = {o.get("args", {}).get("External id"): o for o in ops if o.get("args", {}).get("External id") is not None}
    kernels = [k for k in evs if k.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
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
        us = dev_us.get(id(o), 0.0) if CUDA else o["dur"]
        if CUDA and not us:
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


# ----------------------------------------------------------------------------- steps


def amp_train_step(model, opt, scaler, x, y, dtype, forward=None) -> Callable[[], None]:
    """One training step as course_lib.train.amp_step does it (one micro-batch)."""
    forward = forward or (lambda a, b: F.cross_entropy(model(a), b))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEV.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = forward(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def gpt_setup(batch: int, seq: int, config: GPTConfig | None = None, fused: bool = True, compiled: bool = False):
    torch.manual_seed(0)
    c = config or (GPTConfig() if CUDA else GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64))
    model = GPT(c).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, **({"fused": True} if fused else {"foreach": True}))
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randint(0, c.vocab_size, (batch, seq), device=DEV, generator=g)
    y = torch.randint(0, c.vocab_size, (batch, seq), device=DEV, generator=g)
    fwd_model = torch.compile(model) if compiled else model
    return model, opt, x, y, (lambda a, b: fwd_model(a, b)[1])


# ----------------------------------------------------------------------------- questions


def q_resnet50(batch: int) -> dict:
    """fp16 against bf16 on ResNet-50 (channels_last, AMP): step time and where the GPU time goes."""
    out = {}
    size = 224 if CUDA else 64
    for prec in ("fp16", "bf16"):
        torch.manual_seed(0)
        model = resnet50().to(DEV).to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        scaler = torch.amp.GradScaler(DEV.type, enabled=prec == "fp16")
        x = torch.randn(batch, 3, size, size, device=DEV).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device=DEV)
        step = amp_train_step(model, opt, scaler, x, y, DTYPES[prec])
        torch.backends.cudnn.benchmark = CUDA
        t = time_fn(step, warmup=5, iters=15 if CUDA else 2, device=DEV)
        trace = profile_trace(step, steps=3, shapes=True)
        torch.backends.cudnn.benchmark = False
        out[prec] = {
            "batch": batch,
            "image_size": size,
            "ms_per_step": t.median_ms,
            "ms_q1": t.quartiles_ms[0],
            "ms_q3": t.quartiles_ms[1],
            "images_per_s": batch / t.median_ms * 1e3,
            "kernels": kernel_summary(trace, 3),
            "ops": op_table(trace, 3, top=25),
        }
        del model, opt, x, step, trace
        gc.collect()
        torch.cuda.empty_cache() if CUDA else None
    return out


def q_simplecnn(batch: int) -> dict:
    """The course's small CNN: why AMP is slower on a big GPU. Data on the device, so only the step."""
    out = {}
    for label, prec, cl in (("fp32", "fp32", False), ("bf16", "bf16", False), ("bf16 + channels_last", "bf16", True)):
        torch.manual_seed(0)
        model = SimpleCNN().to(DEV)
        x = torch.randn(batch, 1, 28, 28, device=DEV)
        if cl:
            model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (batch,), device=DEV)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler(DEV.type, enabled=False)
        step = amp_train_step(model, opt, scaler, x, y, DTYPES[prec])
        torch.backends.cudnn.benchmark = CUDA
        t = time_fn(step, warmup=5, iters=30 if CUDA else 3, device=DEV)
        loop = time_loop(step, iters=20 if CUDA else 2, reps=3)
        trace = profile_trace(step, steps=3, shapes=True)
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


def q_gpt(batches: tuple[int, ...]) -> dict:
    """GPT-2 small with the full recipe (bf16 autocast, SDPA, torch.compile, fused AdamW): MFU, and
    where the GPU time of a step goes (GEMMs, attention, fused Triton kernels, optimizer, idle)."""
    out: dict = {"rows": []}
    seq = 1024 if CUDA else 64
    name = gpu_name()
    peak = peak_tflops(name, "bf16") if name else None
    out["mfu_peak_tflops"] = peak
    for batch in batches:
        if time.monotonic() > DEADLINE[0] and out["rows"]:
            out["rows"].append({"batch": batch, "note": "skipped: the call's deadline"})
            continue
        torch._dynamo.reset()
        model, opt, x, y, fwd = gpt_setup(batch, seq, compiled=CUDA)
        scaler = torch.amp.GradScaler(DEV.type, enabled=False)
        step = amp_train_step(model, opt, scaler, x, y, torch.bfloat16, forward=fwd)
        t0 = time.monotonic()
        step()
        sync()
        compile_s = time.monotonic() - t0
        t = time_fn(step, warmup=3, iters=10 if CUDA else 2, device=DEV)
        flops_tok = model.flops_per_token(seq)
        c = model.config
        attn_tok = 12 * c.n_layer * c.n_embd * seq
        tokens = batch * seq
        trace = profile_trace(step, steps=3)
        ks = kernel_summary(trace, 3, top=20)
        cls = ks["by_class_us"]
        gemm_us = cls.get("conv/gemm", 0.0)
        attn_us = cls.get("attention", 0.0)
        row = {
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
        out["rows"].append(row)
        del model, opt, step, trace
        gc.collect()
        torch.cuda.empty_cache() if CUDA else None
    return out


def run_questions(args) -> tuple[str, dict]:
    payload = {
        "simplecnn": q_simplecnn(256 if CUDA else 32),
        "resnet50": q_resnet50(128 if CUDA else 2),
        "gpt": q_gpt((16, 32) if CUDA else (2,)),
    }
    lines = []
    for k, v in payload["simplecnn"].items():
        kk = v["kernels"]
        lines.append(
            f"SimpleCNN {k:<22} {v['ms_per_step']:7.3f} ms/step (back to back {v['ms_per_step_back_to_back']:.3f}), "
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
    return "\n".join(lines), payload


# ----------------------------------------------------------------------------- memory


def allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


def peak_reset() -> None:
    if CUDA:
        torch.cuda.reset_peak_memory_stats()


def peak() -> int:
    return torch.cuda.max_memory_allocated() if CUDA else 0


def measure_memory(build: Callable, batch_fn: Callable, precision: str, optimizer: str | None, note: str = "") -> dict:
    """The bytes of one steady-state training step, phase by phase (CUDA allocator counts).

    Protocol: model built and moved, optimizer made, batch made; two full steps (the optimizer's state
    exists after the first); then the third step phase by phase: zero_grad(set_to_none=True); forward
    and loss under autocast (allocated after it, peak during it); scaler.scale(loss).backward();
    scaler.step(opt) + update(). Each phase's peak is absolute (reset_peak_memory_stats at its start).
    precision "bf16-pure": the model's parameters in bf16, autocast off, AdamW on the bf16 parameters.
    precision "bf16-master": parameters in bf16, fp32 master copies in AdamW; the step copies the bf16
    gradients into the masters' .grad (fp32), steps, and copies the masters back.
    """
    gc.collect()
    torch.cuda.empty_cache() if CUDA else None
    base = allocated()
    torch.manual_seed(0)
    model, fwd = build()
    pure = precision.startswith("bf16-")
    if pure:
        model = model.to(torch.bfloat16)
    after_model = allocated() - base
    params = list(model.parameters())
    master = [p.detach().float().requires_grad_() for p in params] if precision == "bf16-master" else None
    opt = None
    if optimizer:
        kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "sgd": {}}[optimizer]
        opt = (
            torch.optim.SGD(master or params, lr=1e-3, momentum=0.9)
            if optimizer == "sgd"
            else torch.optim.AdamW(master or params, lr=1e-4, **kind)
        )
    after_opt = allocated() - base
    x, y = batch_fn()
    after_data = allocated() - base
    dtype = None if pure or precision == "fp32" else DTYPES[precision]
    scaler = torch.amp.GradScaler(DEV.type, enabled=precision == "fp16")
    phases: dict = {}

    def one_step(measure: bool) -> None:
        def mark(name: str) -> None:
            if measure:
                sync()
                phases[name] = {"allocated": allocated() - base, "peak": peak() - base}
                peak_reset()

        if measure:
            sync()
            phases["start"] = {"allocated": allocated() - base}
            peak_reset()
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        with torch.autocast(DEV.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = fwd(model, x, y)
        mark("forward")
        scaler.scale(loss).backward()
        del loss
        mark("backward")
        if opt is not None:
            if master is not None:
                for m, p in zip(master, params):
                    m.grad = p.grad.float()
                    p.grad = None
            scaler.step(opt)
            scaler.update()
            if master is not None:
                with torch.no_grad():
                    for m, p in zip(master, params):
                        p.copy_(m)
                        m.grad = None
        mark("optimizer")

    for _ in range(2):
        one_step(False)
    one_step(True)
    with torch.autocast(DEV.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        saved = saved_tensor_bytes(lambda: fwd(model, x, y))
    row = {
        "precision": precision,
        "optimizer": optimizer,
        "note": note,
        "model_bytes": after_model,
        "optimizer_made_bytes": after_opt - after_model,
        "batch_bytes": after_data - after_opt,
        "phases": phases,
        "peak_bytes": max(v.get("peak", 0) for v in phases.values()),
        "saved_by_dtype": {str(k).replace("torch.", ""): v for k, v in saved.items()},
        "param_count": sum(p.numel() for p in params),
    }
    return row


def gpt_build(config: GPTConfig, ckpt: bool):
    from torch.utils.checkpoint import checkpoint

    def build():
        model = GPT(config).to(DEV)
        if ckpt:

            class Ckpt(torch.nn.Module):
                def __init__(self, b):
                    super().__init__()
                    self.block = b

                def forward(self, h):
                    return checkpoint(self.block, h, use_reentrant=False)

            model.blocks = torch.nn.ModuleList(Ckpt(b) for b in model.blocks)
        return model, lambda m, a, b: m(a, b)[1]

    return build


def run_memory(args) -> tuple[str, dict]:
    rows = []
    # the CUDA libraries' workspaces, allocated through the caching allocator at a first matmul
    ws = {}
    if CUDA:
        for dt in (torch.float32, torch.bfloat16):
            a0 = allocated()
            a = torch.randn(256, 256, device=DEV, dtype=dt)
            (a @ a).sum().item()
            del a
            sync()
            ws[str(dt)] = allocated() - a0
    gcfg = GPTConfig() if CUDA else GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64)
    seq = 1024 if CUDA else 64
    configs = []
    for precision in ("fp32", "bf16", "fp16"):
        for batch in (1, 2, 4, 8) if CUDA else (1, 2):
            configs.append(("gpt2", batch, precision, "fused", False, True))
    for precision, batch in (("bf16", 4), ("bf16", 8), ("fp32", 4)):
        configs.append(("gpt2", batch, precision, "fused", True, True))
    configs += [("gpt2", 4, "fp32", "fused", False, False), ("gpt2", 4, "bf16", "fused", False, False)]
    configs += [("gpt2", 4, "bf16", "foreach", False, True)]
    configs += [("gpt2", 4, "bf16-pure", "fused", False, True), ("gpt2", 4, "bf16-master", "fused", False, True)]
    for model_name, batch, precision, opt, ckpt, sdpa in configs:
        c = GPTConfig(**{**gcfg.__dict__, "sdpa": sdpa})

        def batch_fn(b=batch, c=c):
            g = torch.Generator(device=DEV).manual_seed(0)
            return (torch.randint(0, c.vocab_size, (b, seq), device=DEV, generator=g),) * 2

        try:
            r = measure_memory(gpt_build(c, ckpt), batch_fn, precision, opt)
        except torch.cuda.OutOfMemoryError as e:
            r = {"precision": precision, "optimizer": opt, "error": str(e)[:200]}
        r.update({"model": model_name, "batch": batch, "seq": seq, "checkpointing": ckpt, "sdpa": sdpa})
        r["config"] = c.__dict__
        rows.append(r)
    # chapter 02's MLP (3 x 4096, batch 512): forward + backward, no optimizer (as chapter 02 measures)
    width, mb = (4096, 512) if CUDA else (256, 64)
    for precision in ("fp32", "bf16", "fp16"):
        r = measure_memory(
            lambda: (MLP(in_features=width, hidden=width, depth=3).to(DEV), lambda m, a, b: F.cross_entropy(m(a), b)),
            lambda: (torch.randn(mb, width, device=DEV), torch.randint(0, 10, (mb,), device=DEV)),
            precision,
            None,
        )
        r.update({"model": "mlp", "batch": mb, "width": width, "depth": 3})
        rows.append(r)
    # the course's SimpleCNN and ResNet-50 (cuDNN heuristics, no autotuning), SGD with momentum
    for model_name, batches, shape in (("simplecnn", (256,), (1, 28, 28)), ("resnet50", (32, 64), (3, 224, 224))):
        if model_name == "resnet50" and not CUDA:
            batches, shape = (2,), (3, 64, 64)
        for batch in batches:
            for precision in ("fp32", "bf16", "fp16"):

                def build(n=model_name):
                    m = SimpleCNN() if n == "simplecnn" else resnet50()
                    return m.to(DEV), lambda mm, a, b: F.cross_entropy(mm(a), b)

                def batch_fn(b=batch, s=shape, n=model_name):
                    return torch.randn(b, *s, device=DEV), torch.randint(
                        0, 10 if n == "simplecnn" else 1000, (b,), device=DEV
                    )

                r = measure_memory(build, batch_fn, precision, "sgd")
                r.update({"model": model_name, "batch": batch, "shape": list(shape)})
                rows.append(r)
    lines = [
        f"{'model':<10}{'b':>3} {'precision':<12}{'opt':<8}{'ckpt':<5}{'sdpa':<5}{'peak MiB':>10}  fwd/bwd/opt peaks"
    ]
    for r in rows:
        if "phases" not in r:
            lines.append(f"{r['model']:<10}{r['batch']:>3} {r['precision']:<12} {r.get('error', '')[:60]}")
            continue
        p = r["phases"]
        lines.append(
            f"{r['model']:<10}{r['batch']:>3} {r['precision']:<12}{str(r['optimizer']):<8}"
            f"{str(r.get('checkpointing', '')):<6}"
            f"{str(r.get('sdpa', '')):<6}{r['peak_bytes'] / 2**20:>10.1f}  "
            + "/".join(f"{p[k]['peak'] / 2**20:.0f}" for k in ("forward", "backward", "optimizer"))
        )
    return "\n".join(lines), {"workspace_bytes": ws, "rows": rows}


# ----------------------------------------------------------------------------- roofline


def matmul_row(n_m: int, n_k: int, n_n: int, dtype: torch.dtype, tf32: bool = False, iters: int = 20) -> dict:
    a = torch.randn(n_m, n_k, device=DEV).to(dtype)
    b = torch.randn(n_k, n_n, device=DEV).to(dtype)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        t = time_loop(lambda: a @ b, iters=iters)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    flops = 2 * n_m * n_k * n_n
    return {"m": n_m, "k": n_k, "n": n_n, **t, "tflops": flops / (t["ms"] * 1e-3) / 1e12}


def to_fp8(x: torch.Tensor, dtype: torch.dtype, rowwise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic scaling: amax of the tensor (or of each row) to the format's largest value."""
    fmax = torch.finfo(dtype).max
    amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
    scale = fmax / amax.float().clamp(min=1e-12)
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()


def fp8_row(m: int, k: int, n: int, iters: int = 20) -> dict:
    """bf16 matmul against fp8 e4m3 _scaled_mm (tensorwise, rowwise), with and without the casts."""
    a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)  # b.t() is the column-major right operand
    flops = 2 * m * k * n
    row = {"m": m, "k": k, "n": n}
    t = time_loop(lambda: a @ b.t(), iters=iters)
    row["bf16_ms"] = t["ms"]
    e4 = torch.float8_e4m3fn
    for mode, rowwise in (("tensorwise", False), ("rowwise", True)):
        try:
            a8, sa = to_fp8(a, e4, rowwise)
            b8, sb = to_fp8(b, e4, rowwise)
            sb = sb.t() if rowwise else sb  # rowwise: scale_a (m, 1), scale_b (1, n)

            def mm(a8=a8, b8=b8, sa=sa, sb=sb):
                return torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

            ref = a.float() @ b.float().t()
            err = ((mm().float() - ref).norm() / ref.norm()).item()
            t = time_loop(mm, iters=iters)

            def with_cast(rowwise=rowwise):
                a8, sa = to_fp8(a, e4, rowwise)
                b8, sb = to_fp8(b, e4, rowwise)
                return torch._scaled_mm(
                    a8, b8.t(), scale_a=sa, scale_b=sb.t() if rowwise else sb, out_dtype=torch.bfloat16
                )

            tc = time_loop(with_cast, iters=max(iters // 2, 2))
            row[f"{mode}_ms"] = t["ms"]
            row[f"{mode}_with_cast_ms"] = tc["ms"]
            row[f"{mode}_rel_error"] = err
        except (RuntimeError, TypeError, NotImplementedError) as e:
            row[f"{mode}_error"] = str(e).splitlines()[0][:200]
    row["bf16_tflops"] = flops / (row["bf16_ms"] * 1e-3) / 1e12
    return row


def run_roofline(args) -> tuple[str, dict]:
    out: dict = {}
    big = CUDA
    sizes = (512, 1024, 2048, 4096, 8192) if big else (128, 256, 512)
    ceil = []
    for label, dtype, tf32 in (
        ("fp32", torch.float32, False),
        ("tf32", torch.float32, True),
        ("bf16", torch.bfloat16, False),
        ("fp16", torch.float16, False),
    ):
        if not CUDA and label in ("tf32", "fp16"):
            continue
        for n in sizes:
            ceil.append({"dtype": label, **matmul_row(n, n, n, dtype, tf32, iters=20 if big else 3)})
    out["matmul"] = ceil
    # memory bandwidth: copy (read + write), a read-only reduction, an elementwise op
    nbytes = 2**30 if big else 2**26
    x = torch.empty(nbytes // 4, device=DEV).normal_()
    y = torch.empty_like(x)
    bw = {}
    t = time_loop(lambda: y.copy_(x), iters=20 if big else 3)
    bw["copy_gbps"] = 2 * nbytes / (t["ms"] * 1e-3) / 1e9
    t = time_loop(lambda: x.sum(), iters=20 if big else 3)
    bw["sum_gbps"] = nbytes / (t["ms"] * 1e-3) / 1e9
    t = time_loop(lambda: torch.mul(x, 2.0, out=y), iters=20 if big else 3)
    bw["scale_gbps"] = 2 * nbytes / (t["ms"] * 1e-3) / 1e9
    out["bandwidth"] = bw
    del x, y
    # launch overhead: a one-element op, back to back (the GPU's rate) and each one waited for
    z = torch.zeros(1, device=DEV)
    out["launch"] = {
        "back_to_back_us": time_loop(lambda: z.add_(1), iters=2000)["ms"] * 1e3,
        "synchronized_us": time_fn(lambda: z.add_(1), warmup=10, iters=200, device=DEV).median_ms * 1e3,
    }
    # Tensor-Core shapes: the GPT's lm_head with the real and the padded vocabulary, and K around 4096
    shapes = []
    tokens = 16384 if big else 512
    for dtype, label in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")) if CUDA else ((torch.float32, "fp32"),):
        for n in (50257, 50304):
            shapes.append({"what": "lm_head", "dtype": label, **matmul_row(tokens, 768, n if big else n // 64, dtype)})
        for k in (4088, 4095, 4096, 4097, 4104) if big else (255, 256):
            shapes.append(
                {"what": "K sweep", "dtype": label, **matmul_row(4096 if big else 256, k, 4096 if big else 256, dtype)}
            )
    out["shapes"] = shapes
    # fp8 against bf16: square sizes, then the GPT-2-small linear layers at 16,384 tokens
    fp8 = []
    if hasattr(torch, "float8_e4m3fn"):
        for s in (512, 1024, 2048, 4096, 8192, 16384) if big else (64, 128):
            fp8.append({"what": "square", **fp8_row(s, s, s, iters=20 if big else 2)})
        t = 16384 if big else 128
        e = 768 if big else 64
        v = 50304 if big else 512
        for what, k, n in (("qkv", e, 3 * e), ("proj", e, e), ("fc", e, 4 * e), ("fc2", 4 * e, e), ("lm_head", e, v)):
            fp8.append({"what": what, **fp8_row(t, k, n, iters=20 if big else 2)})
    out["fp8"] = fp8
    # per-op device times of real training steps, with shapes and dtypes (the roofline's test set)
    steps = {}
    model, opt, x, y, fwd = gpt_setup(8 if big else 2, 1024 if big else 64)
    steps["gpt2 bf16 batch 8"] = amp_train_step(
        model, opt, torch.amp.GradScaler(DEV.type, enabled=False), x, y, torch.bfloat16, forward=fwd
    )
    torch.manual_seed(0)
    cnn = SimpleCNN().to(DEV)
    cx, cy = torch.randn(256, 1, 28, 28, device=DEV), torch.randint(0, 10, (256,), device=DEV)
    copt = torch.optim.SGD(cnn.parameters(), lr=0.01, momentum=0.9)
    for label, dt in (("simplecnn fp32 batch 256", None), ("simplecnn bf16 batch 256", torch.bfloat16)):
        steps[label] = amp_train_step(cnn, copt, torch.amp.GradScaler(DEV.type, enabled=False), cx, cy, dt)
    ops = {}
    for label, step in steps.items():
        ops[label] = op_table(profile_trace(step, steps=3, shapes=True), 3, top=80)
    out["ops"] = ops
    if CUDA:  # the small CNN's step, eager and replayed as one CUDA graph (chapter 11, section 6)
        from course_lib.chapters.ch11.step_profile import cuda_graph_rows

        out["cuda_graphs"] = cuda_graph_rows()
    out["tf32_note"] = (
        "matmul rows: torch.backends.cuda.matmul.allow_tf32 as labelled; cuDNN keeps its default (TF32 on)"
    )
    lines = [f"{'dtype':<6}{'n':>7}{'TFLOP/s':>10}"] + [f"{r['dtype']:<6}{r['n']:>7}{r['tflops']:>10.1f}" for r in ceil]
    lines.append("bandwidth GB/s: " + ", ".join(f"{k} {v:.0f}" for k, v in bw.items()))
    lines.append("launch us: " + ", ".join(f"{k} {v:.2f}" for k, v in out["launch"].items()))
    for r in shapes:
        lines.append(
            f"{r['what']:<8}{r['dtype']:<6} m{r['m']} k{r['k']} n{r['n']}: {r['ms']:.3f} ms {r['tflops']:.0f} TFLOP/s"
        )
    for r in fp8:
        lines.append(
            f"fp8 {r['what']:<8} {r['m']}x{r['k']}x{r['n']}: bf16 {r['bf16_ms']:.3f} ms, tensorwise "
            f"{r.get('tensorwise_ms', float('nan')):.3f} "
            f"({r.get('tensorwise_with_cast_ms', float('nan')):.3f} with casts), "
            f"rowwise {r.get('rowwise_ms', float('nan')):.3f}"
        )
    for r in out.get("cuda_graphs", []):
        lines.append(f"cuda graph {r['mode']}: eager {r['eager_ms']:.3f} ms, graph {r['graph_ms']:.3f} ms")
    return "\n".join(lines), out


# ----------------------------------------------------------------------------- fp8 GPT


def markov_batches(vocab: int, batch: int, seq: int, n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable synthetic language: each of 1,024 tokens has 4 possible successors. The loss can fall
    from ln(vocab) towards ln(4) = 1.39, so two recipes' loss curves can be compared."""
    g = torch.Generator().manual_seed(seed)
    used = min(vocab, 1024)
    nxt = torch.randint(0, used, (used, 4), generator=g)
    out = []
    for _ in range(n):
        tok = torch.empty(batch, seq + 1, dtype=torch.long)
        tok[:, 0] = torch.randint(0, used, (batch,), generator=g)
        choice = torch.randint(0, 4, (batch, seq), generator=g)
        for t in range(seq):
            tok[:, t + 1] = nxt[tok[:, t], choice[:, t]]
        out.append((tok[:, :-1].to(DEV), tok[:, 1:].to(DEV)))
    return out


def run_fp8gpt(args) -> tuple[str, dict]:
    """GPT-2 small trained with bf16 autocast against torchao float8 (tensorwise, rowwise), compiled."""
    import torchao
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    batch, seq = (16, 1024) if CUDA else (2, 64)
    data = markov_batches(50304 if CUDA else 512, batch, seq, 4)
    rows = []
    for recipe in ("bf16", "tensorwise", "rowwise"):
        if time.monotonic() > DEADLINE[0] and rows:
            rows.append({"recipe": recipe, "note": "skipped: the call's deadline"})
            continue
        torch._dynamo.reset()
        model, opt, _, _, _ = gpt_setup(batch, seq)
        if recipe != "bf16":
            # the output layer (tied to the embedding) stays in bf16, as torchao's examples leave lm_head
            convert_to_float8_training(
                model,
                config=Float8LinearConfig.from_recipe_name(recipe),
                module_filter_fn=lambda m, fqn: fqn != "lm_head" and isinstance(m, torch.nn.Linear),
            )
        cm = torch.compile(model) if CUDA else model  # a CPU run only tests this script
        losses = []
        it = [0]

        def step():
            x, y = data[it[0] % len(data)]
            it[0] += 1
            opt.zero_grad(set_to_none=True)
            with torch.autocast(DEV.type, dtype=torch.bfloat16):
                loss = cm(x, y)[1]
            loss.backward()
            opt.step()
            losses.append(loss.detach())

        t0 = time.monotonic()
        step()
        sync()
        compile_s = time.monotonic() - t0
        t = time_fn(step, warmup=2, iters=10 if CUDA else 2, device=DEV)
        for _ in range(30 if CUDA else 3):
            step()
        curve = [float(v) for v in torch.stack(losses).cpu()]
        rows.append(
            {
                "recipe": recipe,
                "batch": batch,
                "seq": seq,
                "compile_s": compile_s,
                "ms_per_step": t.median_ms,
                "ms_q1": t.quartiles_ms[0],
                "ms_q3": t.quartiles_ms[1],
                "tokens_per_s": batch * seq / t.median_ms * 1e3,
                "losses": curve,
            }
        )
    base = rows[0]["ms_per_step"]
    lines = [
        f"{r['recipe']:<11} {r['ms_per_step']:.1f} ms/step, x{base / r['ms_per_step']:.3f}, "
        f"last loss {r['losses'][-1]:.3f}"
        for r in rows
        if "ms_per_step" in r
    ]
    return "\n".join(lines), {
        "torchao": torchao.__version__,
        "rows": rows,
        "data": "markov_batches: 1,024 tokens, 4 successors",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["questions", "memory", "roofline", "fp8gpt"])
    p.add_argument("--json")
    p.add_argument("--deadline", type=float, default=None, help="seconds after which optional parts are skipped")
    args = p.parse_args(argv)
    if args.deadline:
        DEADLINE[0] = time.monotonic() + args.deadline
    text, payload = {"questions": run_questions, "memory": run_memory, "roofline": run_roofline, "fp8gpt": run_fp8gpt}[
        args.what
    ](args)
    record(
        "python tools/gpu_study.py " + " ".join(argv if argv is not None else sys.argv[1:]), text, args.json, **payload
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
