"""One rank of chapter 08's DDP run: the program torchrun starts in every process.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m course_lib.chapters.ddp_worker /tmp/ddp-out [--epochs 2 --fsdp ...]

course_lib.chapters.ddp_launch.launch starts it (from a notebook or its CLI); the command above
starts it from a shell, and with torchrun's rendezvous flags the same file runs on many machines.
torchrun hands every process RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its
environment; this file reads them and never makes them up.

Every rank, in order (each step leaves what it found in OUT for the launcher to check):
1. joins the process group: gloo on a CPU, nccl on CUDA (one GPU per process, LOCAL_RANK);
2. builds the model with a different seed on every rank and wraps it in DDP, which broadcasts
   rank 0's parameters: afterwards all ranks hold the same ones;
3. runs one fp32 forward and backward on its share of the first batch (DDP all-reduces the
   gradient) and saves that gradient;
4. trains with the course's Trainer over a DistributedSampler (Trainer calls set_epoch every
   epoch): autocast in the course's precision (bf16 on a CPU; on CUDA the policy of chapter 00,
   fp16 with a GradScaler -- one per process -- on a T4), accumulation with no_sync (Trainer),
   rank 0 alone printing progress and writing the checkpoint;
5. with --fsdp, computes the same gradient with FSDP2 (fully_shard), each rank holding a shard.
Whatever happens, the process group is destroyed (finally; after a barrier when every rank got
through), and with it its communication threads: see teardown(). A rank that fails first writes
OUT/failed_rank<r>.json (time and error), so that the launcher names the rank that failed first,
not the ones that failed because it left.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# Before any process group exists: torch.distributed.nn.functional's functions take `group=group.WORLD` as
# default arguments, evaluated at import. DDP imports it lazily (via torch._dynamo); imported after
# init_process_group, those defaults would hold the live group for good, destroy_process_group could not free
# it, and its gloo threads would still run while the interpreter shuts down: the intermittent SIGABRT at exit.
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from ..data import load_dataset
from ..models import MLP
from ..train import AMP_DTYPES, TrainConfig, Trainer, amp_step
from .bench import synthetic_batches

__all__: list[str] = []  # a program, run by torchrun; nothing here is imported by name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torch.distributed.run ... -m course_lib.chapters.ddp_worker")
    p.add_argument("out", type=Path, help="folder for what every rank leaves for the launcher")
    p.add_argument("--train-size", type=int, default=1024, help="Fashion-MNIST images, split over the ranks")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="micro-batch per rank")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step (no_sync on all but one)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="auto: nccl on CUDA GPUs, else gloo on the CPU; gloo: the CPU even where GPUs are",
    )
    p.add_argument("--precision", default=None, help="fp32|bf16|fp16|auto (default: bf16 on a CPU, auto on CUDA)")
    p.add_argument("--log-every", type=int, default=8, help="optimizer steps between rank 0's log lines")
    p.add_argument("--fsdp", action="store_true", help="also compute the first gradient with FSDP2")
    p.add_argument("--pg-timeout", type=float, default=60, help="seconds a collective may wait for the others")
    p.add_argument("--fail-rank", type=int, default=-1, help="this rank raises at micro-batch --fail-at")
    p.add_argument("--hang-rank", type=int, default=-1, help="this rank stops responding at micro-batch --fail-at")
    p.add_argument("--fail-at", type=int, default=3)
    p.add_argument("--crash-at-exit", type=int, default=-1, help="this rank aborts after its work is done")
    p.add_argument("--time-steps", type=int, default=0, help="instead: time this many steps of a wide MLP (GPU)")
    p.add_argument("--width", type=int, default=4096, help="width of the timed MLP")
    return p.parse_args(argv)


class Rank:
    """Who this process is, from torchrun's environment, and how it logs."""

    def __init__(self, backend: str = "auto") -> None:
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local = int(os.environ.get("LOCAL_RANK", self.rank))
        cuda = backend == "nccl" or (backend == "auto" and torch.cuda.is_available())
        self.backend = "nccl" if cuda else "gloo"
        self.device = torch.device(f"cuda:{self.local}" if cuda else "cpu")

    def say(self, msg: str, everyone: bool = False) -> None:
        if everyone or self.rank == 0:  # rank-0 logging: one voice, not world_size copies
            print(f"[rank {self.rank}] {msg}", flush=True)


