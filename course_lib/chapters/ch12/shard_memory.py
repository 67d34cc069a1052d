"""Chapter 12: from DDP to ZeRO to FSDP2, in bytes: what each rank holds, predicted by arithmetic.

    model = BlockMLP()                                      # 4 blocks + head: Ψ = 2,106,890
    predict_rank_bytes(model, 4, units=BLOCK_UNITS)          # FSDP2, rank 0 of 4, fp32
    ddp_rank_bytes(model)                                   # every DDP rank holds the whole state
    zero_rank_bytes(2_106_890, 4)                           # the Playbook's ZeRO-1/2/3 formulas

FSDP2 (`fully_shard`) splits every parameter along dim 0: rank r of N keeps rows
[r·c, (r+1)·c) with c = ceil(d0 / N), stored padded to c rows, so the last ranks may hold padding
only. The optimizer works on the unpadded local rows; the sharded gradient is the unit's
reduce-scatter output, a view of one padded buffer per unit. During forward and backward a unit
(one `fully_shard` call) is gathered whole: an all-gather buffer of N·(padded shard) elements in
`param_dtype`, and in backward a reduce-scatter buffer of the same size in `reduce_dtype`.

The chapter measures these numbers with PyTorch's FSDPMemTracker in real gloo processes
(course_lib.chapters.ch12.memory_worker) and in one process with a fake process group for any N
(course_lib.chapters.ch12.fake_world); tests/test_shard_memory.py holds the two to the byte.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "BlockMLP",
    "BLOCK_UNITS",
    "OPTIMIZERS",
    "predict_rank_bytes",
    "ddp_rank_bytes",
    "zero_rank_bytes",
    "shard_rows",
    "unit_params",
]

OPTIMIZERS = ("adamw", "sgd", "sgd_momentum")
BLOCK_UNITS = tuple(f"blocks.{i}" for i in range(4))  # BlockMLP's four blocks, each its own fully_shard unit


class _Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))  # pre-norm residual MLP, as in a transformer block


class BlockMLP(nn.Module):
    """Chapter 12: the chapter's model: `depth` blocks of LayerNorm → Linear(width, hidden) → GELU →
    Linear(hidden, width) with a residual, then a Linear(width, classes) head.

    The defaults give Ψ = 2,106,890 parameters and a block of 526,080: small enough for four gloo
    processes on two cores, big enough that a block's buffers are megabytes."""

    def __init__(self, width: int = 256, hidden: int = 1024, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.width = width
        self.blocks = nn.ModuleList(_Block(width, hidden) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def shard_rows(d0: int, world: int, rank: int) -> tuple[int, int]:
    """Chapter 12: (rows rank `rank` really holds, rows it stores) of a dim-0 size `d0` split over `world`.

    torch.chunk's split: chunks of c = ceil(d0 / world) rows, the last ones shorter or empty; FSDP2
    pads every rank's chunk to c rows, so that all-gather and reduce-scatter move equal pieces."""
    c = math.ceil(d0 / world)
    return max(0, min(c, d0 - rank * c)), c


def unit_params(model: nn.Module, units: Sequence[str] = ()) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Chapter 12: the parameters each FSDP unit manages: {unit name: [(parameter name, parameter)]}.

    A parameter belongs to the innermost named unit above it; the rest to the root, "" (the last
    `fully_shard(model)`). Raises ValueError for a unit name that is not a submodule of `model`."""
    modules = dict(model.named_modules())
    for name in units:
        if name not in modules or name == "":
            raise ValueError(f"unit {name!r} is not a submodule of the model; submodules: {list(modules)[1:8]} ...")
    owned: dict[str, list[tuple[str, nn.Parameter]]] = {u: [] for u in ("", *units)}
    for pname, p in model.named_parameters():
        above = [u for u in units if pname.startswith(u + ".")]
        owned[max(above, key=len) if above else ""].append((pname, p))
    return owned


def _rows_and_rest(p: torch.Tensor) -> tuple[int, int]:
    d0 = p.shape[0] if p.dim() > 0 else 1
    return d0, p.numel() // d0 if d0 else 0


def predict_rank_bytes(
    model: nn.Module,
    world: int,
    rank: int = 0,
    *,
    units: Sequence[str] = (),
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
) -> dict[str, int]:
    """Chapter 12: what rank `rank` of `world` holds under FSDP2, in bytes, as FSDPMemTracker counts it.

    `units`: submodule names ("blocks.0", ...) each given its own `fully_shard` before the root's.
    `param_dtype`/`reduce_dtype`: the MixedPrecisionPolicy's (None: the installed torch's rule,
    which reduces in the gradient's dtype, `param_dtype`). `optimizer`: "adamw", "sgd",
    "sgd_momentum". Keys:

    - "sharded_params": the fp32 shards as stored, every parameter padded to ceil(d0 / world) rows;
    - "optimizer_state": AdamW's two moments on the unpadded local rows and a 4-byte `step` per
      tensor; SGD's momentum buffer; plain SGD nothing;
    - "gradients": the sharded gradients: each unit's reduce-scatter output, one padded buffer;
    - "all_gather": the largest unit's all-gather buffer (param_dtype × world × padded shard);
    - "reduce_scatter": the largest unit's reduce-scatter buffer (reduce_dtype, same size).
    With world == 1 FSDP2 runs no collective: both buffers are 0.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; this predicts {OPTIMIZERS}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..world-1 and world >= 1; got rank {rank} of world {world}")
    reduce_size = torch.empty((), dtype=reduce_dtype or param_dtype).element_size()
    gather_size = torch.empty((), dtype=param_dtype).element_size()
    out = dict.fromkeys(("sharded_params", "optimizer_state", "gradients", "all_gather", "reduce_scatter"), 0)
    for params in unit_params(model, units).values():
        padded = 0  # this unit's padded shard, in elements (the same on every rank)
        for _, p in params:
            d0, rest = _rows_and_rest(p)
            held, stored = shard_rows(d0, world, rank)
            size = p.element_size()
            out["sharded_params"] += stored * rest * size
            moments = {"adamw": 2, "sgd": 0, "sgd_momentum": 1}[optimizer]
            out["optimizer_state"] += moments * held * rest * size + 4 * (optimizer == "adamw")
            padded += stored * rest
        # the gradient: reduce_dtype's output cast back to the parameters' dtype (fp32 for the chapter)
        out["gradients"] += padded * (params[0][1].element_size() if params else 0)
        if world > 1:
            out["all_gather"] = max(out["all_gather"], gather_size * padded * world)
            out["reduce_scatter"] = max(out["reduce_scatter"], reduce_size * padded * world)
    return out


def ddp_rank_bytes(model: nn.Module, optimizer: str = "adamw") -> dict[str, int]:
    """Chapter 12: what every DDP rank holds, whatever N: the whole model, its gradients, its optimizer
    state (the same keys as `predict_rank_bytes`; DDP has no all-gather, and its gradient buckets are
    the gradients)."""
    return predict_rank_bytes(model, 1, optimizer=optimizer)


def zero_rank_bytes(psi: int, world: int, k: int = 12) -> dict[str, float]:
    """Chapter 12: the Ultra-Scale Playbook's per-rank bytes of ZeRO-1/2/3 for Ψ parameters on N ranks.

    Its layout is Megatron/DeepSpeed's: bf16 parameters (2Ψ) and gradients (2Ψ) on every rank, and
    k = 12 bytes a parameter of Adam state (fp32 master, two moments) sharded. ZeRO-1 shards the
    state, ZeRO-2 the gradients too, ZeRO-3 the parameters too: 2Ψ+2Ψ+kΨ/N, 2Ψ+(2Ψ+kΨ)/N,
    (2Ψ+2Ψ+kΨ)/N. FSDP2's ZeRO-3 holds the same 16 B a parameter, split differently: (4 fp32
    parameter + 4 fp32 gradient + 8 Adam moments)/N, with bf16 only transient, one unit at a time."""
    return {
        "ddp": (2 + 2 + k) * psi,
        "zero1": (2 + 2) * psi + k * psi / world,
        "zero2": 2 * psi + (2 + k) * psi / world,
        "zero3": (2 + 2 + k) * psi / world,
        "fsdp2": (4 + 4 + 8) * psi / world,
    }
