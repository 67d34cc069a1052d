"""Chapter 08: torchrun started from a notebook or a shell, and every process it started stopped again.

    run = launch(["--epochs", "2"], name="two_epochs", progress=True)  # runs/08_distributed/two_epochs/
    run.show()                              # each rank's log
    torchrun_command(8, nnodes=2, rdzv_endpoint="node0:29400", rdzv_id="job")   # the command for each node

launch() runs torchrun (`python -m torch.distributed.run --standalone`): its rendezvous store
binds port 0, so the OS hands out a free port and two runs never collide. Each rank's stdout and
stderr go to torchrun's --log-dir and come back in the DDPRun. After `timeout` s, an error or an
interrupt, torchrun and every worker are stopped: no process and no port outlives the call. A
DDPRunError names the rank that failed first (also one that crashed exiting, after its work).
Without `out`, a run's files go to runs/08_distributed/<name>/ in the course (git-ignored, emptied
at the start of each launch of that name), never to the system's temporary folder.
With nnodes > 1 (launch(..., nnodes=2)), a multi-node job on this machine: one torchrun agent per node,
the same command but for its log folder logs/node<k>/ (with its torchrun.log); a c10d rendezvous numbers them.
Each rank runs course_lib.chapters.ch08.ddp_worker; course_lib.chapters.ch08.distributed checks what a run computed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

__all__ = ["DDPRunError", "DDPTimeout", "DDPRun", "torchrun_command", "launch"]

WORKER = "course_lib.chapters.ch08.ddp_worker"
TOKEN_VAR = "AMP_COURSE_DDP_RUN"  # every process of one launch carries it: found and stopped by it
WIDTH = 100  # printed lines
PORT_TAKEN = ("address already in use", "RendezvousConnectionError")  # an agent found another program on the port
RUNS = Path(__file__).resolve().parents[3] / "runs" / "08_distributed"  # git-ignored: /runs/ in .gitignore


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
    logs: dict[int, dict[str, str]] = field(default_factory=dict)  # global rank -> {"stdout": ..., "stderr": ...}
    launcher_log: str = ""  # several nodes: every agent's torchrun.log, one after the other
    commands: list[list[str]] = field(default_factory=list)  # one per torchrun agent (node); [] means [command]

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

    def show(
        self, ranks: Sequence[int] | None = None, stderr: bool = True, max_lines: int = 40, tail: bool = False
    ) -> None:
        """Chapter 08: print each rank's log (stdout, then stderr if any), lines cut at 100 characters.

        Longer logs show their first and last max_lines // 2 lines, or with tail=True their last max_lines."""
        for command in self.commands or [self.command]:
            print(textwrap.fill("$ " + " ".join(command), WIDTH, subsequent_indent="      ", break_on_hyphens=False))
        for rank in ranks if ranks is not None else sorted(self.logs):
            for stream in ("stdout", "stderr") if stderr else ("stdout",):
                lines = self.logs.get(rank, {}).get(stream, "").splitlines()
                if not lines:
                    continue
                print(f"--- rank {rank} {stream} ({len(lines)} lines) ---")
                cut = len(lines) > max_lines
                if not cut:
                    shown = lines
                elif tail:
                    shown = ["[...]"] + lines[-max_lines:]
                else:  # the start and the end
                    shown = lines[: max_lines // 2] + ["[...]"] + lines[-max_lines // 2 :]
                for line in shown:
                    print(line if len(line) <= WIDTH else line[: WIDTH - 1] + "…")


def torchrun_command(
    nproc: int | str = 2,
    *,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    log_dir: str | Path | None = None,
) -> list[str]:
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
        cmd += [
            "--nnodes",
            str(nnodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            rdzv_endpoint,
            "--rdzv-id",
            rdzv_id,
        ]
    cmd += ["--nproc-per-node", str(nproc)]
    if log_dir is not None:
        cmd += ["--log-dir", str(log_dir), "--redirects", "3"]  # 3: stdout and stderr of every rank to files
    return cmd


def _environment(nproc: int, token: str, rendezvous_log: bool = False) -> dict[str, str]:
    env = {**os.environ, TOKEN_VAR: token, "PYTHONUNBUFFERED": "1"}
    if rendezvous_log:  # the agent logs at INFO, its rendezvous' result too: the global ranks its workers got
        env["LOGLEVEL"] = "INFO"
    # torchrun sets OMP_NUM_THREADS=1 (with a banner) unless told: share the cores instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    loopback = (
        next((name for _, name in socket.if_nameindex() if name in ("lo", "lo0")), None)
        if hasattr(socket, "if_nameindex")
        else None
    )
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


def _stop(procs: list[subprocess.Popen], token: str, grace: float = 10.0) -> None:
    """torchrun turns SIGTERM into stopping its workers; whatever is still alive afterwards is killed."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        running = [proc for proc in procs if proc.poll() is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # gone meanwhile
                os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
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


def _read_logs(log_dir: Path, ranks: dict[int, int] | None = None) -> dict[int, dict[str, str]]:
    """Each rank's logs; torchrun files them by local rank, `ranks` maps those to global ranks (one node of many)."""
    logs: dict[int, dict[str, str]] = {}
    for path in sorted(p for p in log_dir.glob("**/attempt_*/*/std*.log") if p.parent.name.isdigit()):
        text = path.read_text("utf-8", "replace")
        rank = int(path.parent.name) if ranks is None else ranks[int(path.parent.name)]
        logs.setdefault(rank, {"stdout": "", "stderr": ""})[path.stem] = text
    return logs


def _read_node_logs(node_dirs: list[Path], nproc: int) -> dict[int, dict[str, str]]:
    """Every node's ranks' logs by global rank, as each agent's torchrun.log says the rendezvous numbered them:
    a node's rank need not be the order the agents were started in. (k * nproc + local if an agent did not say.)"""
    logs = {}
    for k, folder in enumerate(node_dirs):
        said = (folder / "torchrun.log").read_text(errors="replace") if (folder / "torchrun.log").exists() else ""
        ranks = {r: k * nproc + r for r in range(nproc)}
        for local, rank in re.findall(r"local_ranks=\[([\d, ]*)\].*?global_ranks=\[([\d, ]*)\]", said, re.S):
            ranks = dict(zip(map(int, re.findall(r"\d+", local)), map(int, re.findall(r"\d+", rank))))
        logs.update(_read_logs(folder, ranks))
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
    codes = {
        int(r): int(c)
        for r, c in re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s+exitcode\s*:\s*(-?\d+)", run.launcher_log)
    }
    if codes:
        root = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", run.launcher_log, re.S)  # torchrun: earliest failure
        first = int(root.group(1)) if root and int(root.group(1)) in codes else next(iter(codes))
        lines = [_exit_line(run, r, codes[r], first) for r in [first, *sorted(set(codes) - {first})]]
        if "] done" in run.logs.get(first, {}).get("stdout", ""):
            done = (
                f"its work was done (every rank's: {run.out} holds all the outputs)"
                if all("] done" in log["stdout"] for log in run.logs.values())
                else "its work was done"
            )
            lines.append(
                f"{done}; what failed is the process's shutdown: run the launch again; if it recurs, "
                "`python tools/stress_ddp.py --runs 20` shows how often, err.run.show(tail=True) the logs"
            )
        return "; ".join(lines)
    tail = " | ".join(run.launcher_log.strip().splitlines()[-3:])
    return f"torchrun exited with code {run.returncode}: {tail[:300]}"


def _exit_line(run: DDPRun, rank: int, code: int, first: int) -> str:
    """'rank 0 finished its work but crashed while exiting: exit code -6 (signal 6, SIGABRT), ...'"""
    name = signal.Signals(-code).name if -code in signal.valid_signals() else "?"
    how = f"code {code}"
    if code < 0:
        how += f" (signal {-code}, {name})"
    log = run.logs.get(rank, {})
    if code == -signal.SIGTERM and rank != first:  # torchrun stops the others when one rank fails
        return f"rank {rank} was then stopped by torchrun (exit {how})"
    if "] done" not in log.get("stdout", ""):
        return f"rank {rank} exited with {how}"
    head, fatal, dump = log.get("stderr", "").partition("Fatal Python error")  # faulthandler's dump comes after
    said = (head.strip().splitlines() or [(fatal + dump).split("\n")[0]])[-1][:80]
    return f"rank {rank} finished its work but crashed while exiting: exit {how}" + f", last said {said!r}" * bool(said)


def _free_port() -> int:
    """A port nobody listens on now, for the c10d rendezvous: bound with port 0, the OS picks it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agents(
    commands: list[list[str]], logs: list[Path], out: Path, env: dict[str, str], deadline: float, read_logs, say
) -> int | None:
    """Start one torchrun agent per command, each writing its file of `logs`, and wait for them (`_wait`).
    On a failure, the deadline or an interrupt every process of the launch is stopped, the agents first."""
    token, procs = env[TOKEN_VAR], []
    spawn = {"stdin": subprocess.DEVNULL, "cwd": out, "env": env, "start_new_session": True}
    try:
        for command, path in zip(commands, logs):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as log:  # the agent writes into its own copy of the file handle
                procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, **spawn))
        code = _wait(procs, deadline, read_logs, say)
        if code != 0:  # None: the deadline; else one agent failed and the others may wait for it
            _stop(procs, token)
        return code
    except BaseException:  # KeyboardInterrupt (Jupyter's stop button), a grader's time limit
        _stop(procs, token)
        raise
    finally:
        _reap(token)  # normally nothing is left; this makes sure of it


def run_folder(name: str) -> Path:
    """runs/08_distributed/<name>/ in the course, emptied: where a launch without `out` writes."""
    if not re.fullmatch(r"[\w.-]+", name) or name.strip(".") == "":
        raise ValueError(f"a run's name is one folder name (letters, digits, _ . -), not {name!r}")
    folder = RUNS / name
    if folder.is_dir():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def _wait(procs: list[subprocess.Popen], deadline: float, read_logs: Callable[[], dict], say) -> int | None:
    """0 once every agent exited cleanly, the first failing one's exit code as soon as one fails, or None at the
    deadline; meanwhile say() rank 0's newest log line, at most one a second: a launch shows where it is."""
    shown, t0 = "", time.monotonic()
    last = t0
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [code for code in codes if code not in (None, 0)]
        if failed or None not in codes:
            return failed[0] if failed else 0
        if time.monotonic() >= deadline:
            return None
        time.sleep(max(0.0, min(0.25, deadline - time.monotonic())))
        if time.monotonic() - last >= 1.0:
            lines = read_logs().get(0, {}).get("stdout", "").splitlines()
            if lines and lines[-1] != shown:
                shown, last = lines[-1], time.monotonic()
                say(f"{last - t0:5.1f} s  {shown}")


def launch(
    args: Sequence[str] = (),
    nproc: int = 2,
    *,
    script: str | Path | None = None,
    module: str = WORKER,
    timeout: float = 180.0,
    out: str | Path | None = None,
    name: str = "run",
    progress: bool = False,
    nnodes: int = 1,
) -> DDPRun:
    """Chapter 08: run `script` (or `module`) in `nproc` processes under torchrun on this machine.

    The program gets the output folder as its first argument, then `args`: `out`, or else
    runs/08_distributed/<name>/ in the course, emptied first. Returns the DDPRun when every rank
    exited cleanly; raises DDPRunError naming the rank that failed first, or DDPTimeout after
    `timeout` seconds. Either way (and on Ctrl-C) no process of the run is left. progress=True
    prints a line as the run starts, rank 0's newest line about once a second, and one at the end.
    nnodes > 1 (chapter 12) starts one torchrun agent per "node", `nproc` processes each, which meet
    at a c10d rendezvous on 127.0.0.1; the run's logs are keyed by global rank, its `commands` are the
    agents' command lines, and when one agent fails the others are stopped.
    """
    out = Path(out) if out is not None else run_folder(name)
    out.mkdir(parents=True, exist_ok=True)

    def say(text: str) -> None:
        if progress:
            line = "   " + text
            print(line if len(line) <= WIDTH else line[: WIDTH - 1] + "…", flush=True)

    token = secrets.token_hex(8)
    target = [str(script)] if script is not None else ["-m", module]
    program = target + [str(out), *map(str, args)]
    where = out.relative_to(RUNS.parents[1]) if out.is_relative_to(RUNS.parents[1]) else out
    t0 = time.monotonic()
    if progress:
        who = f"{nproc} processes" if nnodes == 1 else f"{nnodes} nodes x {nproc} rank{'s' * (nproc > 1)}"
        print(f"torchrun: {who}, outputs in {where}/ (each rank imports torch first)", flush=True)
    if nnodes == 1:
        run = DDPRun(torchrun_command(nproc, log_dir=out / "logs") + program, out)
        launcher_logs, read_logs = [out / "torchrun.log"], lambda: _read_logs(out / "logs")
        env = _environment(nproc, token)
        run.returncode = _agents([run.command], launcher_logs, out, env, t0 + timeout, read_logs, say)
    else:
        node_dirs = [out / "logs" / f"node{k}" for k in range(nnodes)]
        launcher_logs, read_logs = [d / "torchrun.log" for d in node_dirs], lambda: _read_node_logs(node_dirs, nproc)
        for _attempt in range(2):  # a second one if someone took the port before the agents did
            shutil.rmtree(out / "logs", ignore_errors=True)  # the first attempt's
            endpoint = f"127.0.0.1:{_free_port()}"
            commands = [  # the same command on every node but for its log folder: the rendezvous numbers the nodes
                torchrun_command(nproc, nnodes=nnodes, rdzv_endpoint=endpoint, rdzv_id=token, log_dir=d) + program
                for d in node_dirs
            ]
            run = DDPRun(commands[0], out, commands=commands)
            say(f"{nnodes} torchrun agents meet at a c10d rendezvous on {endpoint}")
            env = _environment(nproc * nnodes, token, rendezvous_log=True)
            run.returncode = _agents(commands, launcher_logs, out, env, t0 + timeout, read_logs, say)
            said = " ".join(p.read_text(errors="replace") for p in launcher_logs if p.exists())
            if run.returncode in (0, None) or not any(m in said for m in PORT_TAKEN):
                break
    run.seconds = time.monotonic() - t0
    run.logs = read_logs()
    run.launcher_log = "".join(p.read_text(errors="replace") for p in launcher_logs if p.exists())
    if run.returncode == 0:
        ending = "every rank finished"
    elif run.returncode is not None:
        ending = f"torchrun exited with code {run.returncode}"
    else:
        ending = f"no result after {timeout:g} s: every process stopped"
    say(f"{run.seconds:5.1f} s  " + ending)
    if run.returncode is None:
        last = {
            r: (run.logs.get(r, {}).get("stdout", "").strip().splitlines() or ["(nothing)"])[-1][:80]
            for r in range(nproc * nnodes)
        }
        waiting = [r for r in range(nproc * nnodes) if "] done" not in last[r]]
        raise DDPTimeout(
            f"no result after {timeout:g} s, so every process of the run was stopped; unfinished: "
            + "; ".join(f"rank {r}, last printed {last[r]!r}" for r in waiting),
            run,
        )
    if run.returncode != 0:
        raise DDPRunError(_first_failure(run), run)
    return run
