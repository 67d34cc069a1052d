"""The FP32 / TF32 / AMP training-step table, measured with the course's own loop.

Chapter 00 runs it on your hardware. A popular article reports ResNet-50 on an RTX 4090 going
from 18.5 s to 12.1 s per epoch with AMP; a claim like that is only worth something with the
method, so every row here trains the same model on the same on-device batch with
`course_lib.train.Trainer.train_step`, timed by `course_lib.timing.time_fn` (warm-up,
synchronised clocks, median and spread of many steps).

    python -m course_lib.chapters.ch00.bench                                   # table for this machine
    python -m course_lib.chapters.ch00.bench --json data/reference/bench_<gpu>.json   # with provenance

It also holds the chapter's picture of one mixed-precision training step (`draw_amp_step`)
and the sentences that read a measurement from its numbers (`compare_runs`, `read_table`),
so that no sentence in the notebook claims "faster" or "slower" without them.
"""

from __future__ import annotations

import argparse
import functools
import sys
import textwrap

import torch
from tqdm.auto import tqdm

from course_lib.data import synthetic_batches
from course_lib.device import (
    cpu_bf16_flags,
    cuda_capability,
    has_native_bf16,
    has_tf32,
    mixed_precision_for,
    pick_device,
    tf32,
)
from course_lib.models import build_model
from course_lib.reference import record
from course_lib.tables import table
from course_lib.timing import Timing, compare, peak_memory_bytes, time_fn
from course_lib.train import TrainConfig, Trainer

__all__ = [
    "draw_amp_step",
    "compare_runs",
    "precision_table",
    "format_precision_table",
    "read_table",
]


# Input shape, constructor arguments and class count of each model the table can run.
WORKLOADS: dict[str, tuple[tuple[int, ...], dict, int]] = {
    "simplecnn": ((1, 28, 28), {"in_channels": 1}, 10),
    "mlp": ((1, 28, 28), {"in_features": 784}, 10),
    "small_resnet": ((3, 32, 32), {"in_channels": 3}, 10),
    "resnet50": ((3, 224, 224), {"num_classes": 1000}, 1000),
}
GPU_ONLY = {"resnet50"}  # 224-px ResNet-50 takes minutes and gigabytes per step on a CPU: never there


def _factor(base: float, other: float) -> str:
    """'2.69x faster' / '1.93x slower' for a time `other` against a time `base`."""
    return f"{base / other:.2f}x faster" if other <= base else f"{other / base:.2f}x slower"


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=100)


def compare_runs(seconds: dict[str, float], device: torch.device | str | None = None) -> str:
    """Chapter 00: read two training runs ({"fp32": s, "bf16": s}, fp32 first) in sentences: which was
    faster and by how much, what this hardware leads one to expect, and why one run is no benchmark."""
    (base_label, base), (label, t) = list(seconds.items())[:2]
    dev = pick_device() if device is None else torch.device(device)
    lines = [f"{label} took {t:.1f} s and {base_label} {base:.1f} s: {label} was {_factor(base, t)} in this one run."]
    if dev.type == "cpu":
        flags = cpu_bf16_flags()
        lines.append(
            f"This CPU computes bf16 natively ({', '.join(flags)}), so bf16 can be faster here, "
            "though a small model can still be faster in fp32."
            if flags
            else "This CPU has no AMX-BF16/AVX512-BF16 instructions: bf16 is converted in software "
            "there, so slower is what to expect."
        )
    elif dev.type == "cuda":
        cc = cuda_capability(dev)
        if has_native_bf16(dev):
            tc = "has bf16 Tensor Cores"
        elif cc >= (7, 0):
            tc = "has fp16 Tensor Cores"
        else:
            tc = "has no Tensor Cores"
        lines.append(
            f"This GPU (sm_{cc[0]}{cc[1]}) {tc}; a CNN this small on 28-pixel images gives a GPU "
            "little work: the ResNet-50 table below shows more."
        )
    lines.append(
        "One run each, data loading and evaluation included, has no spread to judge the "
        "difference by: the benchmark below times the training step alone, many times."
    )
    return "\n".join(_wrap(line) for line in lines)


def _rows_spec(dev: torch.device, model: str) -> list[tuple[str, str, bool, bool, str]]:
    """(label, precision, tf32, channels_last, why skipped or '') for each row of the table."""
    amp = mixed_precision_for(dev)  # on a CPU without native bf16 (or before Volta): what autocast costs there
    tf32_note = "" if has_tf32(dev) else "TF32 needs an NVIDIA Ampere-or-newer GPU (sm_80+)"
    convnet = model != "mlp"
    rows = [
        ("FP32 (strict)", "fp32", False, False, ""),
        ("TF32", "fp32", True, False, tf32_note),
        (f"AMP {amp}", amp, False, False, ""),
    ]
    if dev.type == "cuda" and convnet:  # NHWC is its own rung: it speeds up Tensor Core convolutions
        rows.append((f"AMP {amp} + channels_last", amp, False, True, ""))
    return rows


