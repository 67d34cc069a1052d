"""Chapter 08: real DDP with torchrun, launched from a notebook or a shell, and checked.

    run = launch(["--epochs", "2"])         # 2 processes under torchrun: free port, timeout, logs
    run.show()                              # each rank's log
    python -m course_lib.chapters.distributed run                  # the same from a shell
    python tools/stress_ddp.py --runs 100                          # is the notebook's run reliable? (busy core)
    python -m course_lib.chapters.distributed record --json data/reference/ddp_<gpu>.json   # on GPUs

launch() runs torchrun (`python -m torch.distributed.run --standalone`): its rendezvous store
binds port 0, so the OS hands out a free port and two runs never collide. Each rank's stdout and
stderr go to torchrun's --log-dir and come back in the DDPRun. After `timeout` s, an error or an
interrupt, torchrun and every worker are stopped: no process and no port outlives the call. A
DDPRunError names the rank that failed first (also one that crashed exiting, after its work).
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

__all__ = ["DDPRunError", "DDPTimeout", "DDPRun", "torchrun_command", "launch", "rel_diff", "reference_train",
           "training_state_bytes", "dp_vs_ddp", "format_timing_reference"]

WORKER = "course_lib.chapters.ddp_worker"
TOKEN_VAR = "AMP_COURSE_DDP_RUN"  # every process of one launch carries it: found and stopped by it
WIDTH = 100  # printed lines


class DDPRunError(RuntimeError):
    """Chapter 08: a torchrun launch failed; the message names the rank that failed first."""

    def __init__(self, message: str, run: DDPRun) -> None:
        super().__init__(message)
        self.run = run


class DDPTimeout(DDPRunError):
    """Chapter 08: a launch ran past its timeout and was stopped, every process of it."""


@dataclass
class DDPRun:
    """Chapter 08: what one torchrun launch left: the command, each rank's log and its output folder."""
    command: list[str]
    out: Path
    returncode: int | None = None
    seconds: float = 0.0
    logs: dict[int, dict[str, str]] = field(default_factory=dict)  # rank -> {"stdout": ..., "stderr": ...}
    launcher_log: str = ""

    @property
    def summary(self) -> dict:
        """What rank 0 wrote at the end (summary.json), {} if it did not get that far."""
        path = self.out / "summary.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def load(self, name: str) -> object:
        """A tensor file a rank wrote into the output folder (init.pt, params_rank1.pt, ...)."""
        return torch.load(self.out / name, map_location="cpu", weights_only=True)

    def port(self) -> int | None:
        """The rendezvous store's port, as rank 0 reported it."""
        m = re.search(r"store [^\s:]+:(\d+)", self.logs.get(0, {}).get("stdout", ""))
        return int(m.group(1)) if m else None

    def pids(self) -> list[int]:
        """The worker processes' ids, as each rank reported them."""
        return [int(p) for log in self.logs.values() for p in re.findall(r", pid (\d+),", log["stdout"])]

    def leftovers(self) -> list[int]:
        """The worker processes of this run that are still alive (after launch() returns: none)."""
        alive = []
        for pid in self.pids():
            try:
                os.kill(pid, 0)  # signal 0: only asks whether the process exists
                alive.append(pid)
            except OSError:  # gone (or its number reused by someone else's process)
                pass
        return alive

    def port_free(self) -> bool:
        """Can a new server listen on the rendezvous store's port again?"""
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # ignore closed connections' TIME_WAIT
            try:
                s.bind(("", self.port()))
                s.listen()
            except OSError:
                return False
        return True

    def show(self, ranks: Sequence[int] | None = None, stderr: bool = True, max_lines: int = 40,
             tail: bool = False) -> None:
        """Chapter 08: print each rank's log (stdout, then stderr if any), lines cut at 100 characters.

        Longer logs show their first and last max_lines // 2 lines, or with tail=True their last max_lines."""
        print(textwrap.fill("$ " + " ".join(self.command), WIDTH, subsequent_indent="      ",
                            break_on_hyphens=False))
        for rank in ranks if ranks is not None else sorted(self.logs):
            for stream in ("stdout", "stderr") if stderr else ("stdout",):
                lines = self.logs.get(rank, {}).get(stream, "").splitlines()
                if not lines:
                    continue
                print(f"--- rank {rank} {stream} ({len(lines)} lines) ---")
                cut = len(lines) > max_lines
                shown = lines if not cut else ["[...]"] + lines[-max_lines:] if tail else \
                    lines[: max_lines // 2] + ["[...]"] + lines[-max_lines // 2:]
                for line in shown:
                    print(line if len(line) <= WIDTH else line[: WIDTH - 1] + "…")


def torchrun_command(nproc: int | str = 2, *, nnodes: int = 1, rdzv_endpoint: str | None = None,
                     rdzv_id: str | None = None, log_dir: str | Path | None = None) -> list[str]:
    """Chapter 08: the torchrun part of a command line, for one machine or for each of `nnodes`.

    One machine: --standalone (rendezvous on localhost, a free port picked by the OS). Many
    machines: run the same command on every node with --nnodes, a shared --rdzv-id and the
    --rdzv-endpoint host:port of one node that all can reach (c10d rendezvous, torchrun's docs).
    `python -m torch.distributed.run` is torchrun without depending on the script being on PATH.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd += ["--standalone", "--nnodes", "1"]
    else:
        if not (rdzv_endpoint and rdzv_id):
            raise ValueError("several nodes need rdzv_endpoint='host:port' and a shared rdzv_id")
        cmd += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                "--rdzv-id", rdzv_id]
    cmd += ["--nproc-per-node", str(nproc)]
    if log_dir is not None:
        cmd += ["--log-dir", str(log_dir), "--redirects", "3"]  # 3: stdout and stderr of every rank to files
    return cmd


def _environment(nproc: int, token: str) -> dict[str, str]:
    env = {**os.environ, TOKEN_VAR: token, "PYTHONUNBUFFERED": "1"}
    # torchrun sets OMP_NUM_THREADS=1 (with a banner) unless told: share the cores instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    loopback = next((name for _, name in socket.if_nameindex() if name in ("lo", "lo0")), None) \
        if hasattr(socket, "if_nameindex") else None
    if loopback and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = loopback  # one machine: gloo talks over loopback, whatever the hostname says
    return env


def _pids_with_token(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if f"{TOKEN_VAR}={token}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _stop(proc: subprocess.Popen, token: str, grace: float = 10.0) -> None:
    """torchrun turns SIGTERM into stopping its workers; whatever is still alive afterwards is killed."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
    _reap(token)


def _reap(token: str) -> None:
    for pid in _pids_with_token(token):  # workers run in sessions of their own: find them by token
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 10
    while _pids_with_token(token) and time.monotonic() < deadline:
        time.sleep(0.05)


def _read_logs(log_dir: Path) -> dict[int, dict[str, str]]:
    logs: dict[int, dict[str, str]] = {}
    for path in sorted(p for p in log_dir.glob("**/attempt_*/*/std*.log") if p.parent.name.isdigit()):
        text = path.read_text("utf-8", "replace")
        logs.setdefault(int(path.parent.name), {"stdout": "", "stderr": ""})[path.stem] = text
    return logs


def _first_failure(run: DDPRun) -> str:
    """'rank 1 failed: RuntimeError: ...': the earliest failure a rank recorded, else what torchrun reports."""
    records = []
    for path in run.out.glob("failed_rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if records:
        first = min(records, key=lambda r: r["time"])
        others = sorted(r["rank"] for r in records if r is not first)
        after = f" (then rank{'s' * (len(others) > 1)} {', '.join(map(str, others))}, because it left)" * bool(others)
        return f"rank {first['rank']} failed first: {' '.join(first['error'].split())[:300]}{after}"
    codes = {int(r): int(c) for r, c in
             re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s+exitcode\s*:\s*(-?\d+)", run.launcher_log)}
    if codes:
        root = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", run.launcher_log, re.S)  # torchrun: earliest failure
        first = int(root.group(1)) if root and int(root.group(1)) in codes else next(iter(codes))
        lines = [_exit_line(run, r, codes[r], first) for r in [first, *sorted(set(codes) - {first})]]
        if "] done" in run.logs.get(first, {}).get("stdout", ""):
            done = f"its work was done (every rank's: {run.out} holds all the outputs)" if all(
                "] done" in log["stdout"] for log in run.logs.values()) else "its work was done"
            lines.append(f"{done}; what failed is the process's shutdown: run the launch again; if it recurs, "
                         "`python tools/stress_ddp.py --runs 20` shows how often, err.run.show(tail=True) the logs")
        return "; ".join(lines)
    tail = " | ".join(run.launcher_log.strip().splitlines()[-3:])
    return f"torchrun exited with code {run.returncode}: {tail[:300]}"


def _exit_line(run: DDPRun, rank: int, code: int, first: int) -> str:
    """'rank 0 finished its work but crashed while exiting: exit code -6 (signal 6, SIGABRT), ...'"""
    name = signal.Signals(-code).name if -code in signal.valid_signals() else "?"
    how, log = f"code {code}" + f" (signal {-code}, {name})" * (code < 0), run.logs.get(rank, {})
    if code == -signal.SIGTERM and rank != first:  # torchrun stops the others when one rank fails
        return f"rank {rank} was then stopped by torchrun (exit {how})"
    if "] done" not in log.get("stdout", ""):
        return f"rank {rank} exited with {how}"
    head, fatal, dump = log.get("stderr", "").partition("Fatal Python error")  # faulthandler's dump comes after
    said = (head.strip().splitlines() or [(fatal + dump).split("\n")[0]])[-1][:80]
    return f"rank {rank} finished its work but crashed while exiting: exit {how}" + f", last said {said!r}" * bool(said)


def launch(args: Sequence[str] = (), nproc: int = 2, *, script: str | Path | None = None, module: str = WORKER,
           timeout: float = 180.0, out: str | Path | None = None) -> DDPRun:
    """Chapter 08: run `script` (or `module`) in `nproc` processes under torchrun on this machine.

    The program gets the output folder as its first argument, then `args`. Returns the DDPRun
    when every rank exited cleanly; raises DDPRunError naming the rank that failed first, or
    DDPTimeout after `timeout` seconds. Either way (and on Ctrl-C) no process of the run is left.
    """
    out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="ddp-run-"))
    out.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    target = [str(script)] if script is not None else ["-m", module]
    cmd = torchrun_command(nproc, log_dir=out / "logs") + target + [str(out), *map(str, args)]
    run = DDPRun(cmd, out)
    t0 = time.monotonic()
    with open(out / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=out,
                                env=_environment(nproc, token), start_new_session=True)
        try:
            run.returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc, token)
        except BaseException:  # KeyboardInterrupt (Jupyter's stop button), a grader's time limit
            _stop(proc, token)
            raise
        finally:
            _reap(token)  # normally nothing is left; this makes sure of it
    run.seconds = time.monotonic() - t0
    run.logs, run.launcher_log = _read_logs(out / "logs"), (out / "torchrun.log").read_text(errors="replace")
    if run.returncode is None:
        last = {r: (run.logs.get(r, {}).get("stdout", "").strip().splitlines() or ["(nothing)"])[-1][:80]
                for r in range(nproc)}
        waiting = [r for r in range(nproc) if "] done" not in last[r]]
        raise DDPTimeout(f"no result after {timeout:g} s, so every process of the run was stopped; unfinished: "
                         + "; ".join(f"rank {r}, last printed {last[r]!r}" for r in waiting), run)
    if run.returncode != 0:
        raise DDPRunError(_first_failure(run), run)
    return run


