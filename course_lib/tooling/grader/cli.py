"""The batch grader: a folder of submitted notebooks in, a gradebook and a class view out.

    python -m course_lib.tooling.grader SUBMISSIONS --out GRADEBOOK [--jobs N]      (make grade)

For every submission, this process reads the notebook, draws fresh inputs for each task of its
chapter, and judges each task in a task process of its own (course_lib/tooling/grader/wire.py):
a fresh sandbox that runs only the statements the task's functions need, with the task's forbidden
modules absent, then the learner's functions on the inputs; the plain-data answers are judged here
against references computed here. What holds and what does not: docs/grading.md.

- The file name is the slot: `NN_...ipynb` is graded with chapter NN's checks, whatever its
  metadata says. A student's second notebook for the same chapter is listed as a duplicate.
- Nothing earned is lost: each task's row is appended to GRADEBOOK/gradebook.jsonl (and synced)
  the moment it is judged, so a crash, hang or interrupt later in the notebook costs only the
  tasks not judged yet. gradebook.csv and gradebook.json are rewritten after every submission.
- Resumable: a rerun skips submissions already finished in gradebook.jsonl; if the grader itself
  is killed, at most the submissions in flight are graded again (--restart starts afresh).
- Nothing a notebook does for itself costs it a grade: shell lines, magics, configuration, modules
  the tasks do not need. What the grader noticed goes in the `notes` column, for the instructor.
- After the run: GRADEBOOK/class.csv and class.html, per task: passed, failed, not attempted and the
  most common failure messages (course_lib/tooling/grader/classview.py).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from .. import slicing
from ..checkbase import Check
from ..checks import checks_for
from . import classview, sandbox
from .wire import Sandboxes, default_limits, judge_task

__all__ = ["grade_folder", "grade_or_record", "find_submissions", "code_cells", "main", "CourseChanged"]

ROOT = Path(__file__).resolve().parents[3]
CSV_FIELDS = ("student", "notebook", "exercise", "points", "max_points", "passed", "status", "message", "notes")


def code_cells(path: Path) -> list[str]:
    """The code cells' sources of a notebook file (nbformat 4), read as plain JSON."""
    cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    sources = [c["source"] for c in cells if isinstance(c, dict) and c.get("cell_type") == "code"]
    return ["".join(s) if isinstance(s, list) else str(s) for s in sources]


@dataclass(frozen=True)
class Submission:
    path: Path
    notebook: str  # path relative to the submissions folder: the submission's identity
    student: str
    chapter: str | None  # from the file name only
    counted_instead: str | None = None  # set for a duplicate: the notebook graded in its place


def find_submissions(folder: Path) -> list[Submission]:
    """Every notebook under `folder`: submissions/alice/01_x.ipynb is alice's; a flat alice.ipynb too."""
    folder = Path(folder)
    paths = sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts and p.is_file())
    subs = []
    for p in paths:
        rel = p.relative_to(folder)
        m = re.match(r"(\d{2})_", p.name)
        subs.append(
            Submission(p, rel.as_posix(), rel.parts[0] if len(rel.parts) > 1 else p.stem, m.group(1) if m else None)
        )
    official = {p.name for p in (ROOT / "exercises").glob("*.ipynb")}
    by_slot: dict[tuple[str, str], list[Submission]] = {}
    for s in subs:
        if s.chapter:
            by_slot.setdefault((s.student, s.chapter), []).append(s)
    out = []
    for s in subs:
        group = by_slot.get((s.student, s.chapter), [s])
        winner = next((g for g in group if g.path.name in official), group[0])
        out.append(s if s is winner else Submission(s.path, s.notebook, s.student, s.chapter, winner.notebook))
    return out


def _row(sub: Submission, check: Check | None, passed: bool, status: str, message: str, notes: str = "") -> dict:
    points = check.points if check else 0
    return {
        "student": sub.student,
        "notebook": sub.notebook,
        "exercise": check.name if check else "",
        "points": points if passed else 0,
        "max_points": points,
        "passed": passed,
        "status": status,
        "message": _text(message),
        "notes": _text(notes, 4000),
    }


def _text(message: str, limit: int = 2000) -> str:
    """A message fit for the gradebook: of bounded length, and UTF-8 (a task process's lone surrogate is not)."""
    text = str(message)
    text = text if len(text) <= limit else text[:limit] + " …"
    return text.encode("utf-8", "replace").decode("utf-8")


class CourseChanged(RuntimeError):
    """The course's own files changed: nothing more may be graded on this checkout (the run stops)."""


