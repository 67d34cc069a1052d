"""Is a torchrun launch reliable? N consecutive launches of it, with a core kept busy.

    .venv/bin/python tools/stress_ddp.py                 # chapter 08's first launch, 100 runs, one core busy
    .venv/bin/python tools/stress_ddp.py --runs 20 --busy 2 --core-dumps
    .venv/bin/python tools/stress_ddp.py --two-nodes --runs 50      # chapter 12: two torchrun agents, --nnodes 2
    .venv/bin/python tools/stress_ddp.py --module course_lib.chapters.ch12.memory_worker --nproc 2 --args --steps 2

By default each run is `launch(ARGS)` with the arguments of chapter 08's first launch (read from
notebooks/08_distributed.ipynb, so the two cannot drift apart; `-- ARGS` replaces them), then the checks
the notebook relies on: both ranks end with identical parameters and no rank needed the worker's fallback
exit (process-group threads that outlived destroy_process_group). `--two-nodes` stresses chapter 12's
launch_two_nodes instead (both node ranks, the all-reduce's sum), and `--module M` any rank program under
`launch(ARGS, nproc=N, nnodes=K, module=M)`, which passes when every rank exits 0. After every run, no
process whose command line names the run's folder may be alive. The intermittent failure this guards
against (a rank aborting at exit, after its work) showed up only when another core was busy, so `--busy`
child processes spin for the whole loop. The summary counts hangs (the timeout stopped the run), aborts at
exit, other failures and processes left behind, and the time per launch. Failed runs keep their folder
(logs, and with --core-dumps a `core` file from an aborting rank for gdb); passed ones are deleted.
Exit status 1 when any run failed.
"""

from __future__ import annotations

import argparse
import ast
import json
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing it

from course_lib.chapters.ch08.ddp_launch import DDPRunError, DDPTimeout, launch  # noqa: E402
from course_lib.chapters.ch08.distributed import _check_run  # noqa: E402

NOTEBOOK = ROOT / "notebooks" / "08_distributed.ipynb"
FALLBACK = "outlived destroy_process_group"  # what ddp_worker prints when it has to skip interpreter shutdown
ABORTED = "crashed while exiting"  # how launch() names a rank that failed after its work was done
# One core's worth of busy work that ends with this script, however this script ends (even by SIGKILL).
BUSY = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass"


def notebook_args(path: Path = NOTEBOOK) -> list[str]:
    """The argument list of the first `launch([...])` call in the notebook's code cells."""
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        try:
            tree = ast.parse("".join(cell["source"]))
        except SyntaxError:  # a cell with IPython magics: not the one we look for
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "launch" and node.args:
                return [str(a) for a in ast.literal_eval(node.args[0])]
    raise LookupError(f"no launch([...]) call in {path}")


def left_behind(out: Path) -> list[int]:
    """Processes alive whose command line names the run's folder: torchrun agents and ranks all get it."""
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if entry.name.isdigit():
            try:
                if str(out).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def notebook_launch(args: list[str], timeout: float) -> Callable[[Path], str]:
    """Chapter 08's first launch and the notebook's checks of it."""

    def run(out: Path) -> str:
        done = launch(args, out=out, timeout=timeout)
        verdict = _check_run(done)
        fallback = [r for r, log in done.logs.items() if FALLBACK in log["stderr"]]
        if fallback:
            raise AssertionError(f"ranks that needed the fallback exit: {fallback}")
        return verdict

    return run


def two_nodes_launch(timeout: float) -> Callable[[Path], str]:
    """Chapter 12's two torchrun agents (--nnodes 2, c10d rendezvous on loopback), one rank each."""
    from course_lib.chapters.ch12.two_nodes import launch_two_nodes  # only this option needs chapter 12

    def run(out: Path) -> str:
        ranks = launch_two_nodes(progress=False, timeout=timeout, out=out)["ranks"]
        nodes, sums = sorted(r["node"] for r in ranks), {r["all_reduce"] for r in ranks}
        if nodes != [0, 1] or any(r["all_reduce"] != r["expected"] for r in ranks):
            raise AssertionError(f"node ranks {nodes}, all-reduce results {sorted(sums)}")
        return f"node ranks {nodes}, all_reduce {sums.pop():g} on both"

    return run


def module_launch(module: str, args: list[str], nproc: int, nnodes: int, timeout: float) -> Callable[[Path], str]:
    """Any rank program under launch(): it passes when every rank exits 0."""

    def run(out: Path) -> str:
        done = launch(args, nproc=nproc, nnodes=nnodes, module=module, out=out, timeout=timeout)
        return f"{len(done.logs)} ranks exited 0"

    return run


