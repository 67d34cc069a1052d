"""The task side of the exercise checks: what runs beside the learner's code, and nothing more.

A task process (course_lib/tooling/task.py) imports the task's probe before the notebook's
statements run; its sandbox holds the learner library, this package included, but never
`course_lib/tooling/checks/`, where the cases are drawn and the right answers computed. So nothing
in here gives an answer away: a probe only builds a task's inputs from the (public part of the)
case, runs the learner's objects on them, and returns what happened as plain data. A probe takes
what it records with into names of its own when it is imported (probes/ch04.py), so that a
notebook that rebinds a torch function later changes nothing it records.

For task "NN.name", the function `name` in `probes/chNN.py` is its probe:
`name(case, *objects)` with the notebook's objects in the order of the check's `args`. A task
with no probe calls the learner's first object on the case. A probe may `ask` the grader
something the task process must not know in advance (how long a step the grader times should sleep,
chapter 00 and 06): the grader answers with the check's `host` method, in its own process.

Extra probe modules outside the package (an instructor's hidden checks, test fixtures) are
files named `*chNN.py` listed in $COURSE_EXTRA_PROBES (separated by os.pathsep).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["find", "ask", "answering"]

_local = threading.local()  # the host that answers `ask` while a task runs (a stack per thread)


def _extra(chapter: str) -> list:
    modules = []
    for file in os.environ.get("COURSE_EXTRA_PROBES", "").split(os.pathsep):
        if not file or not re.search(rf"ch{chapter}$", Path(file).stem):
            continue
        name = f"{__name__}._extra_{Path(file).stem}"
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, file)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load the probe file {file}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)
                raise
        modules.append(sys.modules[name])
    return modules


def find(name: str) -> Callable[..., Any] | None:
    """The probe of task `name` ("04.accumulate"), or None when the task has none."""
    chapter, _, task = name.partition(".")
    modules = list(_extra(chapter))
    if importlib.util.find_spec(f"{__name__}.ch{chapter}") is not None:
        modules.insert(0, importlib.import_module(f"{__name__}.ch{chapter}"))
    for module in modules:
        fn = getattr(module, task, None)
        if callable(fn):
            return fn
    return None


@contextmanager
def answering(host: Callable[[Any], Any] | None) -> Iterator[None]:
    """While the block runs, `ask(request)` is answered by `host(request)`."""
    stack = _local.__dict__.setdefault("hosts", [])
    stack.append(host)
    try:
        yield
    finally:
        stack.pop()


def ask(request: Any) -> Any:
    """From a probe: ask the grader (inline: the check itself) something only it knows; its answer."""
    stack = getattr(_local, "hosts", None)
    if not stack or stack[-1] is None:
        raise RuntimeError("probes.ask works only while a check runs its task")
    return stack[-1](request)
