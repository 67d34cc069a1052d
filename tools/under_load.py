"""Do the timing tests pass on a busy machine? `pytest -m timing` run while every CPU core is kept busy.

    .venv/bin/python tools/under_load.py                          # every `timing` test in tests/, all cores busy
    .venv/bin/python tools/under_load.py tests/test_roofline.py   # only these paths
    .venv/bin/python tools/under_load.py --busy 1 -- -x -q        # one core busy; after --: more pytest options

COURSE_SPEC.md section 7: no test's verdict may depend on the machine's load. The tests that read a clock
carry the `timing` marker (pyproject.toml); this script starts one busy-looping process per core (pure
Python spinning, which keeps a core at 100% with no threads and no memory traffic of its own), runs
`python -m pytest -m timing <paths> -p no:cacheprovider` under that load, and exits with pytest's exit
code. Whatever ends the run (pytest finishing, Ctrl-C, SIGTERM), it stops pytest and every busy process.

If this script is killed outright (SIGKILL, where no cleanup can run), the busy processes notice within a
fraction of a second that their parent is gone and exit, and pytest is sent SIGINT by the system (Linux's
parent-death signal), so nothing is left spinning.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# One core's worth of busy work that ends with this script, however this script ends (even by SIGKILL):
# the loop checks its parent only every few million iterations, so it spends its time spinning. Ctrl-C in
# the terminal reaches it too; it leaves stopping to this script, which kills it by its handle.
BUSY = (
    "import os, signal\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "parent = os.getppid()\n"
    "while os.getppid() == parent:\n"
    "    for _ in range(2_000_000):\n"
    "        pass\n"
)


def cores() -> int:
    """The cores this process may run on (its affinity mask where the system has one), else the CPU count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def start_busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BUSY], stdin=subprocess.DEVNULL) for _ in range(n)]


def stop_busy(busy: list[subprocess.Popen]) -> None:
    for proc in busy:  # ours only, by the handles we started them with
        if proc.poll() is None:
            proc.kill()
    for proc in busy:
        proc.wait()


def interrupted_with_parent() -> None:
    """In pytest's process, before it starts (Linux): SIGINT when this script dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl here: SIGKILL of this script leaves pytest to finish alone
        pass


def stop_pytest(proc: subprocess.Popen) -> None:
    """SIGINT first (pytest then stops as on Ctrl-C, tearing its fixtures down), SIGKILL to its whole session
    after 60 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its session's group: pytest and whatever it left running
    except ProcessLookupError:
        pass
    proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="*", default=["tests"], help="test files or folders (default: tests)")
    p.add_argument("--busy", type=int, default=cores(), help="busy processes to start (default: one per core)")
    p.add_argument("--marker", default="timing", help="pytest -m expression (default: timing)")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    opts, extra = p.parse_args(argv[:cut]), argv[cut + 1 :]  # after --: further pytest options
    # Stopping this script stops everything it started: SIGTERM raises SystemExit here and Ctrl-C raises
    # KeyboardInterrupt (even where a shell started us with SIGINT ignored), and either way pytest, which runs
    # in a session of its own, is asked to stop as Ctrl-C asks it (its fixtures and the course's launchers
    # clean up after themselves), then killed with anything of its session left; the busy processes last.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cmd = [sys.executable, "-m", "pytest", "-m", opts.marker, *opts.paths, "-p", "no:cacheprovider", *extra]
    print(f"{opts.busy} busy process(es) on {cores()} core(s); running: {' '.join(cmd)}", flush=True)
    busy = start_busy(opts.busy)
    t0 = time.monotonic()
    pytest = None
    try:
        time.sleep(1.0)  # the load is on before the first test starts
        pytest = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, preexec_fn=interrupted_with_parent)
        code = pytest.wait()
    finally:
        if pytest is not None and pytest.poll() is None:
            stop_pytest(pytest)
        stop_busy(busy)
    print(
        f"under_load: pytest exited with {code} after {time.monotonic() - t0:.0f} s with {opts.busy} core(s) kept busy",
        flush=True,
    )
    return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # pytest and the busy processes are stopped by now
        print("under_load: interrupted", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
