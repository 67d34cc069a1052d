"""The exercise checks, one module per chapter (ch00.py, ch01.py, ...).

A chapter's module is imported when its checks are first needed (`get_check("01.x")`,
`checks_for("01")`), so that grading chapter 00 does not pay for importing what chapter 02's
checks need. Each module registers its checks with `course_lib.tooling.checkbase.register`. The checks
ship inside course_lib so that `check()` works on Colab, where there is no repository checkout,
and no sandbox ever sees them (course_lib/tooling/grader/sandbox.py).

Extra check modules outside the package (an instructor's hidden checks, or test fixtures)
are loaded from the files listed in $COURSE_EXTRA_CHECKS (separated by os.pathsep), by the
grader and by the inline check() alike. A grading sandbox never sees a check module, these
included: their task side goes in $COURSE_EXTRA_PROBES (course_lib/tooling/probes).

A module that fails to import does not take the other chapters down with it: its error is
kept in `errors` and reported by `check()` and the grader for that chapter.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
import threading
from pathlib import Path

from ..checkbase import Check, registered

__all__ = ["errors", "load", "load_file", "get_check", "checks_for"]

errors: dict[str, str] = {}  # module or file -> "ExcType: message"
_loaded: set[str] = set()
# The batch grader judges several submissions at once, in threads: a second thread must wait
# until the first has finished importing a chapter, not find it half-registered.
_lock = threading.RLock()


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


def load_file(file: str | Path) -> None:
    """Import a check module from a file outside the package (idempotent: same module name)."""
    name = f"{__name__}._extra_{Path(file).stem}"
    if name in sys.modules:
        return
    try:
        spec = importlib.util.spec_from_file_location(name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {file}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling inside it look the module up
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        errors[str(file)] = _short(e)


def load(chapter: str | None = None) -> None:
    """Import the check module of `chapter` ('01'), or of every chapter; extra files always."""
    with _lock:
        _load(chapter)


def _load(chapter: str | None) -> None:
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.startswith("ch") and m.name[2:].isdigit())
    for name in names if chapter is None else [f"ch{chapter}"] if f"ch{chapter}" in names else []:
        if name not in _loaded:
            _loaded.add(name)
            try:
                importlib.import_module(f"{__name__}.{name}")
            except Exception as e:  # keep loading the other chapters
                errors[name] = _short(e)
    for file in os.environ.get("COURSE_EXTRA_CHECKS", "").split(os.pathsep):
        if file:
            load_file(file)


def _errors_for(chapter: str) -> str:
    return "; ".join(f"{k}: {v}" for k, v in errors.items() if k == f"ch{chapter}" or not k.startswith("ch"))


def get_check(name: str) -> Check:
    """The registered check called `name` (KeyError if there is none)."""
    load(name.split(".")[0])
    if name not in registered():
        problems = _errors_for(name.split(".")[0])
        why = f" (check modules failed to load: {problems})" if problems else ""
        raise KeyError(f"there is no check called {name!r}{why}")
    return registered()[name]


def checks_for(chapter: str) -> list[Check]:
    """The checks of one chapter ('03'), in the order they were registered."""
    load(chapter)
    problems = _errors_for(chapter)
    if problems:  # a half-loaded chapter would grade with missing checks: say so instead
        raise RuntimeError(f"checks for chapter {chapter} failed to load: {problems}")
    return [c for c in registered().values() if c.name.startswith(chapter + ".")]
