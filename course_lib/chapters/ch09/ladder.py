"""The optimisation ladder of chapter 09: one change per rung, each measured, in one run.

    python -m course_lib.chapters.ch09.ladder course [--json data/reference/ladder_course_<gpu>.json]
    python -m course_lib.chapters.ch09.ladder resnet50 [--json data/reference/ladder_resnet50_<gpu>.json]
    python -m course_lib.chapters.ch09.ladder gpt [--json data/reference/ladder_gpt_<gpu>.json]
    python -m course_lib.chapters.ch09.ladder optimizer | checkpointing [--json ...]

`course` is the course's own model (SimpleCNN on the shipped Fashion-MNIST, trained by the
course's Trainer). On a GPU the other workloads are full size: ResNet-50 on synthetic 224x224
images, GPT-2 small (124M parameters) on 1,024-token sequences. On a CPU the same code runs at toy size to show that it
works; nothing sized for a GPU runs there. Ratios between rungs are the result: they come from
one process, one machine, minutes apart, and each timing carries its spread.

What a rung is (`Rung`, `climb`), the course's own ladder and the rows' table and reading
(`format_rows`, `read_rungs`) are in course_lib.chapters.ch09.rungs; here are the full-size workloads
and the command line that records every ladder.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from course_lib.chapters.ch00.bench import step_row
from course_lib.chapters.ch01.matmul import peak_tflops
from course_lib.chapters.ch02.matmul_speed import matmul_tflops
from course_lib.chapters.ch02.saved_tensors import saved_tensor_bytes
from course_lib.chapters.ch09.rungs import Rung, climb, compiles_quickly, course_ladder, format_rows, with_speedup
from course_lib.chapters.ch09.targets import format_targets, targets
from course_lib.device import has_native_bf16, has_tf32, mixed_precision_for, pick_device, tf32
from course_lib.models import GPT, GPTConfig
from course_lib.reference import record
from course_lib.timing import peak_memory_bytes, time_fn
from course_lib.train import AMP_DTYPES, StepResult, amp_step

__all__ = [
    "GPT_RUNGS",
    "resnet50_ladder",
    "largest_batch",
    "gpt_ladder",
    "matmul_ceiling",
    "optimizer_table",
    "checkpointing_table",
]


# --------------------------------------------------------------------------- ResNet-50


def resnet50_ladder(
    device: str = "auto",
    batch: int | None = None,
    steps: int | None = None,
    image_size: int | None = None,
    modes: Sequence[str] | None = None,
) -> list[dict]:
    """Chapter 09: ResNet-50 training steps in strict FP32, TF32, bf16 and fp16 AMP, each without and
    with channels_last: ms/step with spread, images/s, peak memory (CUDA), speed-up over strict FP32.

    Defaults: batch 128 at 224 px on a GPU (64 below 24 GiB); batch 4 at 64 px on a CPU (a toy run,
    without fp16: most CPUs have no fast fp16 convolution backward). Rows the hardware cannot run
    natively are kept, with the reason. `modes` keeps only the rows so labelled (e.g. "TF32",
    "AMP fp16 + channels_last"): chapter 09's live cell times four, the recording all eight.
    """
    dev = pick_device(device)
    cuda = dev.type == "cuda"
    if cuda:
        big = torch.cuda.get_device_properties(dev).total_memory >= 24 * 2**30
        batch = batch or (128 if big else 64)
        steps = steps or 20
        size = image_size or 224
    else:  # a toy run
        batch = batch or 4
        steps = steps or 3
        size = image_size or 64
    shape = (3, size, size)
    rows = []
    for label, precision, allow_tf32 in (
        ("FP32 (strict)", "fp32", False),
        ("TF32", "fp32", True),
        ("AMP bf16", "bf16", False),
        ("AMP fp16", "fp16", False),
    ):
        for channels_last in (False, True):
            mode = label + (" + channels_last" if channels_last else "")
            if modes is not None and mode not in modes:
                continue
            why = _why_skipped(dev, precision, allow_tf32)
            if why:
                rows.append({"mode": mode, "note": why})
                continue
            timed = step_row(
                "resnet50",
                precision,
                dev,
                batch=batch,
                steps=steps,
                allow_tf32=allow_tf32,
                channels_last=channels_last,
                shape=shape,
            )
            rows.append({"mode": mode, "image_size": size, **timed})
    return with_speedup(rows)


def _why_skipped(dev: torch.device, precision: str, allow_tf32: bool) -> str:
    """Why a ResNet-50 rung is not timed on `dev` ("" when it is)."""
    if allow_tf32 and not has_tf32(dev):
        return "TF32 needs an NVIDIA Ampere-or-newer GPU (sm_80+)"
    if precision == "bf16" and not has_native_bf16(dev):
        return "no native bf16 here: it would be emulated"
    if precision == "fp16" and dev.type != "cuda":
        return "fp16 convolution backward is slow on most CPUs"
    return ""


def largest_batch(
    precision: str = "bf16", channels_last: bool = True, device: str = "auto", start: int = 64, limit: int = 4096
) -> dict:
    """Chapter 09: the largest ResNet-50 batch (224 px) that trains in GPU memory: doubling from
    `start` until CUDA runs out of memory, which is caught and released. CPU: not measured.
    cuDNN autotuning is off: it would try every algorithm at each new size, over a minute per size
    in strict FP32 on an H200, to time steps that are not timed here."""
    dev = pick_device(device)
    if dev.type != "cuda":
        return {"precision": precision, "largest_batch": None, "note": "measured on a GPU only"}
    fits, batch = None, start
    while batch <= limit:
        try:
            # does it train? One step and the peak-memory step: no warm-up, nothing to time
            step_row(
                "resnet50", precision, dev, batch=batch, steps=1, warmup=0, channels_last=channels_last, autotune=False
            )
            fits, batch = batch, batch * 2
        except torch.cuda.OutOfMemoryError:
            break
        finally:
            gc.collect()
            torch.cuda.empty_cache()
    return {
        "precision": precision,
        "channels_last": channels_last,
        "largest_batch": fits,
        "note": "" if batch <= limit else f"fits up to the probe's limit ({limit})",
    }


# --------------------------------------------------------------------------- GPT


def _gpt_size(dev: torch.device, batch: int | None, seq: int | None) -> tuple[GPTConfig, int, int]:
    if dev.type == "cuda":
        big = torch.cuda.get_device_properties(dev).total_memory >= 40 * 2**30
        return GPTConfig(), batch or (16 if big else 4), seq or 1024
    return GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64), batch or 4, seq or 64


def _gpu_name(dev: torch.device) -> str:
    """The CUDA device's name, which finds its datasheet peak; "" elsewhere (no peak: MFU is None)."""
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else ""