class Gradebook:
    """gradebook.jsonl is the record: one line per judged task, then one 'done' line per submission."""

    def __init__(self, out_dir: Path, restart: bool) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.journal = self.out_dir / "gradebook.jsonl"
        if restart and self.journal.exists():
            self.journal.unlink()
        self.lock = threading.Lock()
        pending: dict[str, list[dict]] = {}
        self.finished: dict[str, list[dict]] = {}
        for line in self.journal.read_text().splitlines() if self.journal.exists() else []:
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut short by a killed grader
            key = (entry.get("submission"), entry.get("run"))
            if entry.get("kind") == "row":
                pending.setdefault(json.dumps(key), []).append(entry["row"])
            elif entry.get("kind") == "done":
                self.finished[entry["submission"]] = pending.pop(json.dumps(key), [])

    def _append(self, entry: dict) -> None:
        with self.lock, open(self.journal, "a") as f:
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def record(self, sub: Submission, run: str, row: dict) -> None:
        self._append({"kind": "row", "submission": sub.notebook, "run": run, "row": row})

    def finish(self, sub: Submission, run: str, rows: list[dict]) -> None:
        self._append({"kind": "done", "submission": sub.notebook, "run": run})
        with self.lock:
            self.finished[sub.notebook] = rows
            self._write_tables()

    def _write_tables(self) -> None:
        rows = [r for sub in sorted(self.finished) for r in self.finished[sub]]
        tmp = self.out_dir / ".gradebook.csv.tmp"
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.out_dir / "gradebook.csv")
        tmp = self.out_dir / ".gradebook.json.tmp"
        tmp.write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, self.out_dir / "gradebook.json")


def _course_digest(library: Path | None = None) -> str:
    """A hash of what a submission must never change: the library, the shipped data, the config,
    and the learner library that every sandbox of this run shares."""
    h = hashlib.sha256()
    for top in [ROOT] + ([Path(library)] if library else []):
        files = sorted(
            [
                *(top / "course_lib").rglob("*.py"),
                *(top / "data").glob("*.npz"),
                *(top / "extra_probes").glob("*.py"),
                top / "pyproject.toml",
            ]
        )
        for p in files:
            if p.exists():
                h.update(p.relative_to(top).as_posix().encode())
                h.update(p.read_bytes())
    return h.hexdigest()


@dataclass(frozen=True)
class Options:
    cell_timeout: float = 60  # seconds each statement a task needs may run (while the task process loads it)
    total_timeout: float = 900  # seconds per submission, a backstop
    boxes: Sandboxes | None = None  # how task processes start (level, learner library, limits)


def grade_submission(sub: Submission, opts: Options, book: Gradebook, digest: str) -> list[dict]:
    """Grade one notebook; every judged task is recorded as soon as it is judged. Returns its rows."""
    library = opts.boxes.library
    if not _unchanged(library, digest):  # another submission changed the course: grade nothing more
        raise CourseChanged(f"the course's files changed before {sub.notebook} was graded")
    run = secrets.token_hex(8)
    rows: list[dict] = []

    def emit(check: Check | None, status: str, message: str, notes: str = "") -> None:
        row = _row(sub, check, status == "passed", status, message, notes)
        rows.append(row)
        book.record(sub, run, row)

    try:
        checks = checks_for(sub.chapter) if sub.chapter else []
    except Exception as e:
        checks, problem = [], f"the checks of chapter {sub.chapter} could not be loaded: {e}"
    else:
        problem = (
            ""
            if checks
            else (
                f"there are no checks for chapter {sub.chapter}"
                if sub.chapter
                else "the file name does not say which exercise this is: name it NN_....ipynb, "
                "e.g. 01_formats_exercises.ipynb"
            )
        )
    if sub.counted_instead:
        for c in checks:
            emit(
                c, "duplicate", f"another notebook of yours for chapter {sub.chapter} is graded: {sub.counted_instead}"
            )
    elif problem:
        emit(None, "not graded", problem)
    else:
        try:
            _run_in_sandbox(sub, checks, opts, emit)
        except Exception as e:  # noqa: BLE001  the grader's own failure on this notebook: the batch goes on
            _report_failure(sub, e)
            judged = {r["exercise"] for r in rows}
            for c in checks:
                if c.name not in judged:  # the tasks judged before it keep their grades
                    emit(c, "not graded", _failed_message(e))
    if not _unchanged(library, digest):  # only at the session level: the namespaces make it read-only
        rows = [
            {
                **r,
                "points": 0,
                "passed": False,
                "status": "failed",
                "message": "this notebook changed the course's own files; its points are withdrawn",
            }
            for r in rows
        ]
        for row in rows:
            book.record(sub, run, row)
        book.finish(sub, run, rows)
        raise CourseChanged(
            f"the course's files changed while {sub.notebook} was graded: restore them "
            "(git checkout -- course_lib data), then grade in a container"
        )
    book.finish(sub, run, rows)
    return rows


