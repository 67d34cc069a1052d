"""Which code made a recorded result, and what runs a recorded command now: plumbing for
course_lib.reference, not part of the core a learner reads.

A result carries the code that made it, as modded-nanogpt's logs carry theirs: the course's git
commit (or why there is none: a copied tree, as on an offline GPU machine) and the git blob id of
the file the command runs. A recorded command is kept as it ran; when its module moves, MOVED
says what runs it now, and the notebooks and the edition print both.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
from pathlib import Path

__all__: list[str] = []  # used by course_lib.reference only

ROOT = Path(__file__).resolve().parents[1]
# Recorders that moved since they recorded: a recorded command keeps the module (or script) it ran,
# and show_reference and the edition print the current one under it. Old [subcommand] -> now; a
# name ending in .py is a script (`python tools/x.py`), any other a module (`python -m ...`).
MOVED = {  # issue 28: one home per chapter
    "course_lib.chapters.bench": "course_lib.chapters.ch00.bench",
    "course_lib.chapters.matmul error": "course_lib.chapters.ch01.matmul error",
    "course_lib.chapters.matmul speed": "course_lib.chapters.ch02.matmul_speed",
    "course_lib.chapters.autocast_policy": "course_lib.chapters.ch02.autocast_policy",
    "course_lib.chapters.autocast_dtypes": "course_lib.chapters.ch02.autocast_dtypes",
    "course_lib.chapters.scaler": "course_lib.chapters.ch03.scaler",
    "course_lib.chapters.accumulation": "course_lib.chapters.ch04.accumulation",
    "course_lib.chapters.multi": "course_lib.chapters.ch05.multi",
    "course_lib.chapters.profiling": "course_lib.chapters.ch06.profiling",
    "course_lib.chapters.loading": "course_lib.chapters.ch07.loading",
    "course_lib.chapters.distributed": "course_lib.chapters.ch08.distributed",
    "course_lib.chapters.ladder": "course_lib.chapters.ch09.ladder",
    # issue 45: tools/gpu_study.py's studies moved into the chapters that read them
    "tools/gpu_study.py questions": "course_lib.chapters.ch09.record_questions",
    "tools/gpu_study.py memory": "course_lib.chapters.ch10.record_memory",
    "tools/gpu_study.py roofline": "course_lib.chapters.ch11.record_roofline",
    "tools/gpu_study.py fp8gpt": "course_lib.chapters.ch11.record_fp8",
}


def invocation(name: str) -> str:
    """`python <this>` runs `name`: a script by its path, a module with -m."""
    return name if name.split()[0].endswith(".py") else f"-m {name}"


def current_command(command: str) -> str | None:
    """The command as it runs now, if its module moved since it was recorded (else None)."""
    for old, new in MOVED.items():
        was = f"python {invocation(old)}"
        if f"{command} ".startswith(f"{was} "):
            return f"python {invocation(new)}{command[len(was) :]}"
    return None


def code_of(command: str) -> dict:
    """The code that ran `command`: the course's commit, the file the command runs, its git blob id."""
    return commit() | source(command)


def commit() -> dict:
    """The course's git commit, noted if course_lib/ or tools/ differed from it; in a tree that is not
    a git checkout (a copy, as on an offline GPU machine), None and why, or COURSE_COMMIT, unchecked."""
    git = ["git", f"--git-dir={ROOT / '.git'}", f"--work-tree={ROOT}"]  # this tree's own repository, no other
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True)
        changed = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", "course_lib", "tools"], timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git, no repository here, or not this tree's
        given = os.environ.get("COURSE_COMMIT")
        return {"commit": given, "commit_note": "not a git checkout" + (": COURSE_COMMIT, unchecked" if given else "")}
    return {"commit": head.stdout.strip()} | ({"commit_note": "uncommitted changes"} if changed.returncode else {})


def source(command: str) -> dict:
    """The file `python -m module ...` or `python path.py ...` runs, and its git blob id (what `git
    hash-object` prints): `git log --all --find-object=<id>` names the commits that hold it, in any
    clone, so a result recorded in a copied tree still finds its code. {} for another command."""
    words = command.split()
    try:
        path = ROOT / words[1] if words[1].endswith(".py") else Path(importlib.util.find_spec(words[2]).origin)
        name, code = path.resolve().relative_to(ROOT).as_posix(), path.read_bytes()
    except (AttributeError, ImportError, IndexError, OSError, TypeError, ValueError):
        return {}
    return {"source": name, "source_blob": hashlib.sha1(b"blob %d\0" % len(code) + code).hexdigest()}
