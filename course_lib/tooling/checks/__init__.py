"""The exercise checks, one module per chapter (ch00.py, ch01.py, ...).

A chapter's module is imported when its checks are first needed (`load("01")`), so that
grading chapter 00 does not pay for importing what chapter 02's checks need. Each module
registers its checks with `course_lib.tooling.grading.register`. The checks ship inside
course_lib so that `check()` works on Colab, where there is no repository checkout.

Extra check modules outside the package (an instructor's hidden checks, or test fixtures)
are loaded from the files listed in $COURSE_EXTRA_CHECKS (separated by os.pathsep), by the
grader and by the inline check() alike. A grading sandbox never sees a check module, these
included: their kernel side goes in $COURSE_EXTRA_PROBES (course_lib/tooling/probes).

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

__all__ = ["errors", "load", "load_file"]

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
