"""Where every dtype ends up in a training step under autocast, and the memory that saves.

Chapter 02, sections 3, 5 and 6. autocast casts the *inputs* of each listed op; parameters,
their gradients and the optimizer's state stay fp32. What shrinks is what autograd saves for
backward: activations saved in 16 bits take half the bytes. The cast copies of the weights
are cached for as long as the outermost region is open, which costs memory and, if an
optimizer step happens inside the region, goes stale (`after_step_in_region`).

    print(format_module_dtypes(module_dtypes(model, x, device_type="cpu", dtype=torch.bfloat16)))
    memory_comparison(model, x, y)   # saved-for-backward bytes (any device), peak memory (CUDA)
    python -m course_lib.chapters.ch02.autocast_dtypes --json data/reference/autocast_memory_<gpu>.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

from course_lib.chapters.ch02.autocast_dispatch import short
from course_lib.chapters.ch02.autocast_policy import LOW_PRECISION
from course_lib.chapters.ch02.saved_tensors import saved_bytes_by_kind
from course_lib.models import MLP
from course_lib.reference import record
from course_lib.tables import table
from course_lib.timing import peak_memory_bytes

__all__ = [
    "dtype_report",
    "module_dtypes",
    "format_module_dtypes",
    "memory_comparison",
    "mlp_memory_rows",
    "format_mlp_memory_rows",
    "read_mlp_memory_rows",
    "cpu_fp16_flags",
    "REGION_LAYOUTS",
    "after_step_in_region",
    "losses_by_layout",
]


def dtype_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Counter]:
    """Chapter 02: how many parameters / grads / optimizer-state tensors there are of each dtype."""
    rep = {
        "params": Counter(short(p.dtype) for p in model.parameters()),
        "grads": Counter(short(p.grad.dtype) for p in model.parameters() if p.grad is not None),
    }
    if optimizer is not None:
        rep["optimizer state"] = Counter(
            short(v.dtype)
            for st in optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.is_floating_point()
        )
    return rep


@dataclass(frozen=True)
class ModuleDtypes:
    """The dtypes one leaf module saw and produced in a forward pass."""

    name: str
    kind: str
    in_dtype: torch.dtype | None
    out_dtype: torch.dtype | None


def module_dtypes(
    model: nn.Module, *inputs: torch.Tensor, device_type: str | None = None, dtype: torch.dtype | None = None
) -> list[ModuleDtypes]:
    """Chapter 02: input and output dtype of every leaf module, in execution order.

    With device_type given, the forward runs under torch.autocast(device_type, dtype);
    without, it runs as it is (so you can call it inside your own region).
    """
    rows: list[ModuleDtypes] = []

    def first_float(xs: object) -> torch.dtype | None:
        return next((t.dtype for t in tree_leaves(xs) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)

    def hook(name: str) -> Callable:
        def record(mod: nn.Module, args: tuple, out: object) -> None:
            rows.append(ModuleDtypes(name, type(mod).__name__, first_float(args), first_float(out)))

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if not list(m.children())]
    region = torch.autocast(device_type, dtype=dtype) if device_type else contextlib.nullcontext()
    try:
        with region:
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return rows


def format_module_dtypes(rows: Sequence[ModuleDtypes]) -> str:
    """Chapter 02: module_dtypes as a table; marks where autocast changed the dtype."""

    def cast(r: ModuleDtypes) -> str:
        if r.in_dtype == torch.float32 and r.out_dtype in LOW_PRECISION:
            return "<- cast down"
        if r.in_dtype in LOW_PRECISION and r.out_dtype == torch.float32:
            return "<- cast up to fp32"
        return ""

    columns = [
        ("module", "name", ""),
        ("type", "kind", "<"),
        ("in", lambda r: short(r.in_dtype), ""),
        ("out", lambda r: short(r.out_dtype), ""),
        ("", cast, "<"),
    ]
    return table(rows, columns)


def memory_comparison(
    model: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    dtype: torch.dtype | None = None,
) -> dict[str, dict]:
    """Chapter 02: one forward + backward in fp32 and under autocast, and what each keeps for backward.

    For each mode, in bytes (course_lib.chapters.ch02.saved_tensors.saved_bytes_by_kind, any device): `activations`
    (computed in the forward), `weight_copies` (autocast's 16-bit casts of the parameters, new memory),
    `existing` (saved tensors that existed before: parameters, the input batch; no new memory),
    `activations_by_dtype`; and `peak` = peak CUDA memory of the whole step (None off CUDA).
    Gradients are reset to None before each run.
    """
    dev = x.device
    dtype = dtype or torch.get_autocast_dtype(dev.type)
    out: dict[str, dict] = {}
    for name, enabled in (("fp32", False), (short(dtype), True)):
        model.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []

        def forward() -> None:
            with torch.autocast(dev.type, dtype=dtype, enabled=enabled):
                losses.append(loss_fn(model(x), target))

        kinds = saved_bytes_by_kind(forward)
        losses.clear()  # drop both graphs before measuring the peak of a clean step
        model.zero_grad(set_to_none=True)

        def step() -> None:
            forward()
            losses.pop().backward()

        peak = peak_memory_bytes(step, dev)
        out[name] = {
            "activations": sum(kinds["activations"].values()),
            "weight_copies": sum(kinds["weight copies"].values()),
            "existing": sum(kinds["existing"].values()),
            "activations_by_dtype": {short(k): v for k, v in kinds["activations"].items()},
            "peak": peak,
        }
    model.zero_grad(set_to_none=True)
    return out


def mlp_memory_rows(
    device: str = "cuda",
    dtypes: Sequence[torch.dtype] = (torch.float16, torch.bfloat16),
    width: int = 4096,
    batch: int = 512,
) -> list[dict]:
    """Chapter 02: memory_comparison on the AMP recipe's MLP (3 x 4096 wide, batch 512), per dtype.

    One row per low-precision dtype, sizes in MiB: the activations saved in fp32 and under autocast,
    the weight copies autocast saves, what the saved tensors reference that existed before (fp32), and
    the step's peak in each mode (`peak_*` None off CUDA).
    """
    rows = []
    for dtype in dtypes:
        torch.manual_seed(0)
        mlp = MLP(in_features=width, hidden=width, depth=3).to(device)
        x, y = torch.randn(batch, width, device=device), torch.randint(0, 10, (batch,), device=device)
        m = memory_comparison(mlp, x, y, dtype=dtype)
        low, mib = short(dtype), 2.0**20
        rows.append(
            {
                "dtype": low,
                "width": width,
                "batch": batch,
                "activations_fp32": m["fp32"]["activations"] / mib,
                "activations_low": m[low]["activations"] / mib,
                "weight_copies_low": m[low]["weight_copies"] / mib,
                "existing_fp32": m["fp32"]["existing"] / mib,
                "peak_fp32": m["fp32"]["peak"] / mib if m["fp32"]["peak"] else None,
                "peak_low": m[low]["peak"] / mib if m[low]["peak"] else None,
            }
        )
        del mlp, x, y
    return rows


def format_mlp_memory_rows(rows: Sequence[dict]) -> str:
    """Chapter 02: mlp_memory_rows as a table (MiB): the saved activations in fp32 and under autocast,
    autocast's saved weight copies, and the whole step's peak in both. Files recorded before the
    saved bytes were told apart by kind hold peaks only here ("-")."""

    columns = [
        ("autocast", "dtype", ""),
        ("activations fp32", "activations_fp32", ".1f"),
        ("low", "activations_low", ".1f"),
        ("weight copies", "weight_copies_low", ".1f"),
        ("peak fp32", "peak_fp32", ".1f"),
        ("peak low", "peak_low", ".1f"),
    ]
    return table(rows, columns, missing="-")


def read_mlp_memory_rows(rows: Sequence[dict]) -> str:
    """Chapter 02: mlp_memory_rows in words, computed from the numbers: what autocast saved on
    activations and added in weight copies, and how the whole step's peak moved (where it moved is
    step_memory.mlp_moments's to say). Rows whose fp32 peaks disagree are flagged."""
    out = []
    for r in rows:
        parts = [f"{r['dtype']}:"]
        if r.get("activations_fp32") is not None:
            saved = r["activations_fp32"] - r["activations_low"]
            net = r["weight_copies_low"] - saved
            parts.append(
                f"autocast spared {saved:.1f} MiB of activations and added {r['weight_copies_low']:.1f} MiB of 16-bit "
                f"weight copies to what the graph keeps for backward: it keeps {abs(net):.1f} MiB "
                f"{'more' if net > 0 else 'less'}."
            )
        if r.get("peak_fp32"):
            grew = r["peak_low"] - r["peak_fp32"]
            parts.append(
                f"The step's peak went from {r['peak_fp32']:.1f} to {r['peak_low']:.1f} MiB "
                f"({'+' if grew >= 0 else ''}{grew:.1f} MiB)."
            )
        out.append(textwrap.fill(" ".join(parts), 100, subsequent_indent="    "))
    fp32_peaks = [r["peak_fp32"] for r in rows if r.get("peak_fp32")]
    if len(fp32_peaks) > 1 and max(fp32_peaks) > 1.1 * min(fp32_peaks):
        out.append(
            textwrap.fill(
                f"The rows' fp32 peaks measure the same fp32 step but differ ({min(fp32_peaks):.0f} "
                f"to {max(fp32_peaks):.0f} MiB): memory held from an earlier measurement was "
                "counted in one of them, so read those peaks with care.",
                100,
            )
        )
    return "\n".join(out)


def cpu_fp16_flags(cpuinfo: str | None = None) -> list[str]:
    """Chapter 02: the CPU's native fp16 instruction sets (AMX-FP16, AVX512-FP16), from /proc/cpuinfo
    (or the text given); [] where that cannot be read. course_lib.device.cpu_bf16_flags has bf16's."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return []
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return sorted(set(flags) & {"amx_fp16", "avx512_fp16"})


# --------------------------------------------------------------------------- the cast cache goes stale

REGION_LAYOUTS = (
    "a new region per step",
    "one region",
    "one region + torch.clear_autocast_cache()",
    "one region, cache_enabled=False",
)


def _layout(layout: str, device: str, dtype: torch.dtype) -> tuple[Callable, Callable]:
    # (the region around everything, the region around one step's forward) for a layout
    if layout not in REGION_LAYOUTS:
        raise ValueError(f"layout must be one of {REGION_LAYOUTS}")
    if layout == REGION_LAYOUTS[0]:
        return contextlib.nullcontext, lambda: torch.autocast(device, dtype=dtype)
    cache = layout != "one region, cache_enabled=False"
    return lambda: torch.autocast(device, dtype=dtype, cache_enabled=cache), contextlib.nullcontext


def after_step_in_region(
    model: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor,
    layout: str,
    dtype: torch.dtype | None = None,
    lr: float = 0.1,
) -> dict[str, float]:
    """Chapter 02: forward, one SGD step, forward again, on a copy of `model`, with regions as `layout` says.

    Returns the largest change of the output made by the step (`moved`) and the largest
    difference from the output the updated weights really give (`error`, computed in a
    fresh region with the cache off). A stale cast cache shows as moved = 0, error > 0.
    """
    model = copy.deepcopy(model)  # yours stays as it was
    dev = x.device.type
    dtype = dtype or torch.get_autocast_dtype(dev)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    outer, inner = _layout(layout, dev, dtype)
    with outer():
        with inner():
            before = model(x)
            loss = F.mse_loss(before.float(), target)
        loss.backward()
        opt.step()
        if layout == "one region + torch.clear_autocast_cache()":
            torch.clear_autocast_cache()
        with inner():
            after = model(x).float()
    with torch.no_grad(), torch.autocast(dev, dtype=dtype, cache_enabled=False):
        truth = model(x).float()
    return {"moved": (after - before.float()).abs().max().item(), "error": (after - truth).abs().max().item()}


def losses_by_layout(
    model: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor,
    layout: str,
    steps: int = 6,
    dtype: torch.dtype | None = None,
    lr: float = 0.1,
) -> list[float]:
    """Chapter 02: the loss at each of `steps` SGD steps on a copy of `model`, regions laid out as `layout`.

    In "one region" every forward after the first reuses the first step's cast weights.
    """
    model = copy.deepcopy(model)  # yours stays as it was
    dev = x.device.type
    dtype = dtype or torch.get_autocast_dtype(dev)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    outer, inner = _layout(layout, dev, dtype)
    losses = []
    with outer():
        for _ in range(steps):
            with inner():
                loss = F.mse_loss(model(x).float(), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if layout == "one region + torch.clear_autocast_cache()":
                torch.clear_autocast_cache()
    return losses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m course_lib.chapters.ch02.autocast_dtypes",
        description="saved-for-backward and peak memory of an MLP step, fp32 vs autocast",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--width", type=int, default=4096, help="MLP width (the AMP recipe's 4096; use less on a CPU)")
    p.add_argument("--json", help="also write the rows with provenance (data/reference/autocast_memory_<gpu>.json)")
    args = p.parse_args(argv)
    rows = mlp_memory_rows(args.device, width=args.width)
    command = "python -m course_lib.chapters.ch02.autocast_dtypes " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    record(command, format_mlp_memory_rows(rows), args.json, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
