"""What a check is: one exercise task, judged the same way inline and by the batch grader.

A check is a class with these parts, and where each part runs is the point:

    cases(rng)             the grader's process: fresh random inputs, as plain data
    public(case)           what the task process is shown of a case (default: all of it)
    host(case, request)    the grader's process: answers a probe's `probes.ask` while it runs
                           (e.g. sleeps a time only the grader knows)
    judge(cases, results)  the grader's process: computes the reference answers and compares;
                           raises CheckFailure with a message for the learner

The learner's function runs elsewhere: in a task process (course_lib/tooling/task.py) that holds
only the statements of the notebook the function needs, where the task's probe
(course_lib/tooling/probes/chNN.py) calls it on each public case and sends back plain data. The
checks in course_lib/tooling/checks/chNN.py import this module and nothing of the task side.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "Check",
    "CheckFailure",
    "register",
    "registered",
    "cannot_judge_here",
    "judge_response",
    "in_fresh_process",
    "describe_value",
    "expect_number",
    "expect_numbers",
    "expect_list",
    "expect_dict",
    "short",
    "STATUSES",
]

NAME_RE = re.compile(r"^(\d{2})\.[A-Za-z0-9_]+$")
# What a task's status column can say, in words a student understands.
STATUSES = ("passed", "failed", "not attempted", "crashed", "timed out", "not graded", "duplicate")


class CheckFailure(AssertionError):
    """Raised by a check's judge; its message is shown to the learner as it is."""


class Check:
    """One exercise task. Subclass it in course_lib/tooling/checks/chNN.py and decorate with @register.

    name: "NN.task"; args: the notebook globals the task's probe is handed, in order; forbidden:
    modules that are absent from the process that runs the learner's code for this task (however
    an import is spelled; course_lib/tooling/task.py says how); forbidden_why: what the task asks
    instead; time_limit: seconds for the probe over all cases; needs_torch: the oldest torch its
    reference runs on ("2.12"), where that is newer than the course's floor.
    """

    name: str = ""
    args: tuple[str, ...] = ()
    points: int = 1
    hint: str = ""
    forbidden: tuple[str, ...] = ()
    forbidden_why: str = ""
    time_limit: float = 60.0
    needs_torch: str = ""

    def cases(self, rng: Any) -> list:
        raise NotImplementedError

    def public(self, case: Any) -> Any:
        """What the task process is shown of one case (the grader keeps the rest). Default: all."""
        return case

    def run(self, case: Any, *objects: Any) -> Any:
        """The task side, for a check judged in one process (course_lib.tooling.grading.run_check):
        the task's probe on the public case. Course checks do not override it (a test keeps it so)."""
        from .task import run_probe

        return run_probe(self.name, case, objects)

    def host(self, case: Any, request: Any) -> Any:
        """Grader side: answer a probe's `probes.ask(request)` about `case` (the full case)."""
        raise CheckFailure(f"check {self.name} answers no requests from its probe (asked {short(request, 60)})")

    def judge(self, cases: list, results: list) -> None:
        raise NotImplementedError

    def describe(self, case: Any) -> str:
        """How a failure message names the input of one case."""
        return f"{self.args[0]}({short(case)})"


_REGISTRY: dict[str, Check] = {}  # insertion order = the order checks are graded and listed


def register(cls: type[Check]) -> type[Check]:
    """Class decorator: add a Check subclass to the registry (once per name)."""
    if not NAME_RE.match(cls.name):
        raise ValueError(f"check name {cls.name!r} must look like '03.scaler_update'")
    if not cls.args or not all(isinstance(a, str) and a.isidentifier() for a in cls.args):
        raise ValueError(f"check {cls.name}: args must be a tuple of global names, e.g. ('decode_fp16',)")
    old = _REGISTRY.get(cls.name)
    # Re-importing a module registers the same class again; two classes under one name is a mistake.
    if old and (type(old).__module__, type(old).__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"check {cls.name} registered twice ({type(old).__module__} and {cls.__module__})")
    _REGISTRY[cls.name] = cls()
    return cls


def cannot_judge_here(check: Check) -> str:
    """Why this machine cannot judge `check` (its reference needs a newer torch), or ''."""
    if not check.needs_torch:
        return ""
    from ..device import torch_at_least

    if torch_at_least(check.needs_torch):
        return ""
    import torch

    return (
        f"this task's check needs torch >= {check.needs_torch} and this machine has {torch.__version__}: "
        "your function is not judged here (no point is lost by it); a newer torch judges it"
    )


def registered() -> dict[str, Check]:
    """The checks registered so far, by name (course_lib.tooling.checks loads a chapter's)."""
    return _REGISTRY


