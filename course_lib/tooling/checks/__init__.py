"""The exercise checks, one module per chapter (ch00.py, ch01.py, ...).

Importing this package imports every `chNN.py` next to it; each registers its checks with
`course_lib.tooling.grading.register`. The checks ship inside course_lib so that `check()` works on
Colab, where there is no repository checkout (otter's "tests directory does not exist").

Extra check modules outside the package (an instructor's hidden checks, or test fixtures)
are loaded from the files listed in $COURSE_EXTRA_CHECKS (separated by os.pathsep).
The variable is inherited by the grading kernels, so they see the same checks.

A module that fails to import does not take the other chapters down with it: its error is
kept in `errors` and reported by `check()` and the grader for that chapter.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
from pathlib import Path

__all__ = ["errors", "load_file"]

errors: dict[str, str] = {}  # module or file -> "ExcType: message"


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


def _load_package_modules() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("ch") and info.name[2:].isdigit():
            try:
                importlib.import_module(f"{__name__}.{info.name}")
            except Exception as e:  # keep loading the other chapters
                errors[info.name] = _short(e)


def load_file(file: str | Path) -> None:
    """Import a check module from a file outside the package (idempotent: same module name)."""
    name = f"{__name__}._extra_{Path(file).stem}"
    try:
        spec = importlib.util.spec_from_file_location(name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {file}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling inside it look the module up
        spec.loader.exec_module(module)
    except Exception as e:
        errors[str(file)] = _short(e)


_load_package_modules()
for _file in os.environ.get("COURSE_EXTRA_CHECKS", "").split(os.pathsep):
    if _file:
        load_file(_file)