def _unchanged(library: Path, digest: str) -> bool:
    """The course's files are as they were (a file made unreadable counts as changed)."""
    try:
        return _course_digest(library) == digest
    except OSError:
        return False


def _failed_message(e: BaseException) -> str:
    try:
        what = f"{type(e).__name__}: {e}"[:160]
    except Exception:  # noqa: BLE001  an exception with a broken __str__
        what = type(e).__name__
    return (
        f"the grader itself failed on this notebook ({what}). This is no judgement of your work: "
        "your instructor can grade it again (rerun the grader with --restart, or remove this notebook's lines "
        "from gradebook.jsonl and rerun)"
    )


def _report_failure(sub: Submission, e: BaseException) -> None:
    """Tell the instructor, on stderr, what failed: the gradebook row tells the student."""
    lines = traceback.format_exception(e)
    print(
        f"grader: {sub.notebook}: the grader failed on it and recorded it as not graded; the run goes on:\n"
        + "".join(lines[:4] + (["  ...\n"] if len(lines) > 8 else []) + lines[-4:])[-4000:],
        file=sys.stderr,
        flush=True,
    )


def grade_or_record(sub: Submission, opts: Options, book: Gradebook, digest: str) -> list[dict]:
    """grade_submission, where the grader's own failure on this one notebook becomes its rows ('not
    graded', marked done, so a rerun does not stop on it again) instead of the end of the run. Only
    a changed course (CourseChanged) stops the run."""
    try:
        return grade_submission(sub, opts, book, digest)
    except CourseChanged:
        raise
    except Exception as e:  # noqa: BLE001
        _report_failure(sub, e)
        try:
            checks = checks_for(sub.chapter) if sub.chapter else []
        except Exception:  # noqa: BLE001
            checks = []
        run = secrets.token_hex(8)
        rows = [_row(sub, c, False, "not graded", _failed_message(e)) for c in checks or [None]]
        for row in rows:
            book.record(sub, run, row)
        book.finish(sub, run, rows)
        return rows


def _run_in_sandbox(sub: Submission, checks: list[Check], opts: Options, emit) -> None:
    """Each task judged in a task process of its own (wire.judge_task); habits noted, never graded."""
    try:
        cells = code_cells(sub.path)  # reading JSON is safe in this process; running the notebook is not
    except Exception as e:
        for c in checks:
            emit(c, "not graded", f"the file is not a readable notebook ({type(e).__name__}: {str(e)[:150]})")
        return
    nb = slicing.read(cells)
    habits = [f"{note} (noticed, not graded)" for note in nb.habits[:12]]
    if len(nb.habits) > 12:
        habits.append(f"and {len(nb.habits) - 12} more shell lines or magics")
    rng = random.Random(secrets.randbits(64))
    cases = {c.name: c.cases(rng) for c in checks}  # they stay here: a task process sees one task's public part
    deadline = time.monotonic() + opts.total_timeout
    for check in checks:
        if time.monotonic() > deadline:
            emit(check, "timed out", "your notebook ran past the total time limit before this task was checked")
            continue
        try:
            verdict = judge_task(check, nb, cases[check.name], opts.boxes, opts.cell_timeout, deadline)
        except OSError as e:  # a task process that could not start: the grader's trouble, not the notebook's
            _report_failure(sub, e)
            emit(check, "not graded", "the grader could not start a process for this task: tell your instructor "
                 "(the grader's log has the details)")  # fmt: skip
            continue
        emit(check, verdict.status, verdict.message, "; ".join(habits + verdict.notes))
    if os.environ.get("AMP_GRADER_DEBUG"):
        # one write per line: print() writes its parts one by one, and the jobs' threads interleave them
        sys.stderr.write(f"{sub.notebook} judged {len(checks)} task(s)\n")
        sys.stderr.flush()


def choose_level(requested: str) -> str:
    """'namespaces' where this machine allows it; 'session' (and a warning) where it does not."""
    if requested in ("auto", "namespaces") and sandbox.available():
        return "namespaces"
    if requested == "namespaces":
        raise RuntimeError("--isolation namespaces: this machine cannot create user namespaces with unshare")
    return "session"