def in_fresh_process(module: str, args: list, limit: float, what: str) -> Any:
    """Run `python -m module 'json(args)'` in a new process and return the JSON of its last line.

    For checks that measure: a DataLoader forks its workers, and forking the grader, whose judges
    run in threads, could copy a lock another thread holds into a worker that then waits for it
    forever. A fresh process has one thread, a time limit, and none of the grader's state.
    `what` names the measurement in the CheckFailure raised on a timeout or a failure."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(
            [sys.executable, "-m", module, json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=limit,
            cwd=root,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise CheckFailure(f"{what} took over {limit:.0f} s") from None
    if done.returncode != 0:
        raise CheckFailure(f"{what} failed: {done.stderr.strip()[-600:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- answers of the right shape


def short(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (and safe from a broken __repr__)."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__} with a broken repr>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def describe_value(value: Any) -> str:
    """How a plain value is named in a check's message: 'a list of 3', 'the number 2.5', 'None'
    (what the expect_* helpers say a wrong answer was; a check's own shape tests say it the same way)."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return f"the bool {value}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {short(value, 40)}"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(value)[:8]}"
    return f"a {type(value).__name__}"


def expect_number(value: Any, where: str, *, finite: bool = True, integer: bool = False) -> float:
    """`value` as a number, or a CheckFailure that says what was expected (bools are not numbers)."""
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok:
        raise CheckFailure(f"{where}: expected {'an integer' if integer else 'a number'}, got {describe_value(value)}")
    if finite and not math.isfinite(value):
        raise CheckFailure(f"{where}: expected a finite number, got {value!r}")
    return value


def expect_list(value: Any, where: str, length: int | None = None, *, at_least: int = 0) -> list:
    """`value` as a list (of `length` items, or at least `at_least`), or a CheckFailure saying so."""
    if not isinstance(value, list):
        raise CheckFailure(f"{where}: expected a list, got {describe_value(value)}")
    if length is not None and len(value) != length:
        raise CheckFailure(f"{where}: expected a list of {length}, got a list of {len(value)}")
    if len(value) < at_least:
        raise CheckFailure(f"{where}: expected at least {at_least} item(s), got {len(value)}")
    return value


def expect_dict(value: Any, where: str, keys: tuple[str, ...] | list[str]) -> dict:
    """`value` as a dict that has every key in `keys`, or a CheckFailure naming the missing ones."""
    if not isinstance(value, dict):
        raise CheckFailure(f"{where}: expected a dict with keys {list(keys)}, got {describe_value(value)}")
    missing = [k for k in keys if k not in value]
    if missing:
        raise CheckFailure(f"{where}: the answer lacks {missing} (expected keys {list(keys)})")
    return value


def expect_numbers(value: Any, where: str, length: int | None = None, *, finite: bool = True) -> list[float]:
    """A flat list of (finite) numbers, checked item by item."""
    items = expect_list(value, where, length)
    return [expect_number(v, f"{where}, item {i}", finite=finite) for i, v in enumerate(items)]


# --------------------------------------------------------------------------- judging a response


def judge_response(check: Check, cases: list, response: Any) -> tuple[str, str]:
    """(status, message) for one task, from the cases the grader drew and the task process's response
    (course_lib/tooling/task.py `respond` says what it holds). Inline and in the batch grader alike."""
    fn = check.args[0]
    if not isinstance(response, dict):
        return "failed", "no readable answer came back from the notebook"
    if "missing" in response:
        return "not attempted", f"`{response['missing']}` is not defined in the notebook: define it in a cell"
    if response.get("not_attempted"):
        return "not attempted", "not attempted yet: the cell still raises NotImplementedError"
    if "forbidden" in response:
        return "failed", (
            f"{fn} used {response['forbidden']}, which this task asks you not to use"
            + (f": {check.forbidden_why}" if check.forbidden_why else "")
        )
    at = response.get("at")
    case = cases[at] if isinstance(at, int) and not isinstance(at, bool) and 0 <= at < len(cases) else None
    if "raised" in response:
        where = f" on {check.describe(case)}" if case is not None else ""
        return "failed", f"{fn} raised {response['raised']}{where}"
    if "not_plain" in response:
        where = f" for {check.describe(case)}" if case is not None else ""
        return "failed", f"{fn} returned {response['not_plain']}{where}"
    results = response.get("results")
    if not isinstance(results, list) or len(results) != len(cases):
        return "failed", "the answers that came back do not match the questions asked"
    try:
        check.judge(cases, results)
    except CheckFailure as e:
        return "failed", str(e)
    except Exception as e:  # results of a shape the judge did not expect
        return "failed", f"{fn} returned values of an unexpected kind ({type(e).__name__}: {short(str(e), 160)})"
    return "passed", "passed"
