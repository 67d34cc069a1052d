"""One rank of chapter 08's DDP run: the program torchrun starts in every process.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m course_lib.chapters.ch08.ddp_worker /tmp/ddp-out [--epochs 2 --fsdp ...]

course_lib.chapters.ch08.ddp_launch.launch starts it (from a notebook or its CLI); the command above
starts it from a shell, and with torchrun's rendezvous flags the same file runs on many machines.
torchrun hands every process RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its
environment; init_process_group reads them, and nothing here makes them up.

`train` is one rank's whole DDP training, the function the chapter shows: the process group, DDP,
a DistributedSampler with set_epoch, autocast with one GradScaler per process, accumulation with
no_sync (the course's amp_step), a checkpoint from rank 0, the group destroyed in `finally`. Its
`hooks` are where the chapter's instruments attach; `Hooks` does nothing there. `main` passes
`Instruments`, which watches from the hooks and leaves what it finds in OUT for the launcher, the
notebook and the tests: the parameter checksums before and after DDP(), one fp32 gradient of the
first batch, the gradient all-reduces (a DDP comm hook), the loss averaged over the ranks and every
rank's GradScaler (rank 0 logs them), the samplers' indices, the final parameters, summary.json and,
with --fsdp, the first gradient again with FSDP2. A forward pre-hook injects the failures the tests
ask for. A rank that fails writes OUT/failed_rank<r>.json (time and error), so that the launcher
names the rank that failed first, not the ones that failed because it left.
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

from course_lib.chapters.ch08.distributed import _bench_model, fsdp_gradient
from course_lib.data import load_dataset, synthetic_batches
from course_lib.models import MLP
from course_lib.train import AMP_DTYPES, StepResult, amp_step, resolve_precision

__all__ = ["train", "Hooks"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torch.distributed.run ... -m course_lib.chapters.ch08.ddp_worker")
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


class Hooks:
    """Chapter 08: where `train` lets the chapter's instruments in (`Instruments`); here each does nothing."""

    def built(self, model: nn.Module) -> None:
        """The model, before DDP() wraps it."""

    def started(self, ddp: DDP, loader: DataLoader, scaler: torch.amp.GradScaler) -> None:
        """All is set up; the first optimizer step comes next."""

    def stepped(self, result: StepResult) -> None:
        """An optimizer step is done (amp_step's result, still on the device)."""

    def finished(self, ddp: DDP, sampler: DistributedSampler) -> None:
        """The last optimizer step is done; the process group is still there."""


def train(args: argparse.Namespace, hooks: Hooks = Hooks()) -> None:
    """Chapter 08: one process's whole DDP training run; torchrun starts one per GPU (or CPU worker).

    `hooks` are where the chapter's instruments watch from (`Instruments`); the default does nothing."""
    local_rank = int(os.environ["LOCAL_RANK"])  # set by torchrun: this process's number on its machine
    cuda = args.backend == "nccl" or (args.backend == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)  # before anything else touches CUDA: one GPU per process
    timeout = timedelta(seconds=args.pg_timeout)  # how long a collective waits for the others
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout, device_id=device if cuda else None)
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(args.seed + rank)  # different weights on every rank, on purpose ...
        model = MLP(hidden=args.hidden, depth=1).to(device)
        hooks.built(model)
        ddp = DDP(model, device_ids=[local_rank] if cuda else None)  # ... DDP() broadcasts rank 0's
        data = load_dataset(train_size=args.train_size, test_size=1, verbose=False).train
        sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
        loader = DataLoader(data, batch_size=args.batch, sampler=sampler)  # this rank's share only
        optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
        precision = resolve_precision(args.precision or ("auto" if cuda else "bf16"), device)
        dtype = AMP_DTYPES[precision]  # auto: chapter 00's policy (fp16 on a T4); None: fp32
        scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # one per process
        hooks.started(ddp, loader, scaler)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)  # a new order every epoch, the same on every rank
            micro_batches = []
            for x, y in loader:
                micro_batches.append((x.to(device), y.to(device)))
                if len(micro_batches) == args.accum:  # one optimizer step per args.accum micro-batches:
                    # autocast forward, scaled backward (no_sync() on all but the last), scaler step
                    result = amp_step(ddp, optimizer, scaler, micro_batches, dtype)
                    hooks.stepped(result)
                    micro_batches = []
        hooks.finished(ddp, sampler)
        if rank == 0:  # every rank holds the same state: one checkpoint, written by one process
            checkpoint = {
                "model": ddp.state_dict(),  # DDP's: every key starts with "module."
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),  # part of the training state (chapter 03)
            }
            torch.save(checkpoint, args.out / "checkpoint.pt")
        dist.barrier()  # no rank goes on (to read it, or to close its connections) before it is written
    finally:
        dist.destroy_process_group()  # also after an error: the group's connections and threads end


