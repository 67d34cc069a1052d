"""Where a forward pass first overflows: chapter 03's collapsing scale (chapter 09 walks through one).

A loss that turns into inf or NaN under fp16 autocast is almost always an activation that left
fp16's range (|x| > 65504) somewhere in the forward pass; everything after it only inherits the
damage. Forward hooks on every leaf module find the first one, with the largest magnitude each
layer produced, so the fix can go where the overflow starts.

    rows = trace_magnitudes(model, x, device_type="cpu", dtype=torch.float16)
    print(format_magnitudes(rows))          # marks the first layer whose output is not finite
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from course_lib.tables import table

__all__ = ["trace_magnitudes", "first_nonfinite", "format_magnitudes"]


@dataclass(frozen=True)
class Magnitude:
    name: str  # as in model.named_modules()
    kind: str  # the module's class
    dtype: str  # the output's dtype
    max_abs: float  # the largest finite |value| in the output (0 if none is finite)
    nonfinite: int  # how many entries are inf or NaN


def trace_magnitudes(
    model: nn.Module, *inputs: torch.Tensor, device_type: str | None = None, dtype: torch.dtype | None = None
) -> list[Magnitude]:
    """Chapters 03 and 09: run `model(*inputs)` (under autocast if device_type is given) and record,
    for every leaf module in execution order, its output's dtype, largest finite magnitude and
    non-finite count."""
    rows: list[Magnitude] = []

    def hook(name: str):
        def record(module: nn.Module, args: tuple, out: object) -> None:
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                o = out.detach()
                finite = torch.isfinite(o)
                biggest = o[finite].abs().max().item() if finite.any() else 0.0
                rows.append(
                    Magnitude(
                        name, type(module).__name__, str(o.dtype).removeprefix("torch."), biggest, int((~finite).sum())
                    )
                )

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if not list(m.children())]
    region = torch.autocast(device_type, dtype=dtype) if device_type else contextlib.nullcontext()
    try:
        with torch.no_grad(), region:
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return rows


def first_nonfinite(rows: list[Magnitude]) -> Magnitude | None:
    """Chapters 03 and 09: the first layer whose output holds an inf or NaN (None if all are finite)."""
    return next((r for r in rows if r.nonfinite), None)


def format_magnitudes(rows: list[Magnitude], limit: float = 65504.0) -> str:
    """Chapters 03 and 09: the trace as a table; marks outputs beyond `limit` (fp16's largest) and the
    first non-finite one."""
    first = first_nonfinite(rows)

    def mark(r: Magnitude) -> str:
        if r is first:
            return "<- first inf/NaN"
        if r.max_abs > limit:
            return "<- beyond fp16"
        return ""

    columns = [
        ("layer", lambda r: r.name[:15], ""),
        ("type", lambda r: r.kind[:13], "<"),
        ("dtype", "dtype", "<"),
        ("max |finite|", "max_abs", ".3g"),  # format() writes an infinite float as "inf"
        ("inf/NaN", "nonfinite", ""),
        ("", mark, "<"),
    ]
    return table(rows, columns)
