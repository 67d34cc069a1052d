"""Chapter 08: real DDP with torchrun, launched from a notebook or a shell, and checked.

    run = launch(["--epochs", "2"])         # 2 processes under torchrun: free port, timeout, logs
    run.show()                              # each rank's log
    python -m course_lib.chapters.ch08.distributed run                  # the same from a shell
    python tools/stress_ddp.py --runs 100                          # is the notebook's run reliable? (busy core)
    python -m course_lib.chapters.ch08.distributed record --json data/reference/ddp_<gpu>.json   # on GPUs

launch(), DDPRun and torchrun_command() live in course_lib.chapters.ch08.ddp_launch (torchrun, its free
port, timeout and logs, and every process stopped afterwards); course_lib.chapters.ch08.ddp_worker is
what every rank runs. This module checks what a run computed against a one-process reference,
computes FSDP2's gradient inside a rank (ddp_worker --fsdp), times DataParallel (with
AutocastForward) against DDP on GPUs, and holds the command line above.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from course_lib.chapters.ch08.ddp_launch import DDPRun, launch
from course_lib.models import MLP
from course_lib.tables import table

__all__ = [
    "max_rel_diff",
    "reference_train",
    "training_state_bytes",
    "AutocastForward",
    "dp_vs_ddp",
    "format_timing_reference",
]


# --------------------------------------------------------------------------- checking a run


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict | None = None) -> float:
    """Chapter 08: how far apart two sets of tensors are: the largest |a - b| over all of them, divided by
    the largest |b| or, given `start`, the largest |b - start| (how far training moved them). 0.0: identical.

    Max-abs over named tensors; chapter 04's `rel_diff` is the L2 norm over one tensor."""
    diff = max((a[k].double() - b[k].double()).abs().max().item() for k in b)
    ref = b if start is None else {k: b[k].double() - start[k].double() for k in b}
    return diff / max(max(ref[k].double().abs().max().item() for k in b), 1e-30)


def sampler_orders(n: int, world_size: int, epochs: int, seed: int, set_epoch: bool = True) -> list[list[list[int]]]:
    """orders[rank][epoch]: the indices DistributedSampler(shuffle=True, seed=seed) gives each rank."""

    def order(rank: int, epoch: int) -> list[int]:
        s = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        s.set_epoch(epoch if set_epoch else 0)  # without set_epoch a sampler stays at epoch 0
        return list(s)

    return [[order(r, e) for e in range(epochs)] for r in range(world_size)]


