"""Is chapter 08's first DDP run reliable? N consecutive launches of it, with a core kept busy.

    .venv/bin/python tools/stress_ddp.py                 # 100 runs, one core busy: prints k/N, exit 1 on a failure
    .venv/bin/python tools/stress_ddp.py --runs 20 --busy 2 --core-dumps

Each run is `launch(ARGS)` with the arguments of the notebook's first launch (read from
notebooks/08_distributed.ipynb, so the two cannot drift apart), then the checks the notebook relies
on: both ranks end with identical parameters, no worker process is left, and no rank needed the
worker's fallback exit (process-group threads that outlived destroy_process_group). The intermittent
failure this guards against (a rank aborting at exit, after its work) showed up only when another core
was busy, so `--busy` child processes spin for the whole loop. Failed runs keep their folder (logs,
and with --core-dumps a `core` file from an aborting rank for gdb); passed ones are deleted.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing it

from course_lib.chapters.ch08.ddp_launch import DDPRunError, launch  # noqa: E402
from course_lib.chapters.ch08.distributed import _check_run  # noqa: E402

NOTEBOOK = ROOT / "notebooks" / "08_distributed.ipynb"
FALLBACK = "outlived destroy_process_group"  # what ddp_worker prints when it has to skip interpreter shutdown
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


def one_run(args: list[str], timeout: float, parent: Path) -> tuple[bool, str]:
    out = Path(tempfile.mkdtemp(prefix="run-", dir=parent))
    try:
        run = launch(args, out=out, timeout=timeout)
        verdict = _check_run(run)
        left, fallback = run.leftovers(), [r for r, log in run.logs.items() if FALLBACK in log["stderr"]]
        if left or fallback:
            return False, f"worker processes left {left}, ranks that needed the fallback exit {fallback}; {out}"
    except (DDPRunError, AssertionError, OSError) as e:
        return False, f"FAILED: {' '.join(str(e).split())[:400]} ({out})"
    shutil.rmtree(out, ignore_errors=True)
    return True, verdict


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--busy", type=int, default=1, help="processes that each keep one core busy meanwhile")
    p.add_argument("--timeout", type=float, default=300, help="seconds one launch may take")
    p.add_argument("--core-dumps", action="store_true", help="let an aborting rank leave a core file")
    p.add_argument("worker_args", nargs=argparse.REMAINDER, help="after --: instead of the notebook's arguments")
    opts = p.parse_args(argv)
    if opts.runs < 1:
        p.error("--runs must be at least 1")
    args = [a for a in opts.worker_args if a != "--"] or notebook_args()
    # Stopping this script must stop the launch under way (launch() cleans up on any exception): SIGTERM raises
    # here, and SIGINT too even where a shell started us in the background with SIGINT ignored.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if opts.core_dumps:  # inherited by torchrun and the ranks; the core lands in the rank's cwd, the run's folder
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    parent = Path(tempfile.mkdtemp(prefix="stress-ddp-"))
    print(
        f"{opts.runs} launches of {args} with {opts.busy} core(s) kept busy; failed runs stay in {parent}", flush=True
    )
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(opts.busy)]
    times, failures, t_all = [], [], time.monotonic()
    try:
        for i in range(1, opts.runs + 1):
            t0 = time.monotonic()
            ok, verdict = one_run(args, opts.timeout, parent)
            times.append(time.monotonic() - t0)
            if not ok:
                failures.append(i)
            print(f"run {i:>3}/{opts.runs}: {times[-1]:5.1f} s  {verdict}", flush=True)
    finally:
        for proc in busy:  # ours only, by the handle we started them with
            proc.kill()
            proc.wait()
    ok = opts.runs - len(failures)
    if not failures:
        shutil.rmtree(parent, ignore_errors=True)
    print(
        f"{ok}/{opts.runs} runs succeeded in {(time.monotonic() - t_all) / 60:.1f} min (per run: median "
        f"{statistics.median(times):.1f} s, min {min(times):.1f}, max {max(times):.1f})"
        + (f"; failed: {failures}" if failures else "")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
