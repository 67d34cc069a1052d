"""Chapter 12: two torchrun "nodes" on one machine, really launched: the rank program and its launch.

    result = launch_two_nodes()            # two torchrun agents, --nnodes 2, one c10d rendezvous on loopback
    print(format_two_nodes(result))        # each rank's node rank, global rank, world size, all-reduce

Chapter 08 printed the command a multi-node job runs on every node. Here it runs: chapter 08's
`launch(..., nproc=1, nnodes=2)` starts that command twice on this machine, once per "node", with
the rendezvous endpoint 127.0.0.1:<a free port>. The two agents meet there, the rendezvous hands
each its node rank (GROUP_RANK), and their workers form one process group of two ranks. Two
terminals run the same by hand, each with the same line (as launch_two_nodes's result shows it):

    python -m torch.distributed.run --nnodes 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        --rdzv-id job --nproc-per-node 1 -m course_lib.chapters.ch12.two_nodes /tmp/two-nodes

What this rehearses is the rendezvous and the numbering, not a network: both "nodes" share the
loopback interface, and real nodes need that port reachable between them (chapter 08 §10).
Each rank prints one line, all-reduces rank + 1 (the sum over a world of n is n(n + 1) / 2, which
no rank reaches alone), writes OUT/rank<r>.json and destroys its process group before it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.chapters.ch08.ddp_launch import DDPRun, launch
from course_lib.tables import table

__all__ = ["launch_two_nodes", "format_two_nodes"]

PROGRAM = "course_lib.chapters.ch12.two_nodes"
COURSE = Path(__file__).resolve().parents[3]
RUNS = COURSE / "runs" / "12_sharding"  # git-ignored, like chapter 08's runs/08_distributed
WIDTH = 100  # printed lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m torch.distributed.run --nnodes 2 ... -m {PROGRAM}")
    p.add_argument("out", type=Path, help="folder where every rank writes rank<r>.json")
    p.add_argument("--sleep-rank", type=int, default=-1, help="this rank sleeps before the all-reduce (tests)")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds it sleeps")
    p.add_argument("--pg-timeout", type=float, default=60, help="seconds a collective may wait for the others")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """One rank: what torchrun's agent told it, one all-reduce across the nodes, its JSON, a clean exit."""
    args = parse_args(argv)
    # torchrun's agent sets these; GROUP_RANK is the node rank the rendezvous gave this rank's agent
    node, nodes = int(os.environ["GROUP_RANK"]), int(os.environ["GROUP_WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    store = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"  # the store init_process_group joins
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        print(
            f"[rank {rank}] node {node} of {nodes}, local rank {local_rank}, world {world}, pid {os.getpid()}, "
            f"store {store}",
            flush=True,
        )
        if rank == args.sleep_rank:
            time.sleep(args.sleep)  # the others wait in the all-reduce meanwhile
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)  # SUM over every rank of both nodes
        print(f"[rank {rank}] all_reduce(rank + 1) = {total.item():g}", flush=True)
        record = {"rank": rank, "node": node, "nodes": nodes, "local_rank": local_rank, "world": world}
        record |= {"all_reduce": total.item(), "expected": world * (world + 1) / 2, "pid": os.getpid()}
        (args.out / f"rank{rank}.json").write_text(json.dumps(record))
        dist.barrier()  # nobody closes its connections while another still talks
        print(f"[rank {rank}] done", flush=True)
    finally:
        dist.destroy_process_group()  # also after an error: the group's connections and threads end


def _course_relative(text: str, out: Path) -> str:
    """A command line without this machine's absolute paths: the interpreter as `python`, the output folder
    relative to the course (or <out> outside it)."""
    where = str(out.relative_to(COURSE)) if out.is_relative_to(COURSE) else "<out>"
    return text.replace(sys.executable, "python").replace(str(out), where)


def launch_two_nodes(
    progress: bool = True, timeout: float = 120, out: str | Path | None = None, args: list[str] | None = None
) -> dict:
    """Chapter 12: two torchrun agents ("nodes", one rank each) launched and met at a c10d rendezvous.

    Runs this module's rank program through chapter 08's launch(nproc=1, nnodes=2) and returns plain
    data: per rank its node rank, global rank, world size and all-reduce result (and the expected sum),
    the two agents' command lines without this machine's paths, the rendezvous endpoint and the seconds
    the launch took. Outputs go to runs/12_sharding/two_nodes/ (emptied first) unless `out` says
    elsewhere; `args` go to the rank program. Raises chapter 08's DDPRunError or DDPTimeout as launch
    does, with every process of the launch stopped."""
    if out is None:
        out = RUNS / "two_nodes"
        shutil.rmtree(out, ignore_errors=True)  # an earlier launch's files would mislead this one
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    run = launch(args or [], nproc=1, nnodes=2, module=PROGRAM, out=out, timeout=timeout, progress=progress)
    return _result(run)


def _result(run: DDPRun) -> dict:
    """What launch_two_nodes returns, from a finished launch: the ranks' JSON files and the commands."""
    ranks = sorted((json.loads(p.read_text()) for p in run.out.glob("rank*.json")), key=lambda r: r["rank"])
    endpoint = run.command[run.command.index("--rdzv-endpoint") + 1]
    return {
        "ranks": ranks,
        "commands": [_course_relative(" ".join(command), run.out) for command in run.commands],
        "endpoint": endpoint,
        "seconds": round(run.seconds, 2),
        "logs": {rank: log["stdout"].splitlines() for rank, log in sorted(run.logs.items())},
    }


def format_two_nodes(result: dict) -> str:
    """Chapter 12: launch_two_nodes's result as text: the agents' commands, then one row per rank."""
    lines = [f"c10d rendezvous on {result['endpoint']}, {result['seconds']:.1f} s; the agents' commands:"]
    for k, command in enumerate(result["commands"]):
        lines += textwrap.wrap(
            command, WIDTH, initial_indent=f"agent {k}: ", subsequent_indent=" " * 9, break_on_hyphens=False
        )
    columns = [
        ("global rank", "rank", "d"),
        ("node rank (GROUP_RANK)", "node", "d"),
        ("local rank", "local_rank", "d"),
        ("world", "world", "d"),
        ("all_reduce(rank + 1)", "all_reduce", "g"),
        ("n(n + 1) / 2", "expected", "g"),
    ]
    lines.append(table(result["ranks"], columns))
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