def _gpt_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    amp: str | None,
    scaler: torch.amp.GradScaler,
) -> Callable[[], StepResult]:
    """One GPT training step, the core's amp_step; the model computes its own loss (nanoGPT's way)."""
    dtype = AMP_DTYPES[amp or "fp32"]
    return lambda: amp_step(model, opt, scaler, [(x, y)], dtype, forward=lambda a, b: model(a, b)[1])


GPT_RUNGS = climb(
    Rung("FP32 (strict)"),
    ("TF32", {"tf32": True}),
    ("AMP", {"amp": True}),
    ("+ SDPA attention", {"sdpa": True}),
    ("+ torch.compile", {"compiled": True}),
    ("+ fused AdamW", {"fused": True}),
)


def gpt_ladder(
    device: str = "auto",
    batch: int | None = None,
    seq: int | None = None,
    steps: int | None = None,
    compile_on_cpu: bool = False,
) -> list[dict]:
    """Chapter 09: the GPT ladder, strict FP32 -> TF32 -> AMP -> SDPA -> torch.compile -> fused AdamW.

    Each rung: ms/step with spread, tokens/s, and MFU (model FLOPs utilisation: the model's training
    FLOPs per second over ONE named peak for every rung, the datasheet's dense peak of the device's
    mixed precision, bf16 on an H100, fp16 on a T4: `mfu_peak` names it). Dividing each rung by its
    own precision's peak would let a slow strict-FP32 rung look well used. AMP is bf16 where it is native
    and fp16 with a GradScaler elsewhere. On a CPU the model is a toy. Where compiling is slow
    (`compiles_quickly`: a CPU, or a GPU with few CPU cores, as on Colab) the compiled rungs are skipped.
    """
    dev = pick_device(device)
    config, batch, seq = _gpt_size(dev, batch, seq)
    amp = mixed_precision_for(dev)
    name = _gpu_name(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randint(0, config.vocab_size, (batch, seq), device=dev, generator=g)
    y = torch.randint(0, config.vocab_size, (batch, seq), device=dev, generator=g)
    peak = peak_tflops(name, amp) if name else None  # the one peak every rung is measured against
    rows = []
    for rung in GPT_RUNGS:
        label = rung.label.replace("AMP", f"AMP {amp}")
        if rung.compiled and not compiles_quickly(dev, compile_on_cpu):
            where = "a CPU" if dev.type != "cuda" else f"{os.cpu_count()} CPU cores"
            rows.append({"mode": label, "note": f"skipped: compiling takes minutes on {where} (see the GPU run)"})
            continue
        if rung.tf32 and not rung.amp and not has_tf32(dev):
            rows.append({"mode": label, "note": "TF32 needs an NVIDIA Ampere-or-newer GPU (sm_80+)"})
            continue
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**config.__dict__, "sdpa": rung.sdpa})).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4, **({"fused": True} if rung.fused else {"foreach": True}))
        scaler = torch.amp.GradScaler(dev.type, enabled=rung.amp and amp == "fp16")
        step = _gpt_step(torch.compile(model) if rung.compiled else model, opt, x, y, amp if rung.amp else None, scaler)
        with tf32(rung.tf32):
            timing = time_fn(step, warmup=3, iters=steps or (10 if dev.type == "cuda" else 3), device=dev)
        tokens_s = batch * seq / timing.median_ms * 1e3
        achieved = model.flops_per_token(seq) * tokens_s / 1e12
        q1, q3 = timing.quartiles_ms
        rows.append(
            {
                "mode": label,
                "batch": batch,
                "seq": seq,
                "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
                "ms_per_step": timing.median_ms,
                "ms_q1": q1,
                "ms_q3": q3,
                "times_ms": timing.times_ms,
                "tokens_per_s": tokens_s,
                "model_tflops": achieved,
                "mfu": achieved / peak if peak else None,
                "mfu_peak": f"{name} dense {amp}, {peak} TFLOP/s" if peak else None,
            }
        )
        del model, opt, step
    return with_speedup(rows)