# --------------------------------------------------------------------------- checking a run

def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict | None = None) -> float:
    """Chapter 08: how far apart two sets of tensors are: max|a - b| over all of them, divided by max|b|
    or, given `start`, by max|b - start| (how far training moved them). 0.0: identical."""
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


def _global_batches(n: int, world_size: int, batch_size: int, epochs: int, seed: int, set_epoch: bool,
                    accum_steps: int = 1) -> list[list[int]]:
    """The samples of each optimizer step of a DDP run, all ranks together, in DistributedSampler's order."""
    orders = sampler_orders(n, world_size, epochs, seed, set_epoch)
    micro = [[order[i:i + batch_size] for i in range(0, len(order), batch_size)] for order in orders[0]]
    steps = []
    for epoch in range(epochs):
        n_micro = (len(micro[epoch]) // accum_steps) * accum_steps  # a last partial group is dropped
        for start in range(0, n_micro, accum_steps):
            steps.append([i for rank in range(world_size) for m in range(start, start + accum_steps)
                          for i in orders[rank][epoch][m * batch_size:(m + 1) * batch_size]])
    return steps


def reference_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, world_size: int, batch_size: int,
                    epochs: int, lr: float, seed: int, accum_steps: int = 1, momentum: float = 0.9,
                    amp_dtype: torch.dtype | None = None, set_epoch: bool = True) -> tuple[nn.Module, list[float]]:
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
    tensors = {"parameters": list(model.parameters()),
               "gradients": [p.grad for p in model.parameters() if p.grad is not None],
               "optimizer state": [v for s in optimizer.state.values() for v in s.values()
                                   if isinstance(v, torch.Tensor) and v.dim() > 0]}
    return {k: sum(t.numel() * t.element_size() for t in ts) for k, ts in tensors.items()}