def _checksum(model: nn.Module) -> float:
    return round(sum(p.detach().double().sum().item() for p in model.parameters()), 6)


def _cpu(named) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for n, t in named}


def _gather(obj: object) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs


class Instruments(Hooks):
    """Chapter 08's instruments: they watch `train` from its hooks and leave their findings in OUT."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank = int(os.environ["RANK"])
        self.pending: list[StepResult] = []  # steps not yet read back from the device
        self.losses: list[float] = []  # per optimizer step, the mean over the ranks
        self.scales: list[float] = []  # this rank's loss scale after each step (1.0 without a scaler)
        self.skipped = 0  # optimizer steps GradScaler skipped
        self.steps = 0
        self.allreduces = 0  # DDP's bucket all-reduces, counted by the comm hook
        self.forwards = 0
        self.seconds = 0.0  # training time, timed around train's loop
        self.precision = "fp32"  # what the first forward ran in

    def say(self, msg: str, everyone: bool = False) -> None:
        if everyone or self.rank == 0:  # rank-0 logging: one voice, not world_size copies
            print(f"[rank {self.rank}] {msg}", flush=True)

    def built(self, model: nn.Module) -> None:
        self.world = dist.get_world_size()
        self.device = next(model.parameters()).device
        self.say(
            f"rank {self.rank} of {self.world}, local rank {os.environ['LOCAL_RANK']}, pid {os.getpid()}, "
            f"{dist.get_backend()} on {self.device}, store {os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')}",
            everyone=True,
        )
        self.before = _gather(_checksum(model))  # different seeds: different parameters

    def started(self, ddp: DDP, loader: DataLoader, scaler: torch.amp.GradScaler) -> None:
        out = self.args.out
        model = ddp.module  # the model DDP wraps: its parameters are this rank's copy
        self.after = _gather(_checksum(model))  # DDP() broadcast rank 0's
        self.say(f"parameter checksums before DDP() {self.before}, after {self.after}")
        self.say(f"data: {len(loader.dataset):,} Fashion-MNIST images, {len(loader.sampler):,} per rank per epoch")
        self.init = _cpu(model.named_parameters())
        if self.rank == 0:
            torch.save(self.init, out / "init.pt")
        # one fp32 forward and backward on this rank's share of the first batch: DDP all-reduces the gradient
        x, y = next(iter(loader))
        self.first = x.to(self.device), y.to(self.device)
        F.cross_entropy(ddp(self.first[0]), self.first[1]).backward()
        self.grads = _cpu((n, p.grad) for n, p in model.named_parameters())
        torch.save(self.grads, out / f"grads_rank{self.rank}.pt")
        ddp.zero_grad(set_to_none=True)
        ddp.register_comm_hook(None, self._allreduce)  # from here on: training's all-reduces
        model.register_forward_pre_hook(self._forward)  # and training's forwards
        self.scaler = scaler.is_enabled()
        self.per_epoch = len(loader) // self.args.accum  # optimizer steps per epoch
        self.total = self.args.epochs * self.per_epoch
        self.t0 = time.perf_counter()

    def _allreduce(self, state, bucket):
        """DDP's default all-reduce, counted: DDP calls this once per bucket per synchronised backward."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.allreduces += 1
        return allreduce_hook(state, bucket)

    def _forward(self, module: nn.Module, inputs: tuple) -> None:
        """Before each micro-batch's forward: the autocast it runs in, and the failures the tests inject."""
        self.forwards += 1
        args = self.args
        if self.forwards == 1:
            on = torch.is_autocast_enabled(self.device.type)
            kind = torch.get_autocast_dtype(self.device.type)
            self.precision = next((k for k, v in AMP_DTYPES.items() if v == kind), str(kind)) if on else "fp32"
            how = f"{self.precision} autocast" if on else "fp32 (autocast off)"
            self.say(
                f"{how}, GradScaler {'on' if self.scaler else 'off'} (one per process); "
                f"one step = {self.world} ranks x {args.accum} micro-batches x {args.batch}"
            )
        if self.forwards == args.fail_at and self.rank == args.fail_rank:
            raise RuntimeError(f"injected failure on rank {self.rank} at micro-batch {self.forwards}")
        if self.forwards == args.fail_at and self.rank == args.hang_rank:
            self.say(f"injected hang at micro-batch {self.forwards}", everyone=True)
            time.sleep(3600)

    def stepped(self, result: StepResult) -> None:
        self.pending.append(result)
        self.steps += 1
        if self.steps % self.args.log_every == 0:
            self._log()

    def _log(self) -> None:
        """Read the pending steps back; rank 0 logs the loss averaged over the ranks and the scalers."""
        losses = torch.stack([r.loss for r in self.pending])
        dist.all_reduce(losses)  # SUM (gloo has no AVG): the mean over ranks is what rank 0 logs
        self.losses += (losses / self.world).tolist()
        self.scales += [float(r.scale) for r in self.pending]
        self.skipped += sum(bool(r.skipped) for r in self.pending)
        self.pending.clear()
        state = _gather((self.scales[-1], self.skipped))  # each rank's own scaler: do they agree?
        scale = (
            f"scale {state[0][0]:g}, {state[0][1]} skipped (all ranks)"
            if len(set(state)) == 1
            else f"scale, skipped by rank {state}"
        )
        self.say(
            f"step {self.steps:>3}/{self.total} epoch {(self.steps - 1) // self.per_epoch} loss "
            f"{self.losses[-1]:.4f} (mean over ranks) {scale}"
        )

    def finished(self, ddp: DDP, sampler: DistributedSampler) -> None:
        args, out = self.args, self.args.out
        self.seconds = time.perf_counter() - self.t0
        if self.pending:
            self._log()
        torch.save(_cpu(ddp.module.named_parameters()), out / f"params_rank{self.rank}.pt")
        seen = []
        for epoch in range(args.epochs):  # the indices this rank's sampler gave it, epoch by epoch
            sampler.set_epoch(epoch)
            seen.append(list(sampler))
        (out / f"indices_rank{self.rank}.json").write_text(json.dumps(seen))
        summary = {
            "world_size": self.world,
            "backend": dist.get_backend(),
            "device": str(self.device),
            "precision": self.precision,
            "scaler": self.scaler,
            "checksums_before": self.before,
            "checksums_after": self.after,
            "losses": self.losses,
            "scales_by_rank": _gather(self.scales),
            "steps": self.steps,
            "allreduce_calls": self.allreduces,
            "seconds": self.seconds,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        }
        if args.fsdp:
            summary["fsdp"] = fsdp_gradient(self.init, *self.first, self.grads, args.hidden, self.say)
        if self.rank == 0:
            (out / "summary.json").write_text(json.dumps(summary, indent=1))


