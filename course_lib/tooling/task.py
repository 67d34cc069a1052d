"""The task process: where a learner's code runs for one task, and nothing else of the notebook.

The grader (course_lib/tooling/grader/wire.py, which starts it in a sandbox) and the inline check()
both judge a task by starting this module in a fresh process:

    python -c "import course_lib.tooling.task as t; t.main()"     (channel: the fd in $AMP_ANSWER_FD)

1. It imports what judging needs first (this module and the task's probe) and keeps its own
   references to it, so that what a notebook rebinds later (`torch.is_autocast_enabled = ...`)
   changes nothing it uses.
2. It receives the statements of the notebook that the task's functions need (found by reading the
   source, course_lib/tooling/slicing.py) and runs them in a fresh `__main__`, in notebook order, one
   by one: a statement that raises is reported and the next one runs, as in a notebook whose cells
   run top to bottom. No other statement of the notebook runs here: not its shell lines, not a cell
   that patches the grading code, not a startup file it wrote (every task starts from a new home).
   The modules the task forbids are absent: the grader's sandbox does not show their files
   (`grader/sandbox.py`); here an import hook refuses them too, which is all there is where no
   sandbox can be built, and all there is for a module this process had to import before.
3. Only then does it ask for the cases, and the nonce its one answer must carry: code that runs
   while the statements load cannot see either. It runs the probe on every case (a probe may ask the
   grader a question, `probes.ask`) and sends {"response": ...} as plain data (`to_plain`).

What it cannot stop, and the README says: the code the task's own functions run shares this process
with the probe, so a function that digs into the probe's frames or objects can still change what
an instrumented task records about it. The grader notes such code for the instructor.
"""

from __future__ import annotations

import ast
import builtins
import importlib.abc
import json
import linecache
import numbers
import os
import sys
import types
from typing import Any, Callable

from . import probes

__all__ = ["main", "respond", "run_probe", "to_plain", "NotPlain", "Stop", "ABSENT", "ANSWER_FD_ENV", "MAX_ITEMS"]

ANSWER_FD_ENV = "AMP_ANSWER_FD"  # the grader hands the task process one end of a socket it owns
MAX_ITEMS = 2_000_000  # numbers in one task's results: more is a runaway, not an answer
MAX_DIGITS = 4_000  # an integer longer than this does not cross JSON (Python's own limit is 4,300 digits)
STUB = 'raise NotImplementedError("Exercise: write your solution here")'
STUB_MESSAGE = "Exercise"
# How an absent module says so: the sandbox's stand-in files raise it, and so does the import hook.
ABSENT = "is not available while this task is judged"
# IPython runs a cell's code after its `from __future__` imports are compiled: postponed annotations
# let `def f(x: np.ndarray)` define f where numpy is absent (a type hint runs nothing).
_FLAGS = __import__("__future__").annotations.compiler_flag

# Taken now, before any learner code runs: the functions the rest of this module calls.
_dumps, _loads = json.dumps, json.loads
_exit, _dup, _environ = os._exit, os.dup, os.environ
_answering = probes.answering


class NotPlain(TypeError):
    """The learner's function returned something that is not plain data."""


