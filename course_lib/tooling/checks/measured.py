"""What the checks that measure share (07.loader_settings, 09.speed_up): where they measure, what they
say while they do, and the fresh Python process they measure in.

Both judge settings by running them: a loader (chapter 07) or a training script (chapter 09), timed on
the machine the judge runs on. Inline (check() in the learner's notebook) that machine is the learner's
own: the messages say "this machine" and the judge prints a line per phase and per measured run as it
goes (`say`), the numbers its verdict is made of. In the batch grader they say "the grader's machine"
and print nothing: the grader's output is its gradebook. The measurement itself runs in a fresh process
(`in_fresh_process_reporting`), which reports each run as it ends on a line of its own (`reporting`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

from ..checkbase import CheckFailure

__all__ = ["PROGRESS", "inline", "machine", "say", "in_fresh_process_reporting", "reporting"]

PROGRESS = "progress: "  # the measuring process reports each run on a line that starts so (JSON after it)


def inline() -> bool:
    """True where the judge runs in the learner's own kernel (check() in a notebook), False in the batch
    grader, which judges in its own process (course_lib.tooling.grader.cli is imported there, never by check())."""
    return "course_lib.tooling.grader.cli" not in sys.modules


def machine() -> str:
    """The machine the check measures, as the learner reading the message knows it."""
    return "this machine" if inline() else "the grader's machine"


def say(text: str, end: str = "\n") -> None:
    """A progress line, printed at once, only inline: the grader's output is its gradebook."""
    if inline():
        print(text, end=end, flush=True)


def in_fresh_process_reporting(module: str, args: list, limit: float, what: str, report: Callable[[dict], None]):
    """grading.in_fresh_process, with progress: run `python -m module 'json(args)'` and return the JSON of
    its last line, passing each line it prints that starts with PROGRESS to report() as it comes (the
    checks that measure, 07.loader_settings and 09.speed_up, say their runs as they end).

    A fresh process because a DataLoader forks its workers, and forking the grader, whose judges run in
    threads, could copy a lock another thread holds into a worker that then waits for it forever.
    `what` names the measurement in the CheckFailure raised on a timeout or a failure."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", module, json.dumps(args)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root, env=env)
    expired = threading.Event()
    timer = threading.Timer(limit, lambda: (expired.set(), proc.kill()))
    timer.start()
    other: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # stderr too: one pipe, read to its end, cannot fill up and stop the child
            if line.startswith(PROGRESS):
                report(json.loads(line[len(PROGRESS) :]))
            else:
                other.append(line)
        proc.wait()
    except BaseException:  # the stop button, the grader's time limit: the measurement stops too
        proc.kill()
        proc.wait()
        raise
    finally:
        timer.cancel()
        if proc.stdout is not None:
            proc.stdout.close()
    if expired.is_set():
        raise CheckFailure(f"{what} took over {limit:.0f} s")
    results = [line for line in other if line.startswith(("[", "{"))]  # the last line, unless a warning followed
    if proc.returncode != 0 or not results:
        raise CheckFailure(f"{what} failed: {''.join(other).strip()[-600:]}")
    return json.loads(results[-1])


def reporting(run: dict) -> None:
    """A measuring process's report of one run, on the line in_fresh_process_reporting reads."""
    print(PROGRESS + json.dumps(run), flush=True)