def one_run(launcher: Callable[[Path], str], parent: Path) -> tuple[str, str]:
    """(outcome, what to print): outcome is "ok", "hang", "abort", "failed" or "left"."""
    out = Path(tempfile.mkdtemp(prefix="run-", dir=parent))
    try:
        verdict = launcher(out)
    except DDPTimeout as e:
        outcome, verdict = "hang", f"HUNG: {' '.join(str(e).split())[:400]} ({out})"
    except DDPRunError as e:
        outcome = "abort" if ABORTED in str(e) else "failed"
        verdict = f"FAILED: {' '.join(str(e).split())[:400]} ({out})"
    except (AssertionError, OSError) as e:
        outcome, verdict = "failed", f"FAILED: {' '.join(str(e).split())[:400]} ({out})"
    else:
        outcome = "ok"
    left = left_behind(out)
    if left:
        return "left", f"processes left behind {left} ({verdict}); {out}"
    if outcome == "ok":
        shutil.rmtree(out, ignore_errors=True)
    return outcome, verdict


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--busy", type=int, default=1, help="processes that each keep one core busy meanwhile")
    p.add_argument("--timeout", type=float, default=300, help="seconds one launch may take")
    p.add_argument("--core-dumps", action="store_true", help="let an aborting rank leave a core file")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--two-nodes", action="store_true", help="chapter 12's launch_two_nodes instead")
    what.add_argument("--module", help="this rank program instead (e.g. course_lib.chapters.ch12.memory_worker)")
    p.add_argument("--nproc", type=int, default=2, help="with --module: processes per node")
    p.add_argument("--nnodes", type=int, default=1, help="with --module: torchrun agents ('nodes') on this machine")
    p.add_argument("--args", nargs=argparse.REMAINDER, default=[], help="last: the rank program's arguments")
    p.add_argument("worker_args", nargs=argparse.REMAINDER, help="after --: instead of the notebook's arguments")
    opts = p.parse_args(argv)
    if opts.runs < 1:
        p.error("--runs must be at least 1")
    args = [a for a in opts.args + opts.worker_args if a != "--"]
    if opts.two_nodes:
        launcher, what = two_nodes_launch(opts.timeout), "chapter 12's launch_two_nodes()"
    elif opts.module:
        launcher = module_launch(opts.module, args, opts.nproc, opts.nnodes, opts.timeout)
        what = f"{opts.module} {args} on {opts.nnodes} node(s) x {opts.nproc}"
    else:
        args = args or notebook_args()
        launcher, what = notebook_launch(args, opts.timeout), f"chapter 08's launch({args})"
    # Stopping this script must stop the launch under way (launch() cleans up on any exception): SIGTERM raises
    # here, and SIGINT too even where a shell started us in the background with SIGINT ignored.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if opts.core_dumps:  # inherited by torchrun and the ranks; the core lands in the rank's cwd, the run's folder
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    parent = Path(tempfile.mkdtemp(prefix="stress-ddp-"))
    print(
        f"{opts.runs} launches of {what} with {opts.busy} core(s) kept busy; failed runs stay in {parent}", flush=True
    )
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(opts.busy)]
    times, outcomes, t_all = [], [], time.monotonic()
    try:
        for i in range(1, opts.runs + 1):
            t0 = time.monotonic()
            outcome, verdict = one_run(launcher, parent)
            times.append(time.monotonic() - t0)
            outcomes.append(outcome)
            print(f"run {i:>3}/{opts.runs}: {times[-1]:5.1f} s  {verdict}", flush=True)
    finally:
        for proc in busy:  # ours only, by the handle we started them with
            proc.kill()
            proc.wait()
    failures = [i for i, outcome in enumerate(outcomes, 1) if outcome != "ok"]
    if not failures:
        shutil.rmtree(parent, ignore_errors=True)
    counts = {kind: outcomes.count(kind) for kind in ("hang", "abort", "failed", "left")}
    print(
        f"{opts.runs - len(failures)}/{opts.runs} runs succeeded in {(time.monotonic() - t_all) / 60:.1f} min "
        f"(per run: median {statistics.median(times):.1f} s, min {min(times):.1f}, max {max(times):.1f}); "
        f"hangs {counts['hang']}, aborts at exit {counts['abort']}, other failures {counts['failed']}, "
        f"runs with processes left behind {counts['left']}" + (f"; failed: {failures}" if failures else "")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