class Stop(BaseException):
    """Raised into a task by whoever runs it in its own process (grading.run_check's time limit):
    `respond` lets it through, where every exception of the learner's is caught."""


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
    (a float whose == always says True arrives as a plain float). Anything else raises NotPlain,
    and so does an integer too long to send.
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
        number = int.__index__(int(value))
        if number.bit_length() > MAX_DIGITS * 3.33:  # about MAX_DIGITS decimal digits
            raise NotPlain(f"an integer of about {int(number.bit_length() / 3.32):,} digits, too large to send back")
        return number
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [to_plain(v, budget) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {str.__str__(k): to_plain(v, budget) for k, v in value.items()}
    raise NotPlain(f"a {type(value).__name__} object ({_short(value, 60)}): return numbers, strings, lists or dicts")


# --------------------------------------------------------------------------- running a task


def _brief(e: BaseException, limit: int = 300) -> str:
    try:
        text = str(e)
    except Exception:  # a learner's exception with a broken __str__
        text = "<unprintable>"
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[:limit] + " …"


def absent_module(e: BaseException) -> str | None:
    """The forbidden module an exception says is absent (ours, raised anywhere in its chain), or None."""
    seen = 0
    while e is not None and seen < 20:
        text = str(e) if isinstance(e, ImportError) else ""
        if ABSENT in text:
            return text.split(" ", 1)[0]
        e, seen = (e.__cause__ or e.__context__), seen + 1
    return None


def run_probe(name: str, case: Any, objects: tuple) -> Any:
    """Task `name` on one case: its probe if it has one, else the learner's first object on the case."""
    probe = probes.find(name)
    return probe(case, *objects) if probe is not None else objects[0](case)


def respond(probe: Callable | None, objects: list, cases: list, host: Callable[[int, Any], Any] | None = None) -> dict:
    """Run the learner's objects on every case through the task's probe (None: the first object is
    called on the case); a JSON-ready response, never raises.

    `host(i, request)` answers the probe's `probes.ask` while case i runs.
    {"results": [...]} or {"not_attempted": true} / {"raised": ..., "at": i} / {"not_plain": ..., "at": i}
    / {"forbidden": "torch"}, each with the results so far.
    """
    results: list = []
    for i, case in enumerate(cases):
        try:
            with _answering(None if host is None else (lambda request, i=i: host(i, request))):
                value = probe(case, *objects) if probe is not None else objects[0](case)
        except NotImplementedError as e:
            if not str(e) or str(e).startswith(STUB_MESSAGE):  # only our stub means "untouched"
                return {"not_attempted": True}
            return {"raised": _brief(e), "at": i, "results": results}
        except Stop:
            raise
        except BaseException as e:  # noqa: BLE001  SystemExit, KeyboardInterrupt: the learner's, not ours
            module = absent_module(e)
            if module is not None:
                return {"forbidden": module, "at": i, "results": results}
            return {"raised": _brief(e), "at": i, "results": results}
        try:
            results.append(to_plain(value))
        except NotPlain as e:
            return {"not_plain": str(e), "at": i, "results": results}
        except Exception as e:  # a learner's object whose tolist/item/__float__ raises
            return {"not_plain": f"a value that could not be read ({_brief(e, 120)})", "at": i, "results": results}
    return {"results": results}


# --------------------------------------------------------------------------- what a task forbids


def _forbidden(name: str, prefixes: tuple[str, ...]) -> str | None:
    return next((p for p in prefixes if name == p or name.startswith(p + ".")), None)


class _Absent(importlib.abc.MetaPathFinder):
    """First on sys.meta_path: an import of a forbidden module fails, however it is spelled."""

    def __init__(self, prefixes: tuple[str, ...], why: str) -> None:
        self.prefixes, self.why = prefixes, why

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if _forbidden(name, self.prefixes) and not _machinery(name):
            # ImportError, not ModuleNotFoundError: `from package import module` passes over the latter
            raise ImportError(f"{name} {ABSENT}: {self.why}", name=name)
        return None


# What this process runs of course_lib before the learner's code: a task that forbids all of
# course_lib still runs these (the grader's sandbox leaves their files in place too).
MACHINERY = ("course_lib", "course_lib.tooling", "course_lib.tooling.task", "course_lib.tooling.probes")


def _machinery(name: str) -> bool:
    return name in MACHINERY or name.startswith("course_lib.tooling.probes.")


def make_absent(prefixes: tuple[str, ...], why: str) -> list[str]:
    """Refuse every import of `prefixes` from now on (but this process's own modules); returns the
    forbidden modules this process had already imported (dropped from sys.modules, which keeps out
    a new import, not a reference to the module, so those are absent by this hook alone)."""
    if not prefixes:
        return []
    loaded = [m for m in list(sys.modules) if _forbidden(m, prefixes) and not _machinery(m)]
    for module in loaded:
        del sys.modules[module]
    sys.meta_path.insert(0, _Absent(prefixes, why))
    return sorted({_forbidden(m, prefixes) for m in loaded})


# --------------------------------------------------------------------------- the notebook's statements


class _Shell:
    """What `get_ipython()` returns here: IPython's shell lines and magics (`!pip`, `%matplotlib`) are
    a notebook's habits, run by nothing in a task process; each call does nothing."""

    def system(self, *args: Any, **kwargs: Any) -> None:
        return None

    def getoutput(self, *args: Any, **kwargs: Any) -> list:
        return []

    def run_line_magic(self, *args: Any, **kwargs: Any) -> None:
        return None

    def run_cell_magic(self, *args: Any, **kwargs: Any) -> None:
        return None


def _split(stmt: ast.stmt) -> list[ast.stmt]:
    """An import of several names as one statement per name: `import torch, math` where torch is
    absent still binds math."""
    if isinstance(stmt, ast.Import) and len(stmt.names) > 1:
        return [ast.copy_location(ast.Import(names=[a]), stmt) for a in stmt.names]
    if isinstance(stmt, ast.ImportFrom) and len(stmt.names) > 1:
        return [ast.copy_location(ast.ImportFrom(module=stmt.module, names=[a], level=stmt.level), stmt)
                for a in stmt.names]  # fmt: skip
    return [stmt]


def load(cells: dict[str, str], statements: list, namespace: dict, progress: Callable[[int, int], None]) -> list:
    """Run `statements` ([cell, index of a top-level statement] in notebook order) of `cells` (cell
    number -> its code as Python) in `namespace`; each failure as {"cell", "line", "error", "absent"}."""
    errors = []
    trees: dict[str, ast.Module | None] = {}
    for n, source in cells.items():
        filename = f"<cell {n}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # inspect.getsource
        try:
            trees[n] = ast.parse(source, filename)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            trees[n] = None
    for n, index in statements:
        tree = trees.get(str(n))
        if tree is None or not 0 <= index < len(tree.body):
            errors.append({"cell": n, "line": 0, "error": "the statement could not be read", "absent": None})
            continue
        for stmt in _split(tree.body[index]):
            progress(n, stmt.lineno)
            try:
                code = compile(ast.Module(body=[stmt], type_ignores=[]), f"<cell {n}>", "exec", _FLAGS, True)
                exec(code, namespace)
            except BaseException as e:  # noqa: BLE001  a statement that fails costs only itself
                errors.append({"cell": n, "line": stmt.lineno, "error": _brief(e, 200), "absent": absent_module(e)})
    return errors


# --------------------------------------------------------------------------- the process


class _Channel:
    """The task process's end of the grader's socket: one JSON line each way per message. Read and
    written with os.read and os.write alone: the socket module imports array, which a "by hand"
    task forbids."""

    def __init__(self, fd: int) -> None:
        self.fd, self.pending = _dup(fd), b""
        self.read, self.write = os.read, os.write

    def send(self, message: dict) -> None:
        data = memoryview(_dumps(message).encode() + b"\n")
        while data:
            data = data[self.write(self.fd, data) :]

    def receive(self) -> dict:
        while b"\n" not in self.pending:
            chunk = self.read(self.fd, 1 << 20)
            if not chunk:
                raise ConnectionError("the grader closed the channel")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return _loads(line)


def main() -> None:
    """Run one task for the grader on the channel in $AMP_ANSWER_FD (module docstring), then exit."""
    channel = _Channel(int(_environ[ANSWER_FD_ENV]))
    send, receive = channel.send, channel.receive
    code = receive()  # {"name", "args", "cells", "statements", "forbidden", "why"}
    name, args = str(code["name"]), [str(a) for a in code["args"]]
    probe = probes.find(name)  # imported (with its torch) and looked up before any learner code runs
    best_effort = make_absent(tuple(code.get("forbidden", ())), str(code.get("why", "")))
    main_module = types.ModuleType("__main__")
    namespace = main_module.__dict__
    namespace.update({"__builtins__": builtins, "get_ipython": _Shell})
    sys.modules["__main__"] = main_module
    errors = load(code["cells"], code["statements"], namespace, lambda n, line: send({"loading": [n, line]}))
    missing = [a for a in args if a not in namespace]
    send({"loaded": {"errors": errors, "missing": missing, "best_effort": best_effort}})
    if missing:
        _exit(0)
    question = receive()  # {"nonce", "cases"}: only now, after the notebook's statements have run
    nonce = question["nonce"]
    objects = [namespace[a] for a in args]

    def host(i: int, request: Any) -> Any:
        send({"nonce": nonce, "ask": request, "case": i})
        reply = receive()
        if reply.get("nonce") != nonce or "reply" not in reply:
            raise RuntimeError(f"the grader could not answer: {reply.get('error', 'no reply')}")
        return reply["reply"]

    response = respond(probe, objects, question["cases"], host)
    try:
        send({"nonce": nonce, "response": response})
    except ValueError as e:  # an answer JSON cannot write
        send({"nonce": nonce, "response": {"not_plain": f"an answer that cannot be sent ({_brief(e, 120)})"}})
    _exit(0)
