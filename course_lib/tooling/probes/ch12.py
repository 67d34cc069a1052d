"""Task side of exercise 12's checks (see course_lib.tooling.probes).

`rank_bytes`: the learner's prediction, called on one case; the right answer stays in the grader.

`fix_sharding`: the learner's `shard(model, mesh)` runs for real, with FSDP2, in a one-process gloo
group made here (world 1: every collective is real, and no other process is needed, so it works in
the grader's sandbox), on a fresh model built from the case. What comes back, as plain data:

    units      the modules that got their own fully_shard ("" is the root), in order
    params     per parameter: its dtype as stored between steps and whether it is sharded (a DTensor)
    linears    per Linear, during the first forward: the dtype of its input and of its (unsharded) weight
    output     the dtype of the model's output; error: what forward, backward or a step raised, or None
    unchanged  per block weight: the fraction of its elements that the optimizer steps left unchanged

The grader (course_lib/tooling/checks/ch12.py) judges each of them; nothing here knows the answer.
The process group, its mesh and everything the run made are let go before the probe returns,
whatever the learner's function did.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = ["rank_bytes", "fix_sharding", "Block", "Net", "build"]

# What the run records with, taken when the probe is imported, before any learner code runs.
_FSDP_MODULE, _DTENSOR, _ADAMW = FSDPModule, DTensor, torch.optim.AdamW
_INIT, _DESTROY, _IS_INIT, _MESH = (
    dist.init_process_group,
    dist.destroy_process_group,
    dist.is_initialized,
    init_device_mesh,
)
_HASH_STORE, _CROSS_ENTROPY = dist.HashStore, F.cross_entropy


def rank_bytes(case: dict, rank_bytes_fn: Callable) -> Any:
    """The learner's prediction for one case: a dict of bytes, as it came back."""
    return rank_bytes_fn(
        [list(map(list, unit)) for unit in case["units"]],
        [list(shape) for shape in case["root"]],
        case["world"],
        case["rank"],
        case["param_dtype"],
        case["reduce_dtype"],
        case["optimizer"],
    )


class Block(nn.Module):
    """One residual MLP block, pre-LayerNorm: the unit the exercise shards block by block."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """`blocks` (a ModuleList of Block) and a `head` Linear that the root owns: the exercise's model."""

    def __init__(self, d: int, hidden: int, n_blocks: int, classes: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(n_blocks))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(case: dict) -> tuple[Net, torch.Tensor, torch.Tensor]:
    """The case's model (fp32, seeded from the case alone) and its batch."""
    g = torch.Generator().manual_seed(case["seed"])
    model = Net(case["d"], case["hidden"], case["blocks"], case["classes"])
    with torch.no_grad():  # drawn from `g`, not the global RNG the learner's code may also use
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            # weights ~0.05: an AdamW step of lr 1e-5 moves them by ~2e-4 of themselves, which fp32 keeps and
            # bf16 (8 bits of mantissa, a step of ~0.4% of the value) rounds away
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else noise * (0.05 if p.dim() > 1 else 0.1))
    x = torch.randn(case["batch"], case["d"], generator=g)
    y = torch.randint(0, case["classes"], (case["batch"],), generator=g)
    return model, x, y


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _loopback() -> str | None:
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((n for n in names if n in ("lo", "lo0")), None)


def _run(case: dict, model: Net, shard_fn: Callable, mesh: Any) -> dict:
    x, y = case["_x"], case["_y"]
    got = shard_fn(model, mesh)  # what it raises is the learner's: the grader says so
    model = model if got is None else got
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard returned a {type(model).__name__}, not the model")
    named = dict(model.named_modules())
    seen: dict[str, dict] = {}

    def before(name: str) -> Callable:
        def hook(module: nn.Module, inputs: tuple) -> None:
            if name not in seen and inputs and isinstance(inputs[0], torch.Tensor):
                seen[name] = {"input": _name(inputs[0].dtype), "weight": _name(module.weight.dtype)}

        return hook

    for name, module in named.items():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(before(name))
    params = dict(model.named_parameters())
    watched = {n: p for n, p in params.items() if n.startswith("blocks.") and p.dim() == 2}
    start = {n: _local(p).detach().clone() for n, p in watched.items()}
    out = {
        "units": [n for n, m in named.items() if isinstance(m, _FSDP_MODULE)],
        "params": {n: {"dtype": _name(p.dtype), "sharded": isinstance(p, _DTENSOR)} for n, p in params.items()},
        "linears": seen,
        "output": None,
        "error": None,
        "unchanged": {},
    }
    try:
        optimizer = _ADAMW(model.parameters(), lr=case["lr"], weight_decay=0.0)
        for step in range(case["steps"]):
            logits = model(x)
            if step == 0:
                out["output"] = _name(logits.dtype)
            _CROSS_ENTROPY(logits.float(), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    except Exception as e:  # noqa: BLE001  the grader names what went wrong from it
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return out
    out["unchanged"] = {n: (_local(p).detach() == start[n]).float().mean().item() for n, p in watched.items()}
    return out


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, _DTENSOR) else p


def fix_sharding(case: dict, shard_fn: Callable) -> dict:
    """Run the learner's shard(model, mesh) in a one-process gloo group and report what it made."""
    if _IS_INIT():
        raise RuntimeError("a process group is already running in this process: restart the kernel and run again")
    model, x, y = build(case)
    loopback, old = _loopback(), os.environ.get("GLOO_SOCKET_IFNAME")
    if loopback and old is None:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback  # one process: gloo talks to itself over loopback
    mesh = None
    try:
        _INIT("gloo", store=_HASH_STORE(), rank=0, world_size=1)
        mesh = _MESH("cpu", (1,))
        return _run({**case, "_x": x, "_y": y}, model, shard_fn, mesh)
    finally:
        if mesh is not None:  # DTensor's caches keep the mesh, and the mesh its groups: let go of them first
            getattr(mesh, "_pg_registry", {}).clear()
        if _IS_INIT():
            _DESTROY()
        if loopback and old is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
