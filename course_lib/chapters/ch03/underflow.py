"""Underflow on real gradients: where a model's gradient values land in fp16, with and without a loss scale.

Chapter 03. One fp32 backward gives every gradient value a model makes (the activations' gradients
handed from layer to layer, and the parameters' .grad). Multiplied by a scale and stored in fp16,
each becomes 0 (below 2^-24), a subnormal with fewer significant bits, a normal number, or inf
(above 65504): `fates_at_scales` counts them, with chapter 01's classification (format_limits.fates)
at each scale, and `plot_gradient_histograms` shows them against fp16's ranges. The scale is applied
as GradScaler applies it (course_lib.chapters.ch03.scaler holds the scale's rule).

    g = gradient_sample(model, x, y)
    print(format_fates(fates_at_scales(g["activations"], [1.0, 2.0**16])))   # % that become 0, subnormal, ...
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from course_lib.chapters.ch01.format_limits import fates
from course_lib.chapters.ch03.scaler import f32
from course_lib.tables import table

__all__ = [
    "gradient_sample",
    "fates_at_scales",
    "format_fates",
    "plot_gradient_histograms",
    "shifted_gradient_runs",
    "format_shifted_runs",
    "plot_shifted_runs",
]

FP16_MAX = 65504.0
FP16_TINY = 2.0**-14  # smallest normal fp16
FP16_SUBNORMAL = 2.0**-24  # smallest subnormal fp16; |x| <= 2^-25 rounds to 0


def gradient_sample(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable = F.cross_entropy
) -> dict[str, torch.Tensor]:
    """Chapter 03: every gradient value one fp32 forward and backward of `model` on (x, y) makes.

    'activations': dL/d(output) of every leaf module, what an fp16 backward hands from layer
    to layer; 'parameters': every .grad. Flat float32 tensors, zeros included.
    """
    acts: list[torch.Tensor] = []

    def keep(mod: nn.Module, args: tuple, out: object) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: acts.append(g.detach().flatten().float()))

    handles = [m.register_forward_hook(keep) for m in model.modules() if not list(m.children())]
    try:
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
    finally:
        for h in handles:
            h.remove()
    params = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return {"activations": torch.cat(acts), "parameters": params}


def fates_at_scales(
    values: torch.Tensor, scales: Sequence[float] = (1.0,), dtype: torch.dtype = torch.float16
) -> list[dict]:
    """Chapter 03: the non-zero `values` times each scale, stored in `dtype`: one row per scale with the
    fractions that underflow (become 0), land among the subnormals (fewer significant bits), stay normal,
    or overflow to inf. Each row is chapter 01's format_limits.fates at that scale, plus "scale" and "n".

    The product is computed as GradScaler's `scale()` computes it: a float32 times the scale held as a
    float32, rounded once to float32, then stored in `dtype`. (A float64 product would be rounded to
    float64, then to float32 by torch's conversion, then to `dtype`: near a threshold that can differ
    when the scale is not a float32 number, e.g. 1e-3.) The row's "scale" is that float32 scale; "n"
    counts the non-zero finite values, which every fraction divides.
    """
    n = int(((values != 0) & torch.isfinite(values)).sum())
    return [{"scale": s, "n": n, **fates(values, dtype, scale=s)} for s in map(f32, scales)]


def _pow2(s: float) -> str:
    e = math.log2(s) if s > 0 else math.nan
    return f"2^{int(e)}" if e == int(e) else f"{s:g}"


def format_fates(rows: Sequence[dict], dtype: torch.dtype = torch.float16) -> str:
    """Chapter 03: fates_at_scales() as a table, in percent of the non-zero values."""
    name = str(dtype).removeprefix("torch.")
    columns = [("scale", lambda r: _pow2(r["scale"]), "")]
    for header, key in (
        ("become 0", "underflow"),
        ("subnormal", "subnormal"),
        ("normal", "normal"),
        ("overflow", "overflow"),
    ):
        columns.append((f"{header} %", lambda r, key=key: 100 * r[key], ".3f"))
    return f"% of {rows[0]['n']:,} non-zero values, in {name}\n" + table(rows, columns)


def plot_gradient_histograms(samples: dict[str, torch.Tensor], scales: Sequence[float] = (1.0, 2.0**16)):
    """Chapter 03: histograms of log2|gradient × scale| against fp16's ranges, one panel per scale."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(scales), figsize=(6 * len(scales), 3.8), sharey=True, squeeze=False)
    bins = np.arange(-44, 30.5, 0.5)
    for ax, s in zip(axes[0], scales):
        ax.axvspan(bins[0], -25, color="0.55", alpha=0.35, label="rounds to 0 in fp16")
        ax.axvspan(-25, -14, color="C1", alpha=0.18, label="fp16 subnormal")
        ax.axvspan(-14, math.log2(FP16_MAX), color="C2", alpha=0.12, label="fp16 normal")
        ax.axvspan(16, bins[-1], color="C3", alpha=0.18, label="overflows to inf")
        for i, (name, v) in enumerate(samples.items()):
            nz = v[v != 0].double().abs() * s
            hist, _ = np.histogram(torch.log2(nz).numpy(), bins=bins)
            ax.step(
                bins[:-1],
                100 * hist / max(1, nz.numel()),
                where="post",
                color=f"C{i * 4}",
                lw=1.5,
                label=f"{name} ({nz.numel():,})",
            )
        ax.set_xlabel("log2 |gradient × scale|" + ("" if s == 1 else f"   (scale {_pow2(s)})"))
        ax.set_title(f"scale {_pow2(s)}")
        ax.set_xlim(bins[0], bins[-1])
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("share of non-zero values (% per 0.5 bin)")
    axes[0][0].legend(loc="upper left", fontsize=7.5)
    fig.tight_layout()
    return fig