def _checksum(model: nn.Module) -> float:
    return round(sum(p.detach().double().sum().item() for p in model.parameters()), 6)


def _cpu(named) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for n, t in named}


def _loss_fn(r: Rank, args: argparse.Namespace):
    """Cross-entropy, with the failures the tests inject: a rank that raises, or one that hangs."""
    calls = [0]

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == args.fail_at and r.rank == args.fail_rank:
            raise RuntimeError(f"injected failure on rank {r.rank} at micro-batch {calls[0]}")
        if calls[0] == args.fail_at and r.rank == args.hang_rank:
            r.say(f"injected hang at micro-batch {calls[0]}", everyone=True)
            time.sleep(3600)
        return F.cross_entropy(out, y)

    return loss


def _count_allreduces(ddp: DDP) -> list[int]:
    """Make DDP count its gradient all-reduces (one per bucket per synchronised backward)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = [0]

    def hook(state, bucket):
        calls[0] += 1
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return calls


def demo(r: Rank, args: argparse.Namespace) -> None:
    out = args.out
    precision = args.precision or ("bf16" if r.device.type == "cpu" else "auto")
    data = load_dataset(train_size=args.train_size, test_size=1, verbose=False).train
    r.say(f"data: {len(data):,} Fashion-MNIST images, {len(data) // r.world:,} per rank per epoch")
    # 2. different initial weights on purpose; DDP's constructor broadcasts rank 0's
    torch.manual_seed(args.seed + r.rank)
    model = MLP(hidden=args.hidden, depth=1).to(r.device)
    before = [None] * r.world
    dist.all_gather_object(before, _checksum(model))
    ddp = DDP(model, device_ids=[r.local] if r.device.type == "cuda" else None)
    after = [None] * r.world
    dist.all_gather_object(after, _checksum(model))
    r.say(f"parameter checksums before DDP() {before}, after {after}")
    init = _cpu(model.named_parameters())
    if r.rank == 0:
        torch.save(init, out / "init.pt")
    # 3. one fp32 step's gradient on this rank's share of the first batch
    sampler = DistributedSampler(data, num_replicas=r.world, rank=r.rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    x, y = next(iter(loader))
    x, y = x.to(r.device), y.to(r.device)
    F.cross_entropy(ddp(x), y).backward()
    grads = _cpu((n, p.grad) for n, p in model.named_parameters())
    torch.save(grads, out / f"grads_rank{r.rank}.pt")
    ddp.zero_grad(set_to_none=True)
    # 4. train: the course's loop, unchanged, on a DDP model and a DistributedSampler
    allreduces = _count_allreduces(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    cfg = TrainConfig(
        precision=precision,
        device=str(r.device),
        epochs=args.epochs,
        accum_steps=args.accum,
        progress=False,
        log_every=10**9,
    )
    trainer = Trainer(ddp, opt, cfg, loss_fn=_loss_fn(r, args))
    scaler = "on" if trainer.scaler.is_enabled() else "off"
    tqdm.monitor_interval = 0  # no bar here (progress=False): no tqdm monitor thread either, one fewer at exit
    r.say(
        f"{trainer.precision} autocast, GradScaler {scaler} (one per process); one step = {r.world} ranks "
        f"x {args.accum} micro-batches x {args.batch}"
    )
    per_epoch = len(loader) // args.accum
    total = args.epochs * per_epoch
    losses: list[float] = []
    while trainer.step_count < total:
        cfg.max_steps = min(total, trainer.step_count + args.log_every)
        done = trainer.step_count
        trainer.fit(loader)  # resumable: continues at the exact micro-batch where it stopped
        mine = torch.tensor(trainer.history.loss[done:], device=r.device)
        dist.all_reduce(mine)  # SUM (gloo has no AVG): the mean over ranks is what rank 0 logs
        losses += (mine / r.world).tolist()
        state = [None] * r.world  # each rank's own scaler: do they agree?
        dist.all_gather_object(state, (trainer.history.scale[-1], trainer.history.skipped_steps))
        scale = (
            f"scale {state[0][0]:g}, {state[0][1]} skipped (all ranks)"
            if len(set(state)) == 1
            else f"scale, skipped by rank {state}"
        )
        r.say(
            f"step {trainer.step_count:>3}/{total} epoch {(trainer.step_count - 1) // per_epoch} loss "
            f"{losses[-1]:.4f} (mean over ranks) {scale}"
        )
    if r.rank == 0:  # every rank holds the same state: one writer, never world_size writers
        trainer.save_checkpoint(out / "checkpoint.pt")
        r.say("checkpoint.pt written by rank 0 only, the others wait at a barrier")
    dist.barrier()  # nobody reads the checkpoint before it is complete
    torch.save(_cpu(model.named_parameters()), out / f"params_rank{r.rank}.pt")
    scales = [None] * r.world
    dist.all_gather_object(scales, trainer.history.scale)
    seen = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        seen.append(list(sampler))
    (out / f"indices_rank{r.rank}.json").write_text(json.dumps(seen))
    summary = {
        "world_size": r.world,
        "backend": r.backend,
        "device": str(r.device),
        "precision": trainer.precision,
        "scaler": trainer.scaler.is_enabled(),
        "checksums_before": before,
        "checksums_after": after,
        "losses": losses,
        "scales_by_rank": scales,
        "steps": trainer.step_count,
        "allreduce_calls": allreduces[0],
        "seconds": trainer.history.seconds,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    if args.fsdp:
        summary["fsdp"] = fsdp_gradient(r, args, init, x, y, grads)
    if r.rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    r.say(
        f"done: {trainer.step_count} optimizer steps, {allreduces[0]} gradient all-reduce calls, "
        f"{trainer.history.seconds:.1f} s of training",
        everyone=True,
    )


def fsdp_gradient(
    r: Rank, args: argparse.Namespace, init: dict, x: torch.Tensor, y: torch.Tensor, ddp_grads: dict
) -> dict:
    """Step 5: the first batch's gradient again, with FSDP2: each rank keeps 1/world of every tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # FSDP2 on a CPU before torch 2.9, each found on the running torch: 2.6's CPU Stream lacks the no-op record_event/
    # wait_event FSDP2 calls (added in 2.7, pytorch#145935), and 2.6's second all-gather in backward bumps the version
    # counter of tensors forward saved (pytorch#136303), so there each layer stays gathered until backward; up to 2.8,
    # gloo's reduce-scatter sums where FSDP2 asks for the average (pytorch#162338): `summed` undoes it in `full`.
    old_cpu = r.device.type == "cpu" and not hasattr(torch.cpu.Stream, "record_event")
    if old_cpu:
        torch.cpu.Stream.record_event, torch.cpu.Stream.wait_event = lambda self: None, lambda self, event: None
    summed = torch.zeros(1, device=r.device)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)  # the new name from torch 2.14
    scatter(summed, torch.ones(r.world, device=r.device), op=dist.ReduceOp.AVG)  # 1: averaged
    mesh = init_device_mesh(r.device.type, (r.world,))
    result = {}
    for name, policy in (
        ("fp32", MixedPrecisionPolicy()),
        ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    ):
        model = MLP(hidden=args.hidden, depth=1).to(r.device)
        model.load_state_dict(init)
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=not old_cpu)  # per layer
        fully_shard(model, mesh=mesh, mp_policy=policy)
        logits = model(x)
        F.cross_entropy(logits, y).backward()
        full = {n: p.grad.full_tensor().cpu() / summed.item() for n, p in model.named_parameters()}  # a collective
        diff = max(((full[n] - g).abs().max() / g.abs().max()).item() for n, g in ddp_grads.items())
        shapes = {n: [list(p.to_local().shape), list(p.shape)] for n, p in model.named_parameters()}
        held = sum(p.to_local().numel() for p in model.parameters())
        total = sum(p.numel() for p in model.parameters())
        result[name] = {
            "shapes": shapes,
            "held": held,
            "total": total,
            "rel_diff_vs_ddp": diff,
            "logits_dtype": str(logits.dtype).removeprefix("torch."),
            "grad_dtype": str(next(model.parameters()).grad.dtype).removeprefix("torch."),
        }
        r.say(
            f"FSDP2 {name}: holds {held:,} of {total:,} parameters; gradient vs DDP's: max rel. diff {diff:.1e}",
            everyone=name == "fp32",
        )
    # DTensor's caches keep this mesh for the life of the process, and the mesh keeps its process groups:
    # let go of them, or destroy_process_group cannot free the group (see teardown)
    getattr(mesh, "_pg_registry", {}).clear()
    return result


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


