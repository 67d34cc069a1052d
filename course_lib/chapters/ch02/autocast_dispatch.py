"""What autocast does, seen from the dispatcher: which ops it has kernels for, and what reaches the kernels.

Chapter 02 uses this module to look under autocast. autocast is a dispatch key: an op with an
autocast kernel for the device has its floating-point inputs cast before the real kernel runs;
every other op falls through. Two views of that, both read from the installed torch:

    registered_ops("cuda")                          # every ATen op with an AutocastCUDA kernel
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trace = dispatch_trace(lambda: model(x))    # each ATen op with the dtypes it really received
    casts(trace)                                    # how many casts of each kind, e.g. ('fp32', 'bf16')

`dispatch_trace` works around `loss.backward()` too: `backward_pairs` then shows each derivative
op next to its forward op, in the dtype that op ran in. The probe of autocast_policy classifies
ops with the same recorder.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["dispatch_trace", "casts", "backward_pairs", "registered_ops"]
# DispatchRecorder is public for autocast_policy's probes; no chapter uses it (not in __all__)

SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def short(dtype: torch.dtype | None) -> str:
    """'fp32' / 'fp16' / 'bf16' for a dtype (its torch name for anything else)."""
    if dtype is None:
        return "-"
    return SHORT.get(dtype, str(dtype).replace("torch.", ""))


# --------------------------------------------------------------------------- running ops under autocast


@dataclass(frozen=True)
class TraceEntry:
    """One ATen op as it reached the kernels: after autocast's casts."""

    op: str
    in_dtypes: tuple[torch.dtype, ...]
    out_dtype: torch.dtype | None

    def __str__(self) -> str:
        return f"{self.op}({', '.join(map(short, self.in_dtypes))}) -> {short(self.out_dtype)}"


class DispatchRecorder(TorchDispatchMode):
    """A dispatch mode that records every ATen op run inside it as a TraceEntry (`entries`).

    A dispatch mode sits *below* the Autocast dispatch key, so it sees exactly what autocast
    hands on: its inserted `_to_copy` casts and the op with cast inputs. dispatch_trace and
    autocast_policy's probes run under it; no chapter uses it directly.
    """

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[TraceEntry] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = tuple(t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        outs = [t.dtype for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.entries.append(TraceEntry(str(func.overloadpacket.__name__), ins, outs[0] if outs else None))
        return out


def dispatch_trace(fn: Callable[[], object], hide: Sequence[str] = ("detach", "alias")) -> list[TraceEntry]:
    """Chapter 02: the ATen ops `fn` runs, with the dtypes they really receive.

    Call it inside an autocast region to see the casts autocast inserts (`_to_copy`).
    `hide` drops autograd's bookkeeping ops (outputs saved for backward are detached).
    """
    with DispatchRecorder() as rec:
        fn()
    return [e for e in rec.entries if e.op not in hide]


def casts(trace: Sequence[TraceEntry]) -> Counter:
    """Chapter 02: how many dtype casts of each kind (e.g. ('fp32', 'bf16')) a trace contains."""
    return Counter(
        (short(e.in_dtypes[0]), short(e.out_dtype))
        for e in trace
        if e.op in ("_to_copy", "to") and e.in_dtypes and e.out_dtype != e.in_dtypes[0]
    )


def backward_pairs(
    forward: Sequence[TraceEntry], backward: Sequence[TraceEntry]
) -> list[tuple[TraceEntry, TraceEntry]]:
    """Chapter 02: (forward op, its backward op) for every backward op named after a forward op.

    ATen names most derivative ops `<op>_backward...` (`mse_loss_backward`,
    `_softmax_backward_data`); a matmul's backward is plain `mm`s and is not paired here.
    """
    by_name = {e.op: e for e in forward}
    return [
        (by_name[b.op.split("_backward")[0]], b)
        for b in backward
        if "_backward" in b.op and b.op.split("_backward")[0] in by_name
    ]


def registered_ops(device: str = "cpu") -> list[str]:
    """Chapter 02: every ATen op with an autocast kernel for `device` in this torch build.

    These are the ops autocast can change; every other op falls through and runs in its
    inputs' dtype. (Which way each one casts needs a probe: see probe_policy.)
    """
    key = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU", "mps": "AutocastMPS"}[device]
    return sorted(r.removeprefix("aten::") for r in torch._C._dispatch_get_registrations_for_dispatch_key(key))
