"""The FP32 / TF32 / AMP training-step table, measured with the course's own loop.

Chapter 00 runs it on your hardware. A popular article reports ResNet-50 on an RTX 4090 going
from 18.5 s to 12.1 s per epoch with AMP; a claim like that is only worth something with the
method, so every row here trains the same model on the same on-device batch with
`course_lib.train.Trainer.train_step`, timed by `course_lib.timing.time_fn` (warm-up,
synchronised clocks, median and spread of many steps).

    python -m course_lib.chapters.bench                                   # table for this machine
    python -m course_lib.chapters.bench --json data/reference/bench_<gpu>.json   # with provenance
"""
from __future__ import annotations

import argparse
import functools
import sys

import torch

from ..data import synthetic_batches
from ..device import cuda_capability, pick_device, recommend_precision, tf32
from ..models import build_model
from ..reference import record
from ..timing import peak_memory_bytes, time_fn
from ..train import TrainConfig, Trainer

__all__ = ["precision_table", "format_table"]

# Input shape, constructor arguments and class count of each model the table can run.
WORKLOADS: dict[str, tuple[tuple[int, ...], dict, int]] = {
    "simplecnn": ((1, 28, 28), {"in_channels": 1}, 10),
    "mlp": ((1, 28, 28), {"in_features": 784}, 10),
    "small_resnet": ((3, 32, 32), {"in_channels": 3}, 10),
    "resnet50": ((3, 224, 224), {"num_classes": 1000}, 1000),
}
GPU_ONLY = {"resnet50"}  # 224-px ResNet-50 takes minutes and gigabytes per step on a CPU: never there


def _rows_spec(dev: torch.device, model: str) -> list[tuple[str, str, bool, bool, str]]:
    """(label, precision, tf32, channels_last, why skipped or '') for each row of the table."""
    amp = recommend_precision(dev).precision
    if amp == "fp32":  # a CPU without native bf16 (or a pre-Volta GPU): show what autocast costs there
        amp = "bf16" if dev.type == "cpu" else "fp16"
    tf32_note = "" if dev.type == "cuda" and cuda_capability(dev) >= (8, 0) else \
        "TF32 needs an NVIDIA Ampere-or-newer GPU (sm_80+)"
    convnet = model != "mlp"
    rows = [("FP32 (strict)", "fp32", False, False, ""), ("TF32", "fp32", True, False, tf32_note),
            (f"AMP {amp}", amp, False, False, "")]
    if dev.type == "cuda" and convnet:  # NHWC is its own rung: it speeds up Tensor Core convolutions
        rows.append((f"AMP {amp} + channels_last", amp, False, True, ""))
    return rows


def precision_table(model: str | None = None, batch: int | None = None, steps: int | None = None,
                    device: str = "auto") -> list[dict]:
    """Chapter 00: time one training step per row: strict FP32, TF32, AMP, AMP + channels_last.

    AMP uses the precision the course recommends for this device (bf16 on Ampere+, fp16 +
    GradScaler on T4/V100). Defaults: ResNet-50 at 224 px, batch 128 on a GPU; SimpleCNN,
    batch 64 on a CPU. A model sized for a GPU is refused on a CPU.
    """
    dev = pick_device(device)
    d_model, d_batch, d_steps = ("resnet50", 128, 20) if dev.type == "cuda" else ("simplecnn", 64, 10)
    model, batch, steps = model or d_model, batch or d_batch, steps or d_steps
    if model in GPU_ONLY and dev.type != "cuda":
        raise ValueError(f"{model} at 224 px is sized for a GPU (minutes per step and >4 GB on a CPU); "
                         "on a CPU use model='simplecnn', 'mlp' or 'small_resnet'")
    shape, kwargs, num_classes = WORKLOADS[model]
    (x, y), = synthetic_batches(1, batch, shape=shape, num_classes=num_classes, device=dev, seed=0)
    rows = []
    for label, precision, allow_tf32, channels_last, skipped in _rows_spec(dev, model):
        if skipped:
            rows.append({"mode": label, "note": skipped})
            continue
        torch.manual_seed(0)
        net = build_model(model, **kwargs)
        cfg = TrainConfig(precision=precision, device=str(dev), channels_last=channels_last, progress=False,
                          log_every=10**9)
        trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9), cfg)
        step = functools.partial(trainer.train_step, [(x, y)])
        with tf32(allow_tf32):
            timing = time_fn(step, warmup=3, iters=steps, device=dev)
            peak = peak_memory_bytes(step, dev)
        q1, q3 = timing.quartiles_ms
        rows.append({"mode": label, "precision": precision, "tf32": allow_tf32, "channels_last": channels_last,
                     "model": model, "batch": batch, "steps": steps, "ms_per_step": timing.median_ms,
                     "ms_q1": q1, "ms_q3": q3, "samples_per_s": batch / timing.median_ms * 1e3,
                     "peak_memory_gib": peak / 2**30 if peak is not None else None})
        # Free this row's model, gradients and optimizer state before the next row is measured:
        # max_memory_allocated counts everything still allocated, so a leftover would inflate it.
        del step, trainer, net
    base = rows[0]["ms_per_step"]
    for r in rows:
        if "ms_per_step" in r:
            r["speedup_vs_fp32"] = base / r["ms_per_step"]
    return rows


def format_table(rows: list[dict]) -> str:
    """Chapter 00: precision_table rows as text; "middle half" is where half of the timed steps fell."""
    out = [f"{'mode':<30}{'ms/step':>9}{'middle half':>15}{'samples/s':>11}{'speed-up':>10}{'peak mem':>11}"]
    for r in rows:
        if "ms_per_step" not in r:
            out.append(f"{r['mode']:<30}  skipped: {r['note']}")
            continue
        mem = f"{r['peak_memory_gib']:.2f} GiB" if r["peak_memory_gib"] is not None else "n/a (CPU)"
        half = f"{r['ms_q1']:.1f}-{r['ms_q3']:.1f}"
        out.append(f"{r['mode']:<30}{r['ms_per_step']:>9.1f}{half:>15}{r['samples_per_s']:>11.0f}"
                   f"{r['speedup_vs_fp32']:>9.2f}x{mem:>11}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.chapters.bench",
                                description="FP32 / TF32 / AMP training-step table for this machine")
    p.add_argument("--model", choices=sorted(WORKLOADS))
    p.add_argument("--batch", type=int)
    p.add_argument("--steps", type=int, help="timed steps per row (median and middle half reported)")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", help="also write rows + provenance here (data/reference/bench_<gpu>.json)")
    args = p.parse_args(argv)
    rows = precision_table(args.model, args.batch, args.steps, args.device)
    command = "python -m course_lib.chapters.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    record(command, format_table(rows), args.json, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