def matmul_ceiling(device: str = "auto") -> float | None:
    """Chapter 09: the TFLOP/s of a large matmul in the device's mixed precision (bf16 on an H100,
    fp16 on a T4, where bf16 would be emulated), measured here: what the GPU really reaches, beside
    the datasheet peak that MFU divides by."""
    dev = pick_device(device)
    if dev.type != "cuda":
        return None
    dtype = AMP_DTYPES[mixed_precision_for(dev)]
    return matmul_tflops(8192, dtype, dev)[0]


# --------------------------------------------------------------------------- optimizer and memory


def optimizer_table(device: str = "auto", steps: int | None = None) -> list[dict]:
    """Chapter 09: the cost of one AdamW step over the GPT's parameters: a Python for-loop over the
    tensors, `foreach` (a few multi-tensor kernels) and `fused` (one kernel per group)."""
    dev = pick_device(device)
    config, _, _ = _gpt_size(dev, None, None)
    if dev.type != "cuda":  # wide enough for the per-tensor overhead to show, still a toy
        config = GPTConfig(**{**config.__dict__, "n_layer": 4, "n_embd": 256, "n_head": 4})
    torch.manual_seed(0)
    params = [p for p in GPT(config).to(dev).parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    rows = []
    for label, kwargs in (("for-loop", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        opt = torch.optim.AdamW(params, lr=1e-4, **kwargs)
        timing = time_fn(opt.step, warmup=3, iters=steps or (20 if dev.type == "cuda" else 10), device=dev)
        q1, q3 = timing.quartiles_ms
        rows.append(
            {
                "mode": f"AdamW {label}",
                "params_m": sum(p.numel() for p in params) / 1e6,
                "tensors": len(params),
                "ms_per_step": timing.median_ms,
                "ms_q1": q1,
                "ms_q3": q3,
                "times_ms": timing.times_ms,
            }
        )
    return with_speedup(rows)


class _Checkpointed(torch.nn.Module):
    """A block whose activations are recomputed in backward instead of being kept."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def checkpointing_table(device: str = "auto", steps: int | None = None) -> list[dict]:
    """Chapter 09: activation checkpointing's trade: time per training step against memory (peak
    memory on CUDA; bytes saved for backward on any device), without and with a checkpoint per block."""
    dev = pick_device(device)
    config, batch, seq = _gpt_size(dev, None, None)
    amp = mixed_precision_for(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randint(0, config.vocab_size, (batch, seq), device=dev, generator=g)
    rows = []
    for label, wrap in (("no checkpointing", False), ("checkpoint every block", True)):
        torch.manual_seed(0)
        model = GPT(config).to(dev)
        if wrap:
            model.blocks = torch.nn.ModuleList(_Checkpointed(b) for b in model.blocks)
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4)
        scaler = torch.amp.GradScaler(dev.type, enabled=amp == "fp16")
        step = _gpt_step(model, opt, x, x, amp, scaler)
        timing = time_fn(step, warmup=2, iters=steps or (10 if dev.type == "cuda" else 3), device=dev)
        dtype = AMP_DTYPES[amp]
        with torch.autocast(dev.type, dtype=dtype):
            saved = sum(saved_tensor_bytes(lambda m=model: m(x, x)[1]).values())
        peak = peak_memory_bytes(step, dev)
        q1, q3 = timing.quartiles_ms
        rows.append(
            {
                "mode": label,
                "ms_per_step": timing.median_ms,
                "ms_q1": q1,
                "ms_q3": q3,
                "times_ms": timing.times_ms,
                "saved_mib": saved / 2**20,
                "peak_memory_gib": peak / 2**30 if peak is not None else None,
            }
        )
        del model, opt, step
    return with_speedup(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.chapters.ch09.ladder", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["course", "resnet50", "gpt", "optimizer", "checkpointing", "all"])
    p.add_argument("--device", default="auto")
    p.add_argument("--json", help="also write rows (and targets) with provenance (data/reference/ladder_<gpu>.json)")
    args = p.parse_args(argv)
    payload: dict = {}
    if args.what in ("course", "all"):
        payload["course"] = course_ladder(args.device)
    if args.what in ("resnet50", "all"):
        payload["resnet50"] = resnet50_ladder(args.device)
        amp = mixed_precision_for(pick_device(args.device))  # fp16 on a T4 or V100, where bf16 is not native
        payload["largest_batch"] = [largest_batch(precision, device=args.device) for precision in ("fp32", amp)]
    if args.what in ("gpt", "all"):
        payload["gpt"] = gpt_ladder(args.device)
        payload["matmul_ceiling_tflops"] = matmul_ceiling(args.device)
    if args.what in ("optimizer", "all"):
        payload["optimizer"] = optimizer_table(args.device)
    if args.what in ("checkpointing", "all"):
        payload["checkpointing"] = checkpointing_table(args.device)
    if "resnet50" in payload:
        payload["targets"] = targets(payload["resnet50"], payload.get("gpt"), payload.get("course"))
    tables = ("course", "resnet50", "gpt", "optimizer", "checkpointing")
    text = "\n\n".join(format_rows(v) for k, v in payload.items() if k in tables)
    if "targets" in payload:
        text += "\n\n" + format_targets(payload["targets"])
    command = "python -m course_lib.chapters.ch09.ladder " + " ".join(argv if argv is not None else sys.argv[1:])
    record(command, text, args.json, **payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
