"""Checks: one definition of each exercise check, judged the same way inline and by the batch grader.

A check is a class with these parts, and where each part runs is the point:

    cases(rng)             the grader's process: fresh random inputs, as plain data
    public(case)           what the learner's kernel is shown of a case (default: all of it)
    run(case, *objects)    the learner's kernel: the task's probe (course_lib/tooling/probes/chNN.py)
                           calls the learner's function(s) on one case and returns plain data
                           (numbers, strings, lists, dicts; see to_plain)
    host(case, request)    the grader's process: answers a probe's `probes.ask` while it runs
                           (e.g. sleeps a time only the grader knows)
    judge(cases, results)  the grader's process: computes the reference answers and compares;
                           raises CheckFailure with a message for the learner

Inline, `check("01.decode_fp16", decode_fp16)` runs them all in the learner's notebook, passing
the results through the same JSON boundary, and prints one line. The batch grader
(course_lib.tooling.grader) runs `cases`, `host` and `judge` in its own process and only the
probe, through `serve`, in the submission's sandboxed kernel, which holds no check module:
nothing a kernel prints, returns or writes can claim a pass, only values that the grader compares
with answers it computed itself.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import random
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

from . import probes

__all__ = [
    "Check",
    "CheckFailure",
    "in_fresh_process",
    "register",
    "check",
    "run_check",
    "get_check",
    "checks_for",
    "to_plain",
    "run_task",
    "expect_number",
    "expect_numbers",
    "expect_list",
    "expect_dict",
    "describe_value",
    "respond",
    "judge_response",
    "serve",
    "STATUSES",
    "REQUEST_PLEASE",
    "ANSWER_FD_ENV",
]

NAME_RE = re.compile(r"^(\d{2})\.[A-Za-z0-9_]+$")
STUB = 'raise NotImplementedError("Exercise: write your solution here")'
MAX_ITEMS = 2_000_000  # numbers in one check's results: more is a runaway, not an answer
# The batch grader hands the kernel one end of a socket it owns; this variable names its fd.
ANSWER_FD_ENV = "AMP_ANSWER_FD"
# What a task's status column can say, in words a student understands.
STATUSES = ("passed", "failed", "not attempted", "crashed", "timed out", "not graded", "duplicate")


class CheckFailure(AssertionError):
    """Raised by a check's judge; its message is shown to the learner as it is."""


class NotPlain(TypeError):
    """The learner's function returned something that is not plain data."""


class Check:
    """One exercise task. Subclass it in course_lib/tooling/checks/chNN.py and decorate with @register.

    name: "NN.task"; args: the notebook globals handed to run(), in order; forbidden: modules the
    learner's own code must not call while run() executes (detected where Python lets us see it);
    forbidden_why: what the task asks instead; time_limit: seconds for run() over all cases.
    """

    name: str = ""
    args: tuple[str, ...] = ()
    points: int = 1
    hint: str = ""
    forbidden: tuple[str, ...] = ()
    forbidden_why: str = ""
    time_limit: float = 60.0

    def cases(self, rng: random.Random) -> list:
        raise NotImplementedError

    def public(self, case: Any) -> Any:
        """What the learner's kernel is shown of one case (the grader keeps the rest). Default: all."""
        return case

    def run(self, case: Any, *objects: Any) -> Any:
        """Kernel side: the task's probe in course_lib/tooling/probes/chNN.py, on the public case.
        Course checks do not override this (a test keeps it so): the kernel has no check modules."""
        return run_task(self.name, case, objects)

    def host(self, case: Any, request: Any) -> Any:
        """Grader side: answer a probe's `probes.ask(request)` about `case` (the full case)."""
        raise CheckFailure(f"check {self.name} answers no requests from its probe (asked {_short(request, 60)})")

    def judge(self, cases: list, results: list) -> None:
        raise NotImplementedError

    def describe(self, case: Any) -> str:
        """How a failure message names the input of one case."""
        return f"{self.args[0]}({_short(case)})"


_REGISTRY: dict[str, Check] = {}  # insertion order = the order checks are graded and listed


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


def _load(chapter: str | None = None) -> None:
    from course_lib.tooling import checks

    checks.load(chapter)  # imports chNN.py (or every chapter), which registers its checks


def _load_errors(chapter: str) -> str:
    from course_lib.tooling import checks

    return "; ".join(f"{k}: {v}" for k, v in checks.errors.items() if k == f"ch{chapter}" or not k.startswith("ch"))


def get_check(name: str) -> Check:
    """The registered check called `name` (KeyError if there is none)."""
    _load(name.split(".")[0])
    if name not in _REGISTRY:
        errors = _load_errors(name.split(".")[0])
        why = f" (check modules failed to load: {errors})" if errors else ""
        raise KeyError(f"there is no check called {name!r}{why}")
    return _REGISTRY[name]