def step_row(
    model: str,
    precision: str,
    device: torch.device,
    *,
    batch: int,
    steps: int,
    allow_tf32: bool = False,
    channels_last: bool = False,
    shape: tuple[int, ...] | None = None,
    warmup: int = 3,
    autotune: bool = True,
) -> dict:
    """Time one training step of the course's loop (Trainer.train_step) on a synthetic on-device
    batch: median and quartiles of `steps` steps after `warmup` steps, samples/s, peak memory (CUDA).
    `autotune=False` leaves cuDNN on its heuristics (for memory probes, where timing does not count)."""
    default_shape, kwargs, num_classes = WORKLOADS[model]
    ((x, y),) = synthetic_batches(
        1, batch, shape=shape or default_shape, num_classes=num_classes, device=device, seed=0
    )
    torch.manual_seed(0)
    net = build_model(model, **kwargs)
    cfg = TrainConfig(
        precision=precision, device=str(device), channels_last=channels_last, progress=False, log_every=10**9
    )
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9), cfg)
    step = functools.partial(trainer.train_step, [(x, y)])
    # cuDNN autotuning: the first step at a new shape tries each convolution algorithm and keeps the
    # fastest (warm-up covers it). Fixed shapes, as here, are where it pays; restored afterwards.
    benchmark, torch.backends.cudnn.benchmark = (
        torch.backends.cudnn.benchmark,
        autotune and torch.device(device).type == "cuda",
    )
    try:
        with tf32(allow_tf32):
            timing = time_fn(step, warmup=warmup, iters=steps, device=device)
            peak = peak_memory_bytes(step, device)
    finally:
        torch.backends.cudnn.benchmark = benchmark
    q1, q3 = timing.quartiles_ms
    # This row's model, gradients and optimizer state are freed when the function returns:
    # max_memory_allocated counts everything still allocated, so a leftover would inflate the next row.
    return {
        "precision": precision,
        "tf32": allow_tf32,
        "channels_last": channels_last,
        "model": model,
        "batch": batch,
        "steps": steps,
        "ms_per_step": timing.median_ms,
        "ms_q1": q1,
        "ms_q3": q3,
        "times_ms": timing.times_ms,
        "samples_per_s": batch / timing.median_ms * 1e3,
        "peak_memory_gib": peak / 2**30 if peak is not None else None,
    }


def precision_table(
    model: str | None = None, batch: int | None = None, steps: int | None = None, device: str = "auto"
) -> list[dict]:
    """Chapter 00: time one training step per row: strict FP32, TF32, AMP, AMP + channels_last.

    AMP uses the precision the course recommends for this device (bf16 on Ampere+, fp16 +
    GradScaler on T4/V100; see `mixed_precision_for`). Defaults: on a GPU ResNet-50 at 224 px,
    batch 128 with 24 GiB of memory or more and 64 below (a 16 GB T4 or V100), so that the fp32
    row fits; on a CPU SimpleCNN, batch 64. A model sized for a GPU is refused on a CPU.
    """
    dev = pick_device(device)
    if dev.type == "cuda":
        big = torch.cuda.get_device_properties(dev).total_memory >= 24 * 2**30
        d_model, d_batch, d_steps = "resnet50", 128 if big else 64, 20
    else:
        d_model, d_batch, d_steps = "simplecnn", 64, 10
    model, batch, steps = model or d_model, batch or d_batch, steps or d_steps
    if model in GPU_ONLY and dev.type != "cuda":
        raise ValueError(
            f"{model} at 224 px is sized for a GPU (minutes per step and >4 GB on a CPU); "
            "on a CPU use model='simplecnn', 'mlp' or 'small_resnet'"
        )
    rows = [
        {"mode": label, "note": skipped}
        if skipped
        else {
            "mode": label,
            **step_row(
                model, precision, dev, batch=batch, steps=steps, allow_tf32=allow_tf32, channels_last=channels_last
            ),
        }
        # a bar while the rows are timed (seconds each), closed when done as chapter 07's sweeps are: left open,
        # its widget state was not saved and a reopened chapter lost it (tests/test_lab_session.py)
        for label, precision, allow_tf32, channels_last, skipped in tqdm(
            _rows_spec(dev, model), desc="timing", leave=False
        )
    ]
    base = rows[0]["ms_per_step"]
    for r in rows:
        if "ms_per_step" in r:
            r["speedup_vs_fp32"] = base / r["ms_per_step"]
    return rows


def format_precision_table(rows: list[dict]) -> str:
    """Chapter 00: precision_table rows as text; "middle half" is where half of the timed steps fell."""
    columns = [
        ("mode", "mode", ""),
        ("ms/step", "ms_per_step", ".1f"),
        ("middle half", lambda r: f"{r['ms_q1']:.1f}-{r['ms_q3']:.1f}", ""),
        ("samples/s", "samples_per_s", ".0f"),
        ("speed-up", lambda r: f"{r['speedup_vs_fp32']:.2f}x", ""),
        ("peak mem GiB", "peak_memory_gib", ".2f"),  # n/a: no CUDA, no allocator to ask
    ]
    return table(rows, columns, skipped=lambda r: None if "ms_per_step" in r else f"skipped: {r['note']}")