def grade_folder(
    submissions: Path,
    out_dir: Path,
    *,
    jobs: int = 2,
    cell_timeout: float = 60,
    total_timeout: float = 900,
    memory_gb: float = 6,
    isolation: str = "auto",
    restart: bool = False,
) -> list[dict]:
    """Grade every notebook under `submissions` into out_dir/gradebook.{jsonl,csv,json}; returns all rows."""
    started = time.monotonic()
    level = choose_level(isolation)
    if level == "namespaces":
        print(
            "grader: each task runs in its own namespaces: no network, no other processes, "
            "every file read-only except its sandbox"
        )
    else:
        why = "as asked (--isolation session)" if isolation == "session" else "this machine cannot create namespaces"
        print(
            f"grader: WARNING: no namespace isolation ({why}): a submission could read and write your files and "
            "signal your processes. Every process it starts is still killed and the course's files are checked "
            "after each one. Grade untrusted submissions this way only in a container or VM."
        )
    workspace = Path(tempfile.mkdtemp(prefix="amp-grade-"))
    library = sandbox.learner_library(workspace)
    memory = int(memory_gb * 2**30)  # resident, all of a task's processes together: sandbox.MemoryWatch
    hidden = (Path(submissions).resolve(), Path(out_dir).resolve())
    boxes = Sandboxes(level, workspace, library, hidden, memory, default_limits(memory, int(total_timeout * 2)))
    opts = Options(cell_timeout, total_timeout, boxes)
    book = Gradebook(out_dir, restart)
    subs = find_submissions(submissions)
    todo = [s for s in subs if s.notebook not in book.finished]
    if len(todo) < len(subs):
        print(f"grader: resuming: {len(subs) - len(todo)} of {len(subs)} submissions already graded in {book.journal}")
    digest = _course_digest(library)
    pool = ThreadPoolExecutor(max(1, jobs))
    try:
        for fut in as_completed([pool.submit(grade_or_record, s, opts, book, digest) for s in todo]):
            fut.result()  # a changed checkout stops the run here, loudly
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # nothing more is graded on a changed checkout
        shutil.rmtree(workspace, ignore_errors=True)
    rows = [r for s in subs for r in book.finished.get(s.notebook, [])]
    _print_summary(subs, book, time.monotonic() - started, Path(out_dir))
    print(classview.write(rows, Path(out_dir)))
    return rows


def _print_summary(subs: list[Submission], book: Gradebook, seconds: float, out_dir: Path) -> None:
    width = max([len(s.notebook) for s in subs] + [8])
    print(f"{'student':<16} {'notebook':<{width}}  {'points':>7}  tasks")
    for s in subs:
        rows = book.finished.get(s.notebook, [])
        statuses: dict[str, int] = {}
        for r in rows:
            statuses[r["status"]] = statuses.get(r["status"], 0) + 1
        pts = f"{sum(r['points'] for r in rows)}/{sum(r['max_points'] for r in rows)}"
        print(
            f"{s.student[:16]:<16} {s.notebook:<{width}}  {pts:>7}  "
            + ", ".join(f"{n} {k}" for k, n in statuses.items())
        )
    print(f"{len(subs)} submission(s) in {seconds:.0f} s -> {out_dir / 'gradebook.csv'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m course_lib.tooling.grader", description="grade a folder of submitted exercise notebooks"
    )
    p.add_argument("submissions", type=Path)
    p.add_argument("--out", type=Path, default=Path("gradebook"))
    p.add_argument("--jobs", type=int, default=2, help="submissions graded at once (default 2)")
    p.add_argument("--cell-timeout", type=float, default=60, help="seconds per notebook cell (default 60)")
    p.add_argument("--total-timeout", type=float, default=900, help="seconds per submission, a backstop")
    p.add_argument("--memory-gb", type=float, default=6, help="GiB of resident memory per submission (default 6)")
    p.add_argument("--isolation", choices=["auto", "namespaces", "session"], default="auto")
    p.add_argument("--restart", action="store_true", help="forget gradebook.jsonl and grade everything again")
    args = p.parse_args(argv)
    if not args.submissions.is_dir():
        p.error(f"{args.submissions} is not a folder of submissions")
    # A thread answering a timing task's ask waits for the GIL while another grades: 1 ms, not 5 ms, a turn
    sys.setswitchinterval(0.001)
    if args.jobs > 1:  # task processes side by side: OpenMP threads that spin while they wait slow both 2.5x
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        grade_folder(
            args.submissions,
            args.out,
            jobs=args.jobs,
            cell_timeout=args.cell_timeout,
            total_timeout=args.total_timeout,
            memory_gb=args.memory_gb,
            isolation=args.isolation,
            restart=args.restart,
        )
    except RuntimeError as e:
        print(f"grader: stopped: {e}", file=sys.stderr)
        return 2
    return 0