def checks_for(chapter: str) -> list[Check]:
    """The checks of one chapter ('03'), in the order they were registered."""
    _load(chapter)
    errors = _load_errors(chapter)
    if errors:  # a half-loaded chapter would grade with missing checks: say so instead
        raise RuntimeError(f"checks for chapter {chapter} failed to load: {errors}")
    return [c for c in _REGISTRY.values() if c.name.startswith(chapter + ".")]


# --------------------------------------------------------------------------- answers of the right shape


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
        return f"the string {_short(value, 40)}"
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


# --------------------------------------------------------------------------- plain data


def _short(value: Any, limit: int = 80) -> str:
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__} with a broken repr>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def to_plain(value: Any, _budget: list[int] | None = None) -> Any:
    """A fresh copy of `value` made of bool/int/float/str/None, lists and str-keyed dicts.

    numpy and torch scalars become Python numbers, tensors and arrays {"array": [...],
    "dtype": "float32"}, torch dtypes {"dtype": "float32"}. Subclasses lose their overrides
    (a float whose == always says True arrives as a plain float). Anything else raises NotPlain.
    """
    budget = _budget if _budget is not None else [MAX_ITEMS]
    budget[0] -= 1
    if budget[0] < 0:
        raise NotPlain(f"more than {MAX_ITEMS:,} values")
    if value is None or isinstance(value, bool):
        return None if value is None else bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return to_plain(value.item(), budget)
        dtype = str(value.dtype).removeprefix("torch.")
        return {"array": to_plain(value.detach().cpu().tolist(), budget), "dtype": dtype}
    if type(value).__module__ == "numpy":
        if hasattr(value, "shape") and getattr(value, "ndim", 0) > 0:
            return {"array": to_plain(value.tolist(), budget), "dtype": str(value.dtype)}
        if hasattr(value, "item"):
            return to_plain(value.item(), budget)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [to_plain(v, budget) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {str.__str__(k): to_plain(v, budget) for k, v in value.items()}
    raise NotPlain(f"a {type(value).__name__} object ({_short(value, 60)}): return numbers, strings, lists or dicts")


# --------------------------------------------------------------------------- the kernel side


@contextlib.contextmanager
def _forbidden_probe(prefixes: tuple[str, ...]) -> Iterator[list[str]]:
    """Record the first call the learner's own code (module __main__) makes into `prefixes`.

    Uses sys.setprofile, which sees Python calls and calls of C functions made from Python.
    A determined learner can hide a call (through C, or by switching the profiler off): this
    catches the honest shortcut, not deliberate cheating, and the README says so.
    """
    hits: list[str] = []
    if not prefixes:
        yield hits
        return
    owners = set(prefixes) | ({"_struct"} if "struct" in prefixes else set())

    def owned(module: str | None) -> bool:
        return bool(module) and any(module == p or module.startswith(p + ".") for p in owners)

    def profile(frame: Any, event: str, arg: Any) -> None:
        if hits:
            return
        if event == "call":
            caller = frame.f_back
            module = frame.f_globals.get("__name__")
            if caller is not None and caller.f_globals.get("__name__") == "__main__" and owned(module):
                hits.append(f"{module}.{frame.f_code.co_name}")
        elif event == "c_call" and frame.f_globals.get("__name__") == "__main__":
            module = getattr(arg, "__module__", None)
            if module is None and getattr(arg, "__self__", None) is not None:
                module = type(arg.__self__).__module__
            if owned(module):
                hits.append(f"{module}.{getattr(arg, '__qualname__', getattr(arg, '__name__', '?'))}")

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield hits
    finally:
        sys.setprofile(old)


def _brief(e: BaseException, limit: int = 300) -> str:
    try:
        text = str(e)
    except Exception:  # a learner's exception with a broken __str__
        text = "<unprintable>"
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[:limit] + " …"


class _CheckTimeout(BaseException):
    """BaseException, so that a learner's `except Exception:` cannot swallow the time limit."""


def run_task(name: str, case: Any, objects: tuple) -> Any:
    """Kernel side: run task `name` on one case: its probe if it has one, else the learner's first object."""
    probe = probes.find(name)
    return probe(case, *objects) if probe is not None else objects[0](case)


def respond(check: Any, cases: list, namespace: dict, host: Callable[[int, Any], Any] | None = None) -> dict:
    """Kernel side: run the learner's objects on every case; a JSON-ready response, never raises.

    `check` is a Check, or in the grader's kernel its public part (name, args, forbidden, run).
    `host(i, request)` answers the probe's `probes.ask` while case i runs.
    {"results": [...]} or {"missing": name} / {"not_attempted": true} / {"raised": ..., "at": i} /
    {"not_plain": ..., "at": i} / {"forbidden": "torch.tensor"}, each with the results so far.
    """
    missing = [a for a in check.args if a not in namespace]
    if missing:
        return {"missing": missing[0]}
    objects = [namespace[a] for a in check.args]
    results: list = []
    with _forbidden_probe(tuple(check.forbidden)) as hits:
        for i, case in enumerate(cases):
            try:
                with probes.answering(None if host is None else (lambda request, i=i: host(i, request))):
                    value = check.run(case, *objects)
            except NotImplementedError as e:
                if not str(e) or str(e).startswith("Exercise"):  # only our stub means "untouched"
                    return {"not_attempted": True}
                return {"raised": _brief(e), "at": i, "results": results}
            except _CheckTimeout:
                raise
            except BaseException as e:  # noqa: BLE001  SystemExit, KeyboardInterrupt: the learner's, not ours
                return {"raised": _brief(e), "at": i, "results": results}
            if hits:
                return {"forbidden": hits[0], "results": results}
            try:
                results.append(to_plain(value))
            except NotPlain as e:
                return {"not_plain": str(e), "at": i, "results": results}
            except Exception as e:  # a learner's object whose tolist/item/__float__ raises
                return {"not_plain": f"a value that could not be read ({_brief(e, 120)})", "at": i, "results": results}
    return {"results": results}


class _Channel:
    """The kernel's end of the socket the grader created: one JSON line each way per message."""

    def __init__(self) -> None:
        fd = int(os.environ[ANSWER_FD_ENV])
        self.sock = socket.socket(fileno=os.dup(fd))
        self.reader = self.sock.makefile("rb")

    def send(self, message: dict) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def receive(self) -> dict:
        line = self.reader.readline()
        if not line:
            raise ConnectionError("the grader closed the channel")
        return json.loads(line)

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


REQUEST_PLEASE = {"next": True}  # the one line serve() sends before it has a question to answer


def serve(request: dict | None, namespace: dict) -> None:
    """Kernel side of the batch grader: answer one task on the grader's channel, never raise.

    `request` is what the grader sends after the notebook's cells have run: the task's public
    part (name, args, forbidden), the public cases and a nonce that the one answer must carry.
    The batch grader passes None: the request then comes over the channel, asked for with
    REQUEST_PLEASE, so that neither the nonce nor the cases appear in the code the kernel executes
    (IPython keeps that code in its history, where a notebook's own code could read it).
    The grader stops a task that runs past its time limit with SIGINT; while a task runs, SIGINT
    raises our own exception, so a timeout is told apart from a KeyboardInterrupt the learner raises.
    """

    def on_interrupt(signum: int, frame: Any) -> None:
        raise _CheckTimeout

    channel = _Channel()
    if request is None:
        try:
            channel.send(REQUEST_PLEASE)
            request = channel.receive()
        except BaseException:  # noqa: BLE001  no question came: the grader's time limit says the rest
            channel.close()
            return
    nonce = request.get("nonce")

    def host(i: int, question: Any) -> Any:
        channel.send({"nonce": nonce, "ask": question, "case": i})
        reply = channel.receive()
        if reply.get("nonce") != nonce or "reply" not in reply:
            raise RuntimeError(f"the grader could not answer: {reply.get('error', 'no reply')}")
        return reply["reply"]

    old = signal.signal(signal.SIGINT, on_interrupt)
    try:
        name = str(request["name"])
        task = SimpleNamespace(
            name=name,
            args=tuple(request["args"]),
            forbidden=tuple(request["forbidden"]),
            run=lambda case, *objects: run_task(name, case, objects),
        )
        probes.find(name)  # a probe module that does not import is the check's fault, said as such below
        response = respond(task, request["cases"], namespace, host)
    except _CheckTimeout:
        response = {"timed_out": True}
    except BaseException as e:  # noqa: BLE001
        response = {"raised": f"the check could not run: {_brief(e)}"}
    finally:
        signal.signal(signal.SIGINT, old)
    try:
        channel.send({"nonce": nonce, "response": response})
    finally:
        channel.close()


# --------------------------------------------------------------------------- the grader side


def judge_response(check: Check, cases: list, response: Any) -> tuple[str, str]:
    """Grader side: (status, message) for one task, from the cases the grader drew and the response."""
    fn = check.args[0]
    if not isinstance(response, dict):
        return "failed", "no readable answer came back from the notebook"
    if "missing" in response:
        return "not attempted", f"`{response['missing']}` is not defined: run its cell (and keep it in the notebook)"
    if response.get("not_attempted"):
        return "not attempted", "not attempted yet: the cell still raises NotImplementedError"
    if response.get("timed_out"):
        return "timed out", f"checking this task took longer than {check.time_limit:g} s (an endless loop?)"
    if "forbidden" in response:
        return "failed", (
            f"{fn} called {response['forbidden']}, which this task asks you not to use"
            + (f": {check.forbidden_why}" if check.forbidden_why else "")
        )
    at = response.get("at")
    case = cases[at] if isinstance(at, int) and 0 <= at < len(cases) else None
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
        return "failed", f"{fn} returned values of an unexpected kind ({_brief(e, 160)})"
    return "passed", "passed"


def run_check(name: str, *objects: Any, rng: random.Random | None = None) -> tuple[str, str, Check]:
    """Run one check in this process exactly as the grader judges it: (status, message, check)."""
    c = get_check(name)
    if len(objects) != len(c.args):
        return "failed", f"check({name!r}, ...) takes {len(c.args)} object(s): {', '.join(c.args)}", c
    cases = c.cases(rng or random.Random(int.from_bytes(os.urandom(8), "little")))
    public = [c.public(case) for case in cases]
    alarm = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if alarm:

        def on_alarm(signum: int, frame: Any) -> None:
            raise _CheckTimeout

        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, c.time_limit)
    try:

        def host(i: int, request: Any) -> Any:  # across JSON both ways, as over the grader's channel
            return json.loads(json.dumps(c.host(cases[i], json.loads(json.dumps(request)))))

        response = respond(c, public, dict(zip(c.args, objects)), host)
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _CheckTimeout:
        return "timed out", f"took longer than {c.time_limit:g} s (an endless loop?)", c
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    response = json.loads(json.dumps(response))  # the same boundary the batch grader's answers cross
    status, message = judge_response(c, cases, response)
    return status, message, c