_MODES = ("fp32", "fp16, no scaler", "fp16 + GradScaler")


def shifted_gradient_runs(
    make_model: Callable[[], nn.Module],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    shifts: Sequence[int] = (0, 12, 16, 24),
    lr: float = 0.05,
) -> list[dict]:
    """Chapter 03: `make_model()` trained on `batches` (one step each, on this CPU) for each k in `shifts`,
    three ways: fp32; fp16 autocast without a scaler; fp16 autocast with torch.amp.GradScaler
    (its defaults). The loss is the cross-entropy times 2^-k, which makes every gradient exactly 2^-k
    times smaller, as if the model's gradients sat k binades lower, and SGD's learning rate (momentum
    0.9) is lr times 2^k, so that fp32 takes the same steps whatever k: power-of-two factors are exact.
    Rows {"shift", "mode", "loss" (the cross-entropy per step), "zero" (the share of gradient entries
    exactly 0, over the run), "scale" (the last one; 1 without a scaler), "gap" (the largest difference
    of the final parameters from fp32's at the first shift)}."""
    rows, reference = [], None
    for k in tqdm(shifts, desc="shifts", leave=False):  # seconds each: a bar while it runs, closed after
        for mode in _MODES:
            torch.manual_seed(0)
            model = make_model()
            opt = torch.optim.SGD(model.parameters(), lr=lr * 2.0**k, momentum=0.9)
            scaler = torch.amp.GradScaler("cpu", enabled=mode == _MODES[2])
            losses, zeros = [], []
            for x, y in batches:
                with torch.autocast("cpu", dtype=torch.float16, enabled=mode != _MODES[0]):
                    ce = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                scaler.scale(ce * 2.0**-k).backward()
                grads = torch.cat([p.grad.flatten() for p in model.parameters()])
                zeros.append((grads == 0).float().mean().item())
                scaler.step(opt)
                scaler.update()
                losses.append(ce.item())
            params = torch.cat([p.detach().flatten() for p in model.parameters()])
            reference = params if reference is None else reference
            rows.append(
                {
                    "shift": k,
                    "mode": mode,
                    "loss": losses,
                    "zero": sum(zeros) / len(zeros),
                    "scale": scaler.get_scale() if scaler.is_enabled() else 1.0,
                    "gap": (params - reference).abs().max().item() if mode == _MODES[0] else None,
                }
            )
    return rows


def format_shifted_runs(rows: Sequence[dict], last: int = 10) -> str:
    """Chapter 03: shifted_gradient_runs as a table: per shift and mode, the cross-entropy at the first
    step and over the `last` steps, the share of gradient entries that were 0, the last scale."""
    columns = [
        ("gradients x", lambda r: f"2^-{r['shift']}", ">"),
        ("", "mode", "<"),
        ("loss, first step", lambda r: r["loss"][0], ".3f"),
        (f"last {last} steps", lambda r: sum(r["loss"][-last:]) / len(r["loss"][-last:]), ".3f"),
        ("gradient entries 0 %", lambda r: 100 * r["zero"], ".1f"),
        ("scale", lambda r: _pow2(r["scale"]), ">"),
    ]
    return table(rows, columns)


def plot_shifted_runs(rows: Sequence[dict], shift: int):
    """Chapter 03: the loss per step of the three runs at one shift, each line drawn so that none hides
    another (fp32 and the scaled run lie on top of each other when the scaler works)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    styles = {_MODES[0]: ("C0", "-", 5.0), _MODES[1]: ("C3", "-", 2.0), _MODES[2]: ("C2", "--", 2.0)}
    for r in rows:
        if r["shift"] == shift:
            color, style, width = styles[r["mode"]]
            ax.plot(
                range(1, len(r["loss"]) + 1), r["loss"], color=color, ls=style, lw=width, alpha=0.8, label=r["mode"]
            )
    ax.set(
        xlabel="step", ylabel="cross-entropy (nats)", title=f"every gradient x 2^-{shift}: three runs from one start"
    )
    ax.legend(loc="center right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