def _global_batches(
    n: int, world_size: int, batch_size: int, epochs: int, seed: int, set_epoch: bool, accum_steps: int = 1
) -> list[list[int]]:
    """The samples of each optimizer step of a DDP run, all ranks together, in DistributedSampler's order."""
    orders = sampler_orders(n, world_size, epochs, seed, set_epoch)
    micro = [[order[i : i + batch_size] for i in range(0, len(order), batch_size)] for order in orders[0]]
    steps = []
    for epoch in range(epochs):
        n_micro = (len(micro[epoch]) // accum_steps) * accum_steps  # a last partial group is dropped
        for start in range(0, n_micro, accum_steps):
            steps.append(
                [
                    i
                    for rank in range(world_size)
                    for m in range(start, start + accum_steps)
                    for i in orders[rank][epoch][m * batch_size : (m + 1) * batch_size]
                ]
            )
    return steps


def reference_train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    world_size: int,
    batch_size: int,
    epochs: int,
    lr: float,
    seed: int,
    accum_steps: int = 1,
    momentum: float = 0.9,
    amp_dtype: torch.dtype | None = None,
    set_epoch: bool = True,
) -> tuple[nn.Module, list[float]]:
    """Chapter 08: what a DDP run should compute, in one process: one large batch per step.

    Each step takes the samples that the `world_size` ranks' DistributedSamplers (seed `seed`,
    set_epoch every epoch unless set_epoch=False) give them for `accum_steps` micro-batches of
    `batch_size`, and does one SGD (momentum) step on their mean loss, under CPU autocast in
    `amp_dtype` (None: fp32). Returns a trained copy of `model` and the loss of every step.
    """
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for idx in _global_batches(len(x), world_size, batch_size, epochs, seed, set_epoch, accum_steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Chapter 08: bytes of parameters, gradients and optimizer state: what DDP copies onto every GPU."""
    tensors = {
        "parameters": list(model.parameters()),
        "gradients": [p.grad for p in model.parameters() if p.grad is not None],
        "optimizer state": [
            v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
        ],
    }
    return {k: sum(t.numel() * t.element_size() for t in ts) for k, ts in tensors.items()}


# --------------------------------------------------------------------------- FSDP2, in a running rank


def _no_record_event(self) -> None:  # a CPU stream before torch 2.9 (see fsdp_gradient): nothing to record
    return None


def _no_wait_event(self, event) -> None:  # nor to wait for
    return None


def fsdp_gradient(
    init: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, ddp_grads: dict, hidden: int, say: Callable
) -> dict:
    """In a running rank (ddp_worker --fsdp): the gradient of (x, y) at `init` again, with FSDP2, in fp32 and with
    a bf16 policy; each rank keeps 1/world of every tensor. Compared with `ddp_grads`, DDP's gradient there."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device, world = x.device, dist.get_world_size()
    # FSDP2 on a CPU before torch 2.9, each found on the running torch: 2.6's CPU Stream lacks the no-op record_event/
    # wait_event FSDP2 calls (added in 2.7, pytorch#145935), and 2.6's second all-gather in backward bumps the version
    # counter of tensors forward saved (pytorch#136303), so there each layer stays gathered until backward; up to 2.8,
    # gloo's reduce-scatter sums where FSDP2 asks for the average (pytorch#162338): `summed` undoes it in `full`.
    old_cpu = device.type == "cpu" and not hasattr(torch.cpu.Stream, "record_event")
    if old_cpu:
        torch.cpu.Stream.record_event = _no_record_event
        torch.cpu.Stream.wait_event = _no_wait_event
    summed = torch.zeros(1, device=device)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)  # the new name from torch 2.14
    scatter(summed, torch.ones(world, device=device), op=dist.ReduceOp.AVG)  # 1: averaged
    mesh = init_device_mesh(device.type, (world,))
    result = {}
    for name, policy in (
        ("fp32", MixedPrecisionPolicy()),
        ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    ):
        model = MLP(hidden=hidden, depth=1).to(device)
        model.load_state_dict(init)
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=not old_cpu)  # per layer
        fully_shard(model, mesh=mesh, mp_policy=policy)
        logits = model(x)
        F.cross_entropy(logits, y).backward()
        full = {n: p.grad.full_tensor().cpu() / summed.item() for n, p in model.named_parameters()}  # a collective
        diff = max_rel_diff(full, ddp_grads)
        shapes = {n: [list(p.to_local().shape), list(p.shape)] for n, p in model.named_parameters()}
        held = sum(p.to_local().numel() for p in model.parameters())
        total = sum(p.numel() for p in model.parameters())
        result[name] = {
            "shapes": shapes,
            "held": held,
            "total": total,
            "max_rel_diff_vs_ddp": diff,
            "logits_dtype": str(logits.dtype).removeprefix("torch."),
            "grad_dtype": str(next(model.parameters()).grad.dtype).removeprefix("torch."),
        }
        say(
            f"FSDP2 {name}: holds {held:,} of {total:,} parameters; gradient vs DDP's: max rel. diff {diff:.1e}",
            everyone=name == "fp32",
        )
    # DTensor's caches keep this mesh for the life of the process, and the mesh keeps its process groups:
    # let go of them, or destroy_process_group cannot free the group (ddp_worker.main)
    getattr(mesh, "_pg_registry", {}).clear()
    return result


# --------------------------------------------------------------------------- GPU reference: DP vs DDP