# --------------------------------------------------------------------------- GPU reference: DP vs DDP

def dp_vs_ddp(width: int = 4096, batch: int = 256, steps: int = 30) -> list[dict]:
    """Chapter 08: step time on 1 GPU, DataParallel over all GPUs, DDP over all GPUs (same batch per GPU)."""
    from ..device import recommend_precision
    from ..timing import time_fn
    from ..train import AMP_DTYPES
    from .ddp_worker import AutocastForward, _bench_model, _bench_step
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
        t = time_fn(functools.partial(_bench_step, net, opt, scaler, x, y, dtype), warmup=5, iters=steps, device="cuda")
        rows.append({"mode": mode, "gpus": n, "median_ms": t.median_ms, "q1_ms": t.quartiles_ms[0],
                     "q3_ms": t.quartiles_ms[1], "images_per_s": batch * n / t.median_ms * 1e3})
        del model, net, opt
    run = launch(["--time-steps", steps, "--batch", batch, "--width", width], nproc=gpus, timeout=600)
    t = json.loads((run.out / "timing.json").read_text())
    rows.append({"mode": "DDP", "gpus": gpus, "median_ms": t["median_ms"], "q1_ms": t["q1_ms"], "q3_ms": t["q3_ms"],
                 "images_per_s": batch * gpus / t["median_ms"] * 1e3})
    return [{**r, "precision": prec, "width": width, "batch_per_gpu": batch} for r in rows]


