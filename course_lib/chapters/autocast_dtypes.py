"""Where every dtype ends up in a training step under autocast, and the memory that saves.

Chapter 02, section 3. autocast casts the *inputs* of each listed op; parameters, their
gradients and the optimizer's state stay fp32. What shrinks is what autograd saves for
backward: activations saved in 16 bits take half the bytes.

    print(format_module_dtypes(module_dtypes(model, x, device_type="cpu", dtype=torch.bfloat16)))
    memory_comparison(model, x, y)   # saved-for-backward bytes (any device), peak memory (CUDA)
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

from ..timing import peak_memory_bytes, saved_tensor_bytes
from .autocast_policy import LOW_PRECISION, short

__all__ = ["dtype_report", "module_dtypes", "format_module_dtypes", "memory_comparison"]


def dtype_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Counter]:
    """Chapter 02: how many parameters / grads / optimizer-state tensors there are of each dtype."""
    rep = {"params": Counter(short(p.dtype) for p in model.parameters()),
           "grads": Counter(short(p.grad.dtype) for p in model.parameters() if p.grad is not None)}
    if optimizer is not None:
        rep["optimizer state"] = Counter(short(v.dtype) for st in optimizer.state.values()
                                         for v in st.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
    return rep


@dataclass(frozen=True)
class ModuleDtypes:
    """The dtypes one leaf module saw and produced in a forward pass."""
    name: str
    kind: str
    in_dtype: torch.dtype | None
    out_dtype: torch.dtype | None


def module_dtypes(model: nn.Module, *inputs: torch.Tensor, device_type: str | None = None,
                  dtype: torch.dtype | None = None) -> list[ModuleDtypes]:
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
    out = [f"{'module':<18}{'type':<20}{'in':>6}{'out':>6}"]
    for r in rows:
        mark = "  <- cast down" if r.in_dtype == torch.float32 and r.out_dtype in LOW_PRECISION else (
            "  <- cast up to fp32" if r.in_dtype in LOW_PRECISION and r.out_dtype == torch.float32 else "")
        out.append(f"{r.name:<18}{r.kind:<20}{short(r.in_dtype):>6}{short(r.out_dtype):>6}{mark}")
    return "\n".join(out)


def memory_comparison(model: nn.Module, x: torch.Tensor, target: torch.Tensor,
                      loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
                      dtype: torch.dtype | None = None) -> dict[str, dict]:
    """Chapter 02: one forward + backward in fp32 and under autocast, and what each keeps.

    For each mode: `saved` = bytes autograd saves for backward (any device, via
    course_lib.timing.saved_tensor_bytes), `saved_by_dtype`, and `peak` = peak CUDA memory
    of the whole step (None off CUDA). Gradients are reset to None before each run.
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

        by_dtype = saved_tensor_bytes(forward)
        losses.clear()  # drop both graphs before measuring the peak of a clean step
        model.zero_grad(set_to_none=True)

        def step() -> None:
            forward()
            losses.pop().backward()

        peak = peak_memory_bytes(step, dev)
        out[name] = {"saved": sum(by_dtype.values()), "peak": peak,
                     "saved_by_dtype": {short(k): v for k, v in by_dtype.items()}}
    model.zero_grad(set_to_none=True)
    return out