class AutocastForward(nn.Module):
    """Chapter 08: run `model`'s forward under autocast(dtype) in whichever thread calls it.

    DataParallel runs each replica in a thread of its own and re-enters autocast there with
    `enabled` alone (torch/nn/parallel/parallel_apply.py); the autocast dtype is per thread, so
    the replicas fall back to the default, fp16 on CUDA, inside an outer bf16 region. Autocast in
    the forward itself, as the AMP examples page does for DataParallel, carries the dtype along.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None):
            return self.model(x)


def _bench_model(width: int) -> nn.Module:
    """A wide MLP for step timing: enough work per step that communication has something to hide behind."""
    return MLP(in_features=width, hidden=width, depth=4, num_classes=width // 4)


def dp_vs_ddp(width: int = 4096, batch: int = 256, steps: int = 30) -> list[dict]:
    """Chapter 08: step time on 1 GPU, DataParallel over all GPUs, DDP over all GPUs (same batch per GPU)."""
    from course_lib.device import recommend_precision
    from course_lib.timing import time_fn
    from course_lib.train import AMP_DTYPES, amp_step

    prec = recommend_precision("cuda").precision
    dtype = AMP_DTYPES[prec]
    gpus = torch.cuda.device_count()
    rows = []
    for mode, n in (("1 GPU", 1), ("DataParallel", gpus)):
        torch.manual_seed(0)
        model = _bench_model(width).cuda()
        net = nn.DataParallel(AutocastForward(model, dtype)) if mode == "DataParallel" else model
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
        x, y = torch.randn(batch * n, width, device="cuda"), torch.randint(0, width // 4, (batch * n,), device="cuda")
        step = functools.partial(amp_step, net, opt, scaler, [(x, y)], dtype)  # the course's AMP step, timed
        t = time_fn(step, warmup=5, iters=steps, device="cuda")
        rows.append(
            {
                "mode": mode,
                "gpus": n,
                "median_ms": t.median_ms,
                "q1_ms": t.quartiles_ms[0],
                "q3_ms": t.quartiles_ms[1],
                "images_per_s": batch * n / t.median_ms * 1e3,
            }
        )
        del model, net, opt
    run = launch(["--time-steps", steps, "--batch", batch, "--width", width], nproc=gpus, timeout=600, name="timing")
    t = json.loads((run.out / "timing.json").read_text())
    rows.append(
        {
            "mode": "DDP",
            "gpus": gpus,
            "median_ms": t["median_ms"],
            "q1_ms": t["q1_ms"],
            "q3_ms": t["q3_ms"],
            "images_per_s": batch * gpus / t["median_ms"] * 1e3,
        }
    )
    return [{**r, "precision": prec, "width": width, "batch_per_gpu": batch} for r in rows]


def format_timing_reference(ref: dict) -> str:
    """Chapter 08: the recorded GPU results: the nccl run, and DataParallel vs DDP where 2+ GPUs were there."""
    out = []
    for nccl in ref.get("nccl_runs", []):
        agree = all(s == nccl["scales_by_rank"][0] for s in nccl["scales_by_rank"])
        scale = (
            f"GradScaler on, final scale {nccl['scales_by_rank'][0][-1]:g} (same on all ranks: {agree})"
            if nccl["scaler"]
            else "no GradScaler"
        )
        out.append(
            f"nccl, {nccl['world_size']} rank(s), {nccl['precision']}: {scale}; {nccl['steps']} steps, "
            f"last loss {nccl['losses'][-1]:.4f}"
        )
    rows = ref.get("dp_vs_ddp") or []
    if rows:
        columns = [
            ("mode", "mode", ""),
            ("GPUs", "gpus", ""),
            ("median ms", "median_ms", ".2f"),
            ("middle half", lambda r: f"{r['q1_ms']:.2f}-{r['q3_ms']:.2f}", ""),
            ("images/s", "images_per_s", ",.0f"),
        ]
        out.append(table(rows, columns))
    elif ref.get("nccl_runs"):
        out.append("DataParallel vs DDP: not measured (that machine had one GPU; it needs two or more)")
    return "\n".join(out)


# --------------------------------------------------------------------------- command line


def _check_run(run: DDPRun) -> str:
    p0, p1 = run.load("params_rank0.pt"), run.load("params_rank1.pt")
    if not all(torch.equal(p0[k], p1[k]) for k in p0):
        raise AssertionError(f"ranks 0 and 1 ended with different parameters (max rel diff {max_rel_diff(p0, p1):.2e})")
    return "ranks 0 and 1 hold identical parameters"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m course_lib.chapters.ch08.distributed", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one 2-process run; prints every rank's log")
    r.add_argument("--nproc", type=int, default=2)
    r.add_argument("--timeout", type=float, default=180)
    r.add_argument("worker_args", nargs=argparse.REMAINDER, help="after --: arguments for ddp_worker")
    g = sub.add_parser("record", help="on GPUs: the nccl run, and DataParallel vs DDP with 2+ GPUs")
    g.add_argument("--json", help="write the results with provenance (data/reference/ddp_<gpu>.json)")
    g.add_argument("--width", type=int, default=4096)
    g.add_argument("--batch", type=int, default=256, help="batch per GPU")
    args = p.parse_args(argv)
    extra = [a for a in getattr(args, "worker_args", []) if a != "--"]
    if args.cmd == "run":
        run = launch(extra, args.nproc, timeout=args.timeout, name="cli", progress=True)
        run.show()
        print(f"finished in {run.seconds:.1f} s; {_check_run(run)}; outputs in {run.out}")
        return 0
    from course_lib.reference import record

    if not torch.cuda.is_available():
        print("record needs CUDA GPUs (nccl); on a CPU the notebook's own gloo run is the measurement")
        return 1
    keys = ("world_size", "backend", "precision", "scaler", "losses", "scales_by_rank", "steps", "seconds")
    runs = [
        launch(extra, torch.cuda.device_count(), timeout=600, name=name, progress=True)
        for name, extra in (("nccl", []), ("nccl_fp16", ["--precision", "fp16"]))
    ]
    payload = {"nccl_runs": [{k: run.summary[k] for k in keys} for run in runs], "dp_vs_ddp": []}
    if torch.cuda.device_count() >= 2:
        payload["dp_vs_ddp"] = dp_vs_ddp(args.width, args.batch)
    command = "python -m course_lib.chapters.ch08.distributed " + " ".join(argv if argv is not None else sys.argv[1:])
    record(command, format_timing_reference(payload), args.json, **payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