def format_timing_reference(ref: dict) -> str:
    """Chapter 08: the recorded GPU results: the nccl run, and DataParallel vs DDP where 2+ GPUs were there."""
    out = []
    for nccl in ref.get("nccl_runs", []):
        agree = all(s == nccl["scales_by_rank"][0] for s in nccl["scales_by_rank"])
        scale = f"GradScaler on, final scale {nccl['scales_by_rank'][0][-1]:g} (same on all ranks: {agree})" \
            if nccl["scaler"] else "no GradScaler"
        out.append(f"nccl, {nccl['world_size']} rank(s), {nccl['precision']}: {scale}; {nccl['steps']} steps, "
                   f"last loss {nccl['losses'][-1]:.4f}")
    rows = ref.get("dp_vs_ddp") or []
    if rows:
        out.append(f"{'mode':<14}{'GPUs':>5}{'median ms':>11}{'middle half':>17}{'images/s':>11}")
        for r in rows:
            out.append(f"{r['mode']:<14}{r['gpus']:>5}{r['median_ms']:>11.2f}{r['q1_ms']:>9.2f}-{r['q3_ms']:<7.2f}"
                       f"{r['images_per_s']:>11,.0f}")
    elif ref.get("nccl_runs"):
        out.append("DataParallel vs DDP: not measured (that machine had one GPU; it needs two or more)")
    return "\n".join(out)


# --------------------------------------------------------------------------- command line

def _check_run(run: DDPRun) -> str:
    p0, p1 = run.load("params_rank0.pt"), run.load("params_rank1.pt")
    if not all(torch.equal(p0[k], p1[k]) for k in p0):
        raise AssertionError(f"ranks 0 and 1 ended with different parameters (rel diff {rel_diff(p0, p1):.2e})")
    return "ranks 0 and 1 hold identical parameters"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.chapters.distributed", description=__doc__.split("\n")[0])
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
        run = launch(extra, args.nproc, timeout=args.timeout)
        run.show()
        print(f"finished in {run.seconds:.1f} s; {_check_run(run)}; outputs in {run.out}")
        return 0
    from ..reference import record
    if not torch.cuda.is_available():
        print("record needs CUDA GPUs (nccl); on a CPU the notebook's own gloo run is the measurement")
        return 1
    keys = ("world_size", "backend", "precision", "scaler", "losses", "scales_by_rank", "steps", "seconds")
    runs = [launch(extra, torch.cuda.device_count(), timeout=600) for extra in ([], ["--precision", "fp16"])]
    payload = {"nccl_runs": [{k: run.summary[k] for k in keys} for run in runs], "dp_vs_ddp": []}
    if torch.cuda.device_count() >= 2:
        payload["dp_vs_ddp"] = dp_vs_ddp(args.width, args.batch)
    command = "python -m course_lib.chapters.distributed " + " ".join(argv if argv is not None else sys.argv[1:])
    record(command, format_timing_reference(payload), args.json, **payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