def check(name: str, *objects: Any) -> None:
    """The inline check at the end of an exercise cell, e.g. `check("00.choose_precision", choose_precision)`.

    Prints one ✅/❌ line (and, after a failed attempt, a hint). Never raises. Inside the batch
    grader it does nothing: the grader judges every task itself after the notebook has run.
    """
    if os.environ.get("AMP_COURSE_GRADING") == "1":
        return
    try:
        status, message, c = run_check(name, *objects)
        status, message, note = _as_the_grader_reads_it(c, status, message)
    except KeyError as e:
        print(_wrapped(f"❌ {name} — {e.args[0]}"))
        return
    except Exception as e:  # a broken check must not break the learner's notebook
        print(_wrapped(f"❌ {name} — the check itself failed: {_brief(e)}"))
        return
    if status == "passed":
        print(f"✅ {name} — passed ({c.points}/{c.points} points)")
    else:
        print(
            _wrapped(f"❌ {name} — {message}")
            + (f"\n{_wrapped(f'   hint: {c.hint}', indent=' ' * 9)}" if c.hint and status == "failed" else "")
        )
    if note:
        print(_wrapped(f"⚠️  {note}"))


def _as_the_grader_reads_it(c: Check, status: str, message: str) -> tuple[str, str, str]:
    """Inline, the batch grader's reading of the source (course_lib/tooling/source_rules.py), applied to
    the cells this kernel has run (IPython's history): a forbidden module the function reaches fails
    the task here too, and code the grader would refuse to grade is named in a note."""
    try:
        # the cells as typed (`In` holds them after IPython's rewriting: magics become get_ipython() calls)
        history = get_ipython().history_manager.input_hist_raw  # type: ignore[name-defined]  # noqa: F821
    except (NameError, AttributeError):  # not in IPython: nothing to read
        return status, message, ""
    from . import source_rules

    nb = source_rules.read([cell for cell in history if isinstance(cell, str)])
    found = source_rules.forbidden_use(nb, c.args, tuple(c.forbidden))
    if found is not None and status != "not attempted":
        status = "failed"
        message = f"{c.args[0]} uses {found.what}, which this task asks you not to use" + (
            f": {c.forbidden_why}" if c.forbidden_why else ""
        )
    reaching = source_rules.reaching_code(nb)
    note = (
        f"the batch grader would not grade this notebook automatically: a cell you ran uses {reaching[0].what}, "
        "code that can read or rewrite the grader's own code"
        if reaching
        else ""
    )
    return status, message, note


def _wrapped(text: str, indent: str = "   ", width: int = 100) -> str:
    """A message as lines of at most `width` characters, broken between words (a notebook's output
    area wraps long lines wherever the window ends, mid-word); its own line breaks are kept."""
    return "\n".join(
        textwrap.fill(part, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False) or part
        for part in text.split("\n")
    )