def _bench_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
    dtype: torch.dtype | None,
) -> None:
    amp_step(model, opt, scaler, [(x, y)], dtype)  # the course's AMP step, timed


def time_steps(r: Rank, args: argparse.Namespace) -> None:
    """--time-steps N: median step time of DDP on a wide MLP, per-rank batch --batch (the GPU reference)."""
    from ..device import recommend_precision

    prec = recommend_precision(r.device) if r.device.type == "cuda" else None
    dtype = AMP_DTYPES[prec.precision if prec else "fp32"]
    torch.manual_seed(args.seed)
    ddp = DDP(_bench_model(args.width).to(r.device), device_ids=[r.local] if r.device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(r.device.type, enabled=dtype == torch.float16)
    ((x, y),) = synthetic_batches(1, args.batch, (args.width,), args.width // 4, device=r.device, seed=r.rank)
    times = []
    for i in range(args.time_steps + 5):  # 5 warm-up steps
        if r.device.type == "cuda":
            torch.cuda.synchronize(r.device)
        t0 = time.perf_counter()
        _bench_step(ddp, opt, scaler, x, y, dtype)
        if r.device.type == "cuda":
            torch.cuda.synchronize(r.device)
        if i >= 5:
            times.append((time.perf_counter() - t0) * 1e3)
    gathered = [None] * r.world
    dist.all_gather_object(gathered, statistics.median(times))
    if r.rank == 0:
        q = statistics.quantiles(times, n=4)
        result = {
            "median_ms": max(gathered),
            "q1_ms": q[0],
            "q3_ms": q[2],
            "precision": prec.precision if prec else "fp32",
            "world_size": r.world,
            "batch_per_rank": args.batch,
            "width": args.width,
        }
        (args.out / "timing.json").write_text(json.dumps(result))
    r.say(f"median step {statistics.median(times):.2f} ms over {len(times)} steps", everyone=True)


def _group_threads() -> list[str]:
    """This process's threads that belong to process groups: gloo's loops, the store's, NCCL's (Linux)."""
    names = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(n for n in names if n.startswith(("gloo", "pt_gloo", "pt_tcpstore", "pt_nccl")))


def teardown(finished: bool) -> list[str]:
    """Destroy the process group, so that its threads end now, while the interpreter is whole; returns any left.

    A group's C++ threads (gloo's run loops, its TCP loop) end only when the last reference to the group
    goes. One still running at interpreter shutdown that needs the GIL there (to drop a tensor of the last
    collective, to run a Python callback) aborts the process after its work is done: "terminate called
    without an active exception", SIGABRT, most often when the cores are busy.
    """
    if dist.is_initialized():
        try:
            if finished:  # after an error, no barrier: the other ranks may be gone
                dist.barrier()  # every rank past its last collective before any rank closes its connections
        finally:
            gc.collect()  # DDP's reducer and FSDP's modules sit in reference cycles, and they hold the group
            dist.destroy_process_group()
            gc.collect()
    return _group_threads()


@record  # torchrun's error file: the traceback appears in its summary too
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    r = Rank(args.backend)
    args.out.mkdir(parents=True, exist_ok=True)
    finished = False
    try:
        if r.device.type == "cuda":
            torch.cuda.set_device(r.device)  # before anything touches CUDA: one GPU per process
        dist.init_process_group(
            r.backend,
            timeout=timedelta(seconds=args.pg_timeout),
            device_id=r.device if r.device.type == "cuda" else None,
        )
        r.say(
            f"rank {r.rank} of {r.world}, local rank {r.local}, pid {os.getpid()}, {r.backend} on {r.device}, "
            f"store {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
            everyone=True,
        )
        (time_steps if args.time_steps else demo)(r, args)
        finished = True
    except BaseException as e:
        failure = {"rank": r.rank, "time": time.time(), "error": f"{type(e).__name__}: {e}"}
        (args.out / f"failed_rank{r.rank}.json").write_text(json.dumps(failure))
        raise
    finally:
        left = teardown(finished)  # always, also after an error
    if left:  # something unknown here still holds the group: shutting the interpreter down beside its threads
        # is what aborts, so leave without that (every output file is written and closed by now)
        print(
            f"[rank {r.rank}] process-group threads outlived destroy_process_group: {', '.join(left)}; "
            "exiting without interpreter shutdown",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(0)
    if r.rank == args.crash_at_exit:
        print(f"[rank {r.rank}] injected crash at exit", file=sys.stderr, flush=True)
        os.abort()


if __name__ == "__main__":
    main()
