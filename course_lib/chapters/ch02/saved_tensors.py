"""What autograd saves for backward, in bytes: the memory autocast shrinks, and the copies it adds.

A training step's activation memory is the tensors autograd keeps between forward and backward.
`saved_tensors_hooks` sees each one as it is saved; a dispatcher mode (`StorageOrigins`) below
autocast says where it came from: made by this forward, a 16-bit copy autocast cast from a
parameter, or a tensor that existed before (the parameters, the batch) and costs nothing extra.

    saved_bytes_by_kind(lambda: loss_fn(model(x), y))  # {"activations": {dtype: bytes}, ...}
    saved_activation_bytes(lambda: loss_fn(model(x), y))  # what autocast shrinks
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["StorageOrigins", "saved_bytes_by_kind", "saved_tensor_bytes", "saved_activation_bytes"]


class StorageOrigins(TorchDispatchMode):
    """Chapter 02: while active, notes each storage an op makes and which are casts of an nn.Parameter.
    Below autocast in the dispatcher, it sees autocast's casts. `kind(t)`: "activations" (made while
    active), "weight copies" (autocast's 16-bit casts of parameters) or "existing" (made before)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[int] = set()  # storage addresses
        self.weight_copies: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_ptr(t) for t in tree_leaves((args, kwargs))}  # an output that shares one is a view
        cast_of_param = func is torch.ops.aten._to_copy.default and isinstance(args[0], nn.Parameter)
        for ptr in {_ptr(t) for t in tree_leaves(out)} - inputs - {0}:
            self.made.add(ptr)  # an address freed and reused is the new output's now:
            (self.weight_copies.add if cast_of_param else self.weight_copies.discard)(ptr)
        return out

    def kind(self, t: torch.Tensor) -> str:
        ptr = _ptr(t)
        if ptr in self.weight_copies:
            return "weight copies"
        if ptr in self.made:
            return "activations"
        return "existing"


def _ptr(t: object) -> int:  # a tensor's storage address; 0 for anything else and for meta tensors
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) and t.device.type != "meta" else 0


def saved_bytes_by_kind(fn: Callable[[], object]) -> dict[str, dict[torch.dtype, int]]:
    """Chapter 02: bytes of the tensors autograd saves for backward while `fn` runs, by kind and dtype
    (`StorageOrigins`): "activations" grow with batch and sequence; "weight copies" are new memory held
    with the graph; "existing" tensors (parameters, the input batch) cost nothing extra. A Linear layer
    saves its weight: in fp32 the parameter itself, under autocast a new 16-bit copy."""
    seen: dict[int, tuple[str, torch.dtype, int]] = {}
    origins = StorageOrigins()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if ptr := _ptr(t):  # each storage once
            seen[ptr] = (origins.kind(t), t.dtype, t.untyped_storage().nbytes())
        # Detached, never `t`: a saved *output* (ReLU's) has a grad_fn holding this packed value, a cycle
        # through C++ gc cannot free when no backward runs (pytorch/pytorch#115255): a leaked graph.
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), origins:
        fn()
    out: dict[str, dict[torch.dtype, int]] = {"activations": {}, "weight copies": {}, "existing": {}}
    for kind, dtype, n in seen.values():
        out[kind][dtype] = out[kind].get(dtype, 0) + n
    return out


def saved_tensor_bytes(fn: Callable[[], object]) -> dict[torch.dtype, int]:
    """Chapters 02, 04, 09: per dtype, the memory that what autograd saves while `fn` runs costs:
    activations and weight copies, not what existed before (see saved_bytes_by_kind)."""
    kinds = saved_bytes_by_kind(fn)  # fn runs once
    act, copies = kinds["activations"], kinds["weight copies"]
    return {d: act.get(d, 0) + copies.get(d, 0) for d in {**act, **copies}}


def saved_activation_bytes(fn: Callable[[], object]) -> int:
    """Chapter 02: the bytes of the activations autograd saves while `fn` runs: what AMP halves.
    Not counted: parameters and the input batch (they exist anyway), weight copies (AMP adds them)."""
    return sum(saved_bytes_by_kind(fn)["activations"].values())
