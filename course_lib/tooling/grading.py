"""The inline check at the end of an exercise cell: `check("01.decode_fp16", decode_fp16)`.

It tells a learner what the batch grader will say, by doing what the grader does: it reads the
notebook's code as run so far in this kernel (IPython's history) and hands it to a fresh judging
process (`python -m course_lib.tooling.grading NAME`, so that nothing the notebook's cells changed
in this kernel can sway the verdict), which finds the statements the task's functions need
(course_lib/tooling/slicing.py), runs only those, and then the functions on fresh inputs, in a task
process of its own (course_lib/tooling/task.py), in a sandbox where this machine allows one
(course_lib/tooling/grader/wire.py, the code the batch grader judges with), and judges the answers.
So a shell line or a setting elsewhere in the notebook never changes the verdict, a forbidden
module is absent as it will be for the grader, and a task whose function leans on a cell it does
not use fails here first, with the cells the grader ran named.

Outside IPython (a script), or where the history does not hold the task's code (a notebook run by
a harness that keeps no history), the functions passed are judged in this process (`run_check`),
and the message says so.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

from . import probes, slicing
from .checkbase import Check, cannot_judge_here, judge_response
from .checks import get_check
from .task import Stop, respond

__all__ = ["check", "run_check", "judge_cells", "report", "main"]

_boxes: list = []  # the sandboxes of this process's inline checks, made on first use


def run_check(name: str, *objects: Any, rng: random.Random | None = None) -> tuple[str, str, Check]:
    """Judge `objects` for check `name` in this process, the way the grader judges: (status, message, check).

    The check's cases, its probe and its judge, with every answer across JSON; the time limit holds
    where this thread can take a signal. For the check tests, and for check() outside a notebook."""
    c = get_check(name)
    if len(objects) != len(c.args):
        return "failed", f"check({name!r}, ...) takes {len(c.args)} object(s): {', '.join(c.args)}", c
    if cannot_judge_here(c):
        return "not graded", cannot_judge_here(c), c
    cases = c.cases(rng or random.Random(int.from_bytes(os.urandom(8), "little")))
    public = [c.public(case) for case in cases]
    alarm = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if alarm:

        def on_alarm(signum: int, frame: Any) -> None:
            raise Stop

        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, c.time_limit)
    try:

        def host(i: int, request: Any) -> Any:  # across JSON both ways, as over the grader's channel
            return json.loads(json.dumps(c.host(cases[i], json.loads(json.dumps(request)))))

        probe = _probe(c)
        response = respond(probe, list(objects), public, host)
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except Stop:
        return "timed out", f"took longer than {c.time_limit:g} s (an endless loop?)", c
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    response = json.loads(json.dumps(response))  # the same boundary the task process's answers cross
    status, message = judge_response(c, cases, response)
    return status, message, c


def _probe(c: Check):
    """The task's probe, or a check's own run() (a test's fixture check), or None: call the object."""
    if type(c).run is not Check.run:
        return lambda case, *objects: c.run(case, *objects)
    return probes.find(c.name)


def judge_cells(
    name: str, cells: list[str], rng: random.Random | None = None, cell_limit: float = 60.0
) -> tuple[str, str, list[str], Check]:
    """Judge task `name` on a notebook's code cells as the batch grader does: (status, message, notes, check).
    `cell_limit`: seconds each statement the task needs may run (the batch grader's --cell-timeout)."""
    from .grader.wire import Sandboxes, judge_task

    c = get_check(name)
    if not _boxes:
        _boxes.append(Sandboxes.here())
        atexit.register(shutil.rmtree, _boxes[0].workspace, True)
    nb = slicing.read(cells)
    cases = c.cases(rng or random.Random(int.from_bytes(os.urandom(8), "little")))
    verdict = judge_task(c, nb, cases, _boxes[0], cell_limit, time.monotonic() + 900)
    return verdict.status, verdict.message, verdict.notes, c


def _history() -> list[str] | None:
    """The cells this kernel has run, as typed (None outside IPython)."""
    try:
        shell = get_ipython()  # type: ignore[name-defined]  # noqa: F821
        history = shell.history_manager.input_hist_raw
    except (NameError, AttributeError):
        return None
    return [cell for cell in history[1:] if isinstance(cell, str)]  # history[0] is IPython's empty placeholder


def check(name: str, *objects: Any) -> None:
    """The inline check at the end of an exercise cell, e.g. `check("00.choose_precision", choose_precision)`.

    Prints one ✅/❌ line (and, after a failed attempt, a hint), then any notes. Never raises.
    Inside the batch grader it does nothing: the grader judges every task itself; nor where
    $AMP_COURSE_SILENT_CHECKS is 1 (`make test` runs the solutions' cells, and grades their tasks
    with the batch grader, tests/test_grader.py)."""
    if os.environ.get("AMP_COURSE_GRADING") == "1" or os.environ.get("AMP_COURSE_SILENT_CHECKS") == "1":
        return
    cells = _history()
    try:
        c = get_check(name)
        from_notebook = bool(cells) and not slicing.needed(slicing.read(cells), c.args).missing
    except KeyError as e:
        print(_wrapped(f"❌ {name} — {e.args[0]}"))
        return
    except Exception as e:  # a broken check must not break the learner's notebook
        print(_wrapped(f"❌ {name} — the check itself failed: {type(e).__name__}: {str(e)[:300]}"))
        return
    if from_notebook:
        _judge_elsewhere(name, cells)
    else:
        report(name, *_here(name, objects))


def _here(name: str, objects: tuple) -> tuple[str, str, list[str], Check]:
    """Outside a notebook (or without its history): the objects passed, judged in this process."""
    status, message, c = run_check(name, *objects)
    notes = []
    if status == "passed":
        notes.append("judged in this process: run the notebook's cells in JupyterLab or Colab to be judged "
                     "as the grader judges (from the notebook's code)")  # fmt: skip
    return status, message, notes, c


def _judge_elsewhere(name: str, cells: list[str]) -> None:
    """Judge the cells in a fresh process (`main`) and print what it prints, line by line."""
    root = str(Path(__file__).resolve().parents[2])  # course_lib's folder, where sys.path had it inserted
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "course_lib.tooling.grading", name], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
        proc.stdin.write(json.dumps(cells))
        proc.stdin.close()
        for line in proc.stdout:
            print(line, end="", flush=True)
        err = proc.stderr.read()
        if proc.wait() != 0:
            print(_wrapped(f"❌ {name} — the check itself failed: {err.strip()[-300:]}"))
    except OSError as e:
        print(_wrapped(f"❌ {name} — the check could not start: {e}"))