def _bench_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
    dtype: torch.dtype | None,
) -> None:
    amp_step(model, opt, scaler, [(x, y)], dtype)  # the course's AMP step, timed


def time_steps(args: argparse.Namespace) -> None:
    """--time-steps N: median step time of DDP on a wide MLP, per-rank batch --batch (the GPU reference)."""
    from course_lib.device import recommend_precision

    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = args.backend == "nccl" or (args.backend == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        prec = recommend_precision(device) if cuda else None
        dtype = AMP_DTYPES[prec.precision if prec else "fp32"]
        torch.manual_seed(args.seed)
        ddp = DDP(_bench_model(args.width).to(device), device_ids=[local_rank] if cuda else None)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        ((x, y),) = synthetic_batches(1, args.batch, (args.width,), args.width // 4, device=device, seed=rank)
        times = []
        for i in range(args.time_steps + 5):  # 5 warm-up steps
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            _bench_step(ddp, opt, scaler, x, y, dtype)
            if cuda:
                torch.cuda.synchronize(device)
            if i >= 5:
                times.append((time.perf_counter() - t0) * 1e3)
        gathered = _gather(statistics.median(times))
        if rank == 0:
            q = statistics.quantiles(times, n=4)
            result = {
                "median_ms": max(gathered),
                "q1_ms": q[0],
                "q3_ms": q[2],
                "precision": prec.precision if prec else "fp32",
                "world_size": world,
                "batch_per_rank": args.batch,
                "width": args.width,
            }
            (args.out / "timing.json").write_text(json.dumps(result))
        print(f"[rank {rank}] median step {statistics.median(times):.2f} ms over {len(times)} steps", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _group_threads() -> list[str]:
    """This process's threads that belong to process groups: gloo's loops, the store's, NCCL's (Linux)."""
    names = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(n for n in names if n.startswith(("gloo", "pt_gloo", "pt_tcpstore", "pt_nccl")))


@record  # torchrun's error file: the traceback appears in its summary too
def main(argv: list[str] | None = None) -> None:
    """Run `train` with the chapter's instruments (or, with --time-steps, the timing), then make sure that
    the process group's threads are gone.

    A group's C++ threads (gloo's run loops, its TCP loop) end only when the last reference to the group
    goes, and DDP's reducer and FSDP's modules sit in reference cycles that hold it: hence gc.collect()
    once `train` has destroyed the group. A thread still running at interpreter shutdown that needs the
    GIL there (to drop a tensor of the last collective, to run a Python callback) aborts the process after
    its work is done: "terminate called without an active exception", SIGABRT, most often when the cores
    are busy.
    """
    args = parse_args(argv)
    rank = int(os.environ["RANK"])
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        if args.time_steps:
            time_steps(args)
        else:
            watch = Instruments(args)
            train(args, watch)
            if rank == 0:
                watch.say("checkpoint.pt was written by rank 0 alone; the others waited at a barrier")
            watch.say(
                f"done: {watch.steps} optimizer steps, {watch.allreduces} gradient all-reduce calls, "
                f"{watch.seconds:.1f} s of training",
                everyone=True,
            )
    except BaseException as e:
        failure = {"rank": rank, "time": time.time(), "error": f"{type(e).__name__}: {e}"}
        (args.out / f"failed_rank{rank}.json").write_text(json.dumps(failure))
        raise
    finally:
        gc.collect()  # train's DDP (and FSDP's modules) leave cycles that hold the destroyed group
        left = _group_threads()
    if left:  # something unknown here still holds the group: shutting the interpreter down beside its threads
        # is what aborts, so leave without that (every output file is written and closed by now)
        print(
            f"[rank {rank}] process-group threads outlived destroy_process_group: {', '.join(left)}; "
            "exiting without interpreter shutdown",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(0)
    if rank == args.crash_at_exit:
        print(f"[rank {rank}] injected crash at exit", file=sys.stderr, flush=True)
        os.abort()


if __name__ == "__main__":
    main()