def read_table(rows: list[dict]) -> str:
    """Chapter 00: each timed row against the first (strict FP32) in words (course_lib.timing.compare):
    faster or slower, by what factor, and whether the difference is larger than the spread."""
    timed = [r for r in rows if "ms_per_step" in r]
    return compare({r["mode"]: Timing(r["times_ms"]) for r in timed}, timed[0]["mode"])


def draw_amp_step():
    """Chapter 00: the picture of one mixed-precision training step: which numbers are fp32, which 16-bit."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

    colours = {"fp32": ("#dbe7f5", "#3b6ea8"), "16": ("#fbe3cf", "#c0601a"), "scaler": ("#ffffff", "#5a8f3c")}
    boxes = {  # name: (x centre, y centre, text, kind); top row forward, bottom row backward
        "w": (1.2, 3.0, "master weights\nfp32", "fp32"),
        "w16": (4.4, 3.0, "16-bit copies\nof the weights", "16"),
        "fwd": (7.6, 3.0, "forward\nmatmuls, convs: 16 bits\ntheir sums: fp32", "16"),
        "loss": (10.8, 3.0, "loss\nfp32", "fp32"),
        "scale": (10.8, 1.0, "loss × S\n(fp16 only)", "scaler"),
        "bwd": (7.6, 1.0, "backward\nmatmuls, convs: 16 bits\ntheir sums: fp32", "16"),
        "grad": (4.4, 1.0, "weight gradients fp32\n÷ S; inf/NaN found:\nskip this step", "fp32"),
        "upd": (1.2, 1.0, "optimizer update\nfp32", "fp32"),
    }
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for x, y, text, kind in boxes.values():
        face, edge = colours[kind]
        ax.add_patch(
            FancyBboxPatch(
                (x - 1.1, y - 0.42),
                2.2,
                0.84,
                boxstyle="round,pad=0.05",
                fc=face,
                ec=edge,
                lw=1.6,
                ls="--" if kind == "scaler" else "-",
            )
        )
        ax.text(x, y, text, ha="center", va="center", fontsize=9)
    arrows = [
        ("w", "w16", "autocast\ncasts"),
        ("w16", "fwd", ""),
        ("fwd", "loss", ""),
        ("loss", "scale", "GradScaler"),
        ("scale", "bwd", ""),
        ("bwd", "grad", ""),
        ("grad", "upd", ""),
        ("upd", "w", "next step"),
    ]
    for a, b, label in arrows:
        (xa, ya), (xb, yb) = boxes[a][:2], boxes[b][:2]
        if ya == yb:
            start, end = (xa + 1.15 * (1 if xb > xa else -1), ya), (xb - 1.15 * (1 if xb > xa else -1), yb)
        else:
            start, end = (xa, ya - 0.47 * (1 if yb < ya else -1)), (xb, yb + 0.47 * (1 if yb < ya else -1))
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, lw=1.3, color="#444444"))
        if label:
            offset = (0, 0.14) if ya == yb else (0.12, 0)
            ax.text(
                (start[0] + end[0]) / 2 + offset[0],
                (start[1] + end[1]) / 2 + offset[1],
                label,
                fontsize=8,
                ha="center" if ya == yb else "left",
                va="bottom" if ya == yb else "center",
                color="#444444",
            )
    handles = [
        Patch(fc=colours["fp32"][0], ec=colours["fp32"][1], label="fp32 (32 bits)"),
        Patch(fc=colours["16"][0], ec=colours["16"][1], label="16 bits (fp16 or bf16)"),
        Patch(fc="white", ec=colours["scaler"][1], ls="--", label="fp16 only: loss scaling by S"),
    ]
    ax.legend(handles=handles, loc="center", ncol=3, fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.5))
    ax.set_xlim(0, 12)
    ax.set_ylim(0.35, 3.65)
    ax.axis("off")
    ax.set_title("One mixed-precision training step: top row forward, bottom row backward and update", fontsize=10)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m course_lib.chapters.ch00.bench",
        description="FP32 / TF32 / AMP training-step table for this machine",
    )
    p.add_argument("--model", choices=sorted(WORKLOADS))
    p.add_argument("--batch", type=int)
    p.add_argument("--steps", type=int, help="timed steps per row (median and middle half reported)")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", help="also write rows + provenance here (data/reference/bench_<gpu>.json)")
    args = p.parse_args(argv)
    rows = precision_table(args.model, args.batch, args.steps, args.device)
    command = "python -m course_lib.chapters.ch00.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    record(command, format_precision_table(rows), args.json, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