def report(name: str, status: str, message: str, notes: list[str], c: Check) -> None:
    """Print a verdict as the inline check shows it: one ✅/❌ line, the hint after a failure, notes."""
    if status == "passed":
        print(f"✅ {name} — passed ({c.points}/{c.points} points)")
    else:
        print(
            _wrapped(f"❌ {name} — {message}")
            + (f"\n{_wrapped(f'   hint: {c.hint}', indent=' ' * 9)}" if c.hint and status == "failed" else "")
        )
    for note in notes[:6]:
        print(_wrapped(f"⚠️  {note}"))


def main(argv: list[str] | None = None) -> int:
    """`python -m course_lib.tooling.grading NAME` with a notebook's cells (JSON) on stdin: what check()
    prints, judged in this fresh process."""
    name = (argv or sys.argv[1:])[0]
    cells = json.loads(sys.stdin.read())
    try:
        status, message, notes, c = judge_cells(name, cells)
        if status not in ("passed", "not attempted"):
            ran = slicing.needed(slicing.read(cells), c.args).cells()
            which = f"cell{'s' if len(ran) > 1 else ''} {', '.join(map(str, ran))}" if ran else "nothing"
            notes.append(
                f"the grader ran only what {', '.join(c.args)} need{'s' if len(c.args) == 1 else ''}: "
                f"{which} of the cells run so far, in the order they ran (a file or a setting made by "
                "another cell is not there)"
            )
    except Exception as e:  # a broken check must not break the learner's notebook
        print(_wrapped(f"❌ {name} — the check itself failed: {type(e).__name__}: {str(e)[:300]}"))
        return 0
    report(name, status, message, notes, c)
    return 0


def _wrapped(text: str, indent: str = "   ", width: int = 100) -> str:
    """A message as lines of at most `width` characters, broken between words (a notebook's output
    area wraps long lines wherever the window ends, mid-word); its own line breaks are kept."""
    return "\n".join(
        textwrap.fill(part, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False) or part
        for part in text.split("\n")
    )


if __name__ == "__main__":
    sys.exit(main())
