"""Chapter 12: one rank of chapter 12's memory runs: FSDP2's bytes per rank, measured by FSDPMemTracker.

    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        -m course_lib.chapters.ch12.memory_worker /tmp/mem-out [--batch 128]

course_lib.chapters.ch12.fake_world.measure_real starts it through chapter 08's `launch`. One
launch of 4 processes measures N = 4 on the whole group, N = 2 on ranks {0, 1} and N = 1 on rank 0
(process groups of their own, `dist.new_group`, which every rank creates); the ranks outside a
group wait at a barrier. Every configuration (fp32, bf16 with fp32 or default reduction,
`reshard_after_forward` True and False) runs one untracked training step, so that AdamW has
its state, then one step under `RankTimeline`. Each rank writes memory_rank<r>.json.

`RankTimeline` is PyTorch's FSDPMemTracker, watched at every operation: each category's largest
single buffer and largest total, and the moment the total peaks (forward/backward/optimizer and
the module running then), chapter 10's way of naming a peak. `tracked_step` is the step both this
worker and the one-process fake world (course_lib.chapters.ch12.fake_world) measure.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

# imported before any process group exists (chapter 08's ddp_worker says why)
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from course_lib.chapters.ch12.shard_memory import BLOCK_UNITS, BlockMLP

__all__ = ["CONFIGS", "REAL_CONFIGS"]  # RankTimeline, shard_model, tracked_step: fake_world uses them too

# name -> (param_dtype, reduce_dtype, reshard_after_forward); "bf16-none": reduce_dtype left to torch
CONFIGS: dict[str, tuple[torch.dtype, torch.dtype | None, bool]] = {
    "fp32": (torch.float32, None, True),
    "fp32-keep": (torch.float32, None, False),
    "bf16": (torch.bfloat16, torch.float32, True),
    "bf16-keep": (torch.bfloat16, torch.float32, False),
    "bf16-none": (torch.bfloat16, None, True),
    "bf16-none-keep": (torch.bfloat16, None, False),
    "fp32-reduce-bf16": (torch.float32, torch.bfloat16, True),  # not in the real launch: the fake world's check
}
REAL_CONFIGS = tuple(CONFIGS)[:6]  # what one launch measures
_KEYS = {  # predict_rank_bytes' keys -> FSDPMemTracker's categories
    "sharded_params": "Sharded Param",
    "optimizer_state": "OptState",
    "gradients": "Sharded Grad",
    "all_gather": "All Gather",
    "reduce_scatter": "Reduce Scatter",
}


class RankTimeline(FSDPMemTracker):
    """FSDPMemTracker that also keeps, over the tracked region, each category's largest
    single buffer (`largest`) and largest total (`most`), the peak's categories (`at_peak`) and its
    moment (`moment`: "backward, blocks.2", "optimizer step", ...)."""

    def __init__(self, mod: nn.Module, optm: torch.optim.Optimizer | None = None) -> None:
        super().__init__(mod, optm)
        self.largest: dict[str, int] = {}
        self.most: dict[str, int] = {}
        self.at_peak: dict[str, int] = {}
        self.moment = ""

    def _update_and_maybe_create_winfos(self, t: torch.Tensor, reftype: Any, update_existing: bool = False) -> set:
        winfos = super()._update_and_maybe_create_winfos(t, reftype, update_existing)
        for w in winfos:  # a buffer labelled all-gather / reduce-scatter: how big is this one alone?
            key = str(w.reftype.value)
            self.largest[key] = max(self.largest.get(key, 0), w.mem_consumed)
        return winfos

    def _update_peak_stats(self, peak_state: Any) -> None:
        super()._update_peak_stats(peak_state)
        for snap in self._curr_mem_snap.values():  # one device: the CPU (or the fake CPU)
            now = {str(getattr(k, "value", k)): v for k, v in snap.items()}
            for key, value in now.items():
                self.most[key] = max(self.most.get(key, 0), value)
            if now["Total"] > self.at_peak.get("Total", -1):
                self.at_peak = now
                self.moment = self._moment()

    def _moment(self) -> str:
        deepest = max(self._mod_tracker.parents, key=lambda n: (n.count("."), n))
        where = deepest.split(".", 1)[1] if "." in deepest else "model"
        if self._in_opt:
            return "optimizer step"
        return f"{'backward' if self._mod_tracker.is_bw else 'forward'}, {where}"


def shard_model(model: nn.Module, mesh: DeviceMesh, config: str, units=BLOCK_UNITS) -> nn.Module:
    """`fully_shard` each unit of `model`, then the root, with `config`'s policy (CONFIGS)."""
    param_dtype, reduce_dtype, reshard = CONFIGS[config]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    modules = dict(model.named_modules())
    for name in sorted(units, key=lambda n: -n.count(".")):  # innermost first: a unit takes what is left
        fully_shard(modules[name], mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    return model


def tracked_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> dict:
    """One training step (zero_grad, forward, backward, step) untracked, so that FSDP2 has
    initialised and AdamW holds its state, then the same step under RankTimeline.

    `loss_fn(model, x, y)` (default: cross-entropy of `model(x)`) is the loss the step differentiates.
    Returns the five categories of `predict_rank_bytes` as the tracker counts them (state after the
    step, the largest single all-gather and reduce-scatter buffer), the peak, its moment and its
    categories, and the largest total each category reached."""

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        (loss_fn(model, x, y) if loss_fn else F.cross_entropy(model(x), y)).backward()
        optimizer.step()

    step()  # the first step: FSDP2's lazy initialisation (shards padded again) and AdamW's state, not measured
    tracker = RankTimeline(model, optimizer)
    tracker.track_inputs((x, y))
    with tracker:
        step()
    end = {str(getattr(k, "value", k)): v for snap in tracker._curr_mem_snap.values() for k, v in snap.items()}
    measured = {key: end.get(cat, 0) for key, cat in _KEYS.items() if key not in ("all_gather", "reduce_scatter")}
    measured["all_gather"] = tracker.largest.get("All Gather", 0)
    measured["reduce_scatter"] = tracker.largest.get("Reduce Scatter", 0)
    peak = max(tracker.get_tracker_snapshot("peak").values(), key=lambda s: s["Total"])
    return {
        "measured": measured,
        "peak": int(peak["Total"]),
        "moment": tracker.moment,
        "at_peak": tracker.at_peak,
        "most": tracker.most,
    }


def _batch(batch: int, world: int, rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of a global batch of `batch` × world rows, given storage of its own: a slice
    would keep the whole global batch alive, N times what the rank uses (and what a fake run counts)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(batch * world, 256, generator=g), torch.randint(0, 10, (batch * world,), generator=g)
    return x[rank * batch : (rank + 1) * batch].clone(), y[rank * batch : (rank + 1) * batch].clone()


def measure_rank(batch: int, configs: list[str], say: Callable[[str], None]) -> list[dict]:
    """This rank's measurements at N = 1, 2 and the whole world, every configuration in each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = sorted({n for n in (1, 2, world) if n <= world})
    groups = {n: dist.new_group(list(range(n))) if n < world else dist.group.WORLD for n in sizes}  # every rank
    meshes = []
    rows = []
    for n in sizes:
        if rank < n:
            mesh = DeviceMesh.from_group(groups[n], "cpu") if n < world else DeviceMesh("cpu", list(range(n)))
            meshes.append(mesh)
            for config in configs:
                torch.manual_seed(0)
                model = shard_model(BlockMLP(), mesh, config)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                x, y = _batch(batch, n, rank)
                t0 = time.perf_counter()
                result = tracked_step(model, opt, x, y)
                rows.append({"world": n, "rank": rank, "config": config, "batch": batch, **result})
                seconds = time.perf_counter() - t0
                say(f"N={n} {config}: peak {result['peak']:,} B at {result['moment']} ({seconds:.2f} s)")
                del model, opt
        dist.barrier()  # the ranks outside this group wait here
    for mesh in meshes:  # DTensor's caches keep meshes, meshes keep groups: let go (chapter 08, section 9)
        getattr(mesh, "_pg_registry", {}).clear()
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torch.distributed.run ... -m course_lib.chapters.ch12.memory_worker")
    p.add_argument("out", type=Path, help="folder for memory_rank<r>.json")
    p.add_argument("--batch", type=int, default=64, help="rows per rank (activations do not shrink with N)")
    p.add_argument("--configs", default=",".join(REAL_CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    return p.parse_args(argv)


@record
def main(argv: list[str] | None = None) -> None:
    """Measure, write memory_rank<r>.json, destroy the group, and leave no process-group thread behind."""
    args = parse_args(argv)
    rank = int(os.environ["RANK"])
    args.out.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(f"[rank {rank}] {msg}", flush=True)

    try:
        dist.init_process_group("gloo")
        try:
            rows = measure_rank(args.batch, args.configs.split(","), say)
            (args.out / f"memory_rank{rank}.json").write_text(json.dumps(rows))
            say(f"done: {len(rows)} measurements")
        finally:
            dist.destroy_process_group()
    except BaseException as e:
        failure = {"rank": rank, "time": time.time(), "error": f"{type(e).__name__}: {e}"}
        (args.out / f"failed_rank{rank}.json").write_text(json.dumps(failure))
        raise
    finally:
        gc.collect()  # FSDP's modules sit in cycles that hold the destroyed groups
    sys.stdout.flush()


if __name__ == "__main__":
    main()
