"""Keep a learner's outputs out of git: the clean filter `make lab` sets up, and `make update`.

Running a chapter writes its outputs into the tracked notebook: git would call the file modified
and `git pull` would refuse an update that touches it. As nbstripout does, `make lab` makes this
script git's *clean filter* for notebooks/, exercises/ and solutions/ (in .git/config and
.git/info/attributes: no tracked file changes). Git reads each of those notebooks through it and
sees what the course commits: no outputs, except those of the cells tagged nbval-check-output that
the tests compare (course_lib/tooling/nbtools.py), no execution counts, widget state, timings or
Python version. The file on disk keeps everything the learner ran.

Git reads a file's content only when its size or time differ from what the index recorded, and
it takes a new size for a change without asking the filter. `refresh` therefore resets that
record (the index keeps the committed blob) for the notebooks that differ, so that git compares
them through the filter: JupyterLab does it after each save (course_lib/tooling/lab.py) and
`make update` before it pulls. `git status` then lists a notebook only when its cells changed (an
exercise's answers), and `git pull` updates a chapter that was only run (its outputs go).

Standard library only: git starts it for every notebook it reads. Anything that is not a
notebook passes through unchanged, and a checkout where it is not configured is plain git.

    python3 course_lib/tooling/notebook_filter.py clean < notebooks/00_setup.ipynb  # what git runs
    python3 course_lib/tooling/notebook_filter.py install [DIR]     # make lab: configure the checkout holding DIR
    python3 course_lib/tooling/notebook_filter.py refresh [PATH...]  # let git compare these notebooks again
    python3 course_lib/tooling/notebook_filter.py update [DIR]      # make update: install, refresh, git pull
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["clean", "clean_notebook", "dumps", "install", "refresh", "update", "configured", "top_of"]

NAME = "amp-course-outputs"
FOLDERS = ("notebooks", "exercises", "solutions")
PATTERNS = tuple(f"/{folder}/*.ipynb filter={NAME}" for folder in FOLDERS)
CHECK_TAG = "nbval-check-output"  # as course_lib/tooling/nbtools.py
# A live widget's view, as course_lib.chapters.ch01.widgets.WIDGET_VIEW: defined again here, as git runs this
# file as a script (`python -I -S`), outside the package; the rest of tooling imports it from here.
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# Cell metadata that running or looking writes: timings, collapsed or scrolled outputs, nbformat's transient key.
VIEW_STATE = ("execution", "ExecuteTime", "collapsed", "scrolled", "trusted")
SCRIPT = "course_lib/tooling/notebook_filter.py"
# Git runs a filter with sh in the checkout's top folder. Without this script (an old commit
# checked out) git reads files unfiltered; the course's venv, or else any python3, runs it.
COMMAND = (
    f"if test -f {SCRIPT}; then p=.venv/bin/python; test -x $p || p=python3; exec $p -I -S {SCRIPT} clean; "
    "else exec cat; fi"
)


# --------------------------------------------------------------------------- the filter


def clean_notebook(nb: dict) -> dict:
    """What the course commits of a notebook (in place): outputs only where nbval compares them."""
    meta = nb.setdefault("metadata", {})
    meta.pop("widgets", None)  # JupyterLab's saved widget state: the views it describes are dropped below
    meta.pop("signature", None)
    if isinstance(meta.get("language_info"), dict):
        meta["language_info"].pop("version", None)  # the reader's Python, not the course's (lab.py)
    for cell in nb.get("cells", []):
        cell_meta = cell.setdefault("metadata", {})
        for key in VIEW_STATE:
            cell_meta.pop(key, None)
        if isinstance(cell_meta.get("jupyter"), dict):
            cell_meta["jupyter"].pop("outputs_hidden", None)
            if not cell_meta["jupyter"]:
                del cell_meta["jupyter"]
        if isinstance(cell.get("source"), str):
            cell["source"] = cell["source"].splitlines(True)
        if cell.get("cell_type") != "code":
            continue
        if CHECK_TAG not in cell_meta.get("tags", []):
            cell["outputs"], cell["execution_count"] = [], None
            continue
        kept = []
        for out in _coalesced(cell.get("outputs", [])):
            data = out.get("data")
            if isinstance(data, dict):
                data.pop(WIDGET_VIEW, None)
                if not data:
                    continue  # a widget with nothing else to show
                for mime, value in data.items():
                    if isinstance(value, str) and (mime.startswith("text/") or mime == "image/svg+xml"):
                        data[mime] = value.splitlines(True)
            if isinstance(out.get("text"), str):
                out["text"] = out["text"].splitlines(True)
            if "execution_count" in out:
                out["execution_count"] = 1
            kept.append(out)
        cell["outputs"] = kept
        if kept:
            cell["execution_count"] = 1  # the stored count, whatever the run's was
    return nb


def _coalesced(outputs: list) -> list:
    """Consecutive prints to one stream become one output, as JupyterLab shows and saves them."""
    merged: list = []
    for out in outputs:
        last = merged[-1] if merged else {}
        if out.get("output_type") == "stream" == last.get("output_type") and out.get("name") == last.get("name"):
            last["text"] = _joined(last.get("text", "")) + _joined(out.get("text", ""))
        else:
            merged.append(out)
    return merged


def _joined(text: str | list) -> str:
    return "".join(text) if isinstance(text, list) else text


def dumps(nb: dict) -> str:
    """The bytes nbformat and JupyterLab write for a notebook (nbformat.writes, plus the final newline)."""
    return json.dumps(nb, indent=1, sort_keys=True, separators=(",", ": "), ensure_ascii=False) + "\n"


def clean(raw: bytes) -> bytes:
    """The filter: a notebook as the course commits it; anything else unchanged."""
    try:
        nb = json.loads(raw.decode("utf-8"))
        if not (isinstance(nb, dict) and nb.get("nbformat") == 4 and isinstance(nb.get("cells"), list)):
            return raw
        return dumps(clean_notebook(nb)).encode("utf-8")
    except Exception:  # a half-written or foreign file: git gets it as it is
        return raw


# --------------------------------------------------------------------------- git


def _git(where: Path, *args: str, stdin: str | None = None) -> str | None:
    """git's output, or None where git fails (no git, not a checkout)."""
    try:
        done = subprocess.run(["git", "-C", str(where), *args], input=stdin, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def top_of(where: Path) -> Path | None:
    """The top folder of the git checkout holding `where`, or None."""
    top = _git(where, "rev-parse", "--show-toplevel")
    return Path(top.strip()) if top else None


def configured(top: Path) -> bool:
    return bool(_git(top, "config", "--get", f"filter.{NAME}.clean"))


def install(where: Path) -> str:
    """Configure the checkout holding `where`: the filter's command and which files it reads. Idempotent."""
    top = top_of(where)
    if top is None:
        return f"{where} is not a git checkout: the notebooks' outputs are not kept out of git"
    if not (top / SCRIPT).is_file():
        return f"{top} has no {SCRIPT}: not configured"
    _git(top, "config", f"filter.{NAME}.clean", COMMAND)
    attributes = top / _git(top, "rev-parse", "--git-path", "info/attributes").strip()
    lines = attributes.read_text().splitlines() if attributes.exists() else []
    missing = [p for p in PATTERNS if p not in lines]
    if missing:
        attributes.parent.mkdir(parents=True, exist_ok=True)
        head = ["# amp-course (make lab): git reads notebooks without their outputs, see " + SCRIPT]
        attributes.write_text("\n".join([*lines, *([] if head[0] in lines else head), *missing]) + "\n")
    refresh(top)
    return f"git: notebooks are read without their outputs (filter {NAME}, {SCRIPT})"


def refresh(top: Path, paths: list[str] | None = None) -> list[str]:
    """Let git compare these notebooks (default: all the course's) through the filter again; return them.

    Only notebooks whose file no longer matches the index's record are touched, and only that
    record: the staged content stays what it was, so an answer is never staged behind the
    learner's back."""
    if not configured(top):
        return []
    differ = _git(top, "diff-files", "--name-only", "-z", "--", *(paths or FOLDERS)) or ""
    names = [n for n in differ.split("\0") if n.endswith(".ipynb")]
    entries = (_git(top, "ls-files", "--stage", "-z", "--", *names) or "").split("\0") if names else []
    entries = [e for e in entries if e and e.split("\t", 1)[0].split()[-1] == "0"]  # not while a merge is open
    if entries:
        _git(top, "update-index", "-z", "--index-info", stdin="\0".join(entries) + "\0")
    return [e.split("\t", 1)[1] for e in entries]


def update(where: Path) -> int:
    """make update: configure, refresh, then git pull; say what to do when git refuses."""
    print(install(where))
    top = top_of(where)
    if top is None:
        return 1
    refresh(top)
    code = subprocess.run(["git", "-C", str(top), "pull"]).returncode
    if code:
        print(
            "\ngit pull stopped (above: why). If it names an exercise you answered, keep your answers\n"
            "aside and pull again: git stash && make update && git stash pop (README: Updating the course)."
        )
    return code


def main(argv: list[str]) -> int:
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    if command == "clean":
        sys.stdout.buffer.write(clean(sys.stdin.buffer.read()))
        return 0
    if command == "install":
        print(install(Path(args[0] if args else os.getcwd())))
        return 0
    if command == "refresh":
        top = top_of(Path(args[0]).parent if args else Path.cwd())
        if top is not None:
            relative = [os.path.relpath(Path(p).resolve(), top) for p in args]
            for name in refresh(top, relative or None):
                print("git compares again:", name)
        return 0
    if command == "update":
        return update(Path(args[0] if args else os.getcwd()))
    print("usage:\n" + "\n".join(__doc__.strip().splitlines()[-4:]), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
