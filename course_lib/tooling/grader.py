"""The batch grader: a folder of submitted notebooks in, a gradebook out.

    python -m course_lib.tooling.grader SUBMISSIONS --out GRADEBOOK [--jobs N]      (make grade)

For every submission, this process draws fresh inputs for each task of its chapter, runs the
notebook and then the learner's functions in a sandbox (course_lib.tooling.sandbox), and judges
the plain-data answers that come back against references it computes itself
(course_lib.tooling.grading). What defends what is written in the README, "For instructors".

- The file name is the slot: `NN_...ipynb` is graded with chapter NN's checks, whatever its
  metadata says. A student's second notebook for the same chapter is listed as a duplicate.
- Nothing earned is lost: each task's row is appended to GRADEBOOK/gradebook.jsonl (and synced)
  the moment it is judged, so a crash, hang or interrupt later in the notebook costs only the
  tasks not judged yet. gradebook.csv and gradebook.json are rewritten after every submission.
- Resumable: a rerun skips submissions already finished in gradebook.jsonl; if the grader itself
  is killed, at most the submissions in flight are graded again (--restart starts afresh).
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

from . import sandbox, source_rules
from .grading import Check, checks_for
from .runner import Attempt, Faults, code_cells, run_submission

__all__ = ["grade_folder", "grade_or_record", "find_submissions", "main", "CourseChanged"]

ROOT = Path(__file__).resolve().parents[2]
CSV_FIELDS = ("student", "notebook", "exercise", "points", "max_points", "passed", "status", "message")
ADDRESS_SPACE_SLACK = 16 * 2**30  # bytes of address space per process beyond the memory cap


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


def _row(sub: Submission, check: Check | None, passed: bool, status: str, message: str) -> dict:
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
    }


def _text(message: str, limit: int = 2000) -> str:
    """A message fit for the gradebook: of bounded length, and UTF-8 (a kernel's lone surrogate is not)."""
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
    cell_timeout: float = 60
    total_timeout: float = 900
    memory_gb: float = 6
    level: str = "namespaces"
    workspace: Path = Path(tempfile.gettempdir())  # this run's sandboxes and learner library live here
    library: Path = Path()  # the learner library (sandbox.learner_library)
    hidden: tuple[Path, ...] = ()  # folders a sandbox must never see: submissions, gradebook


def grade_submission(sub: Submission, opts: Options, book: Gradebook, digest: str) -> list[dict]:
    """Grade one notebook; every judged task is recorded as soon as it is judged. Returns its rows."""
    if not _unchanged(opts.library, digest):  # another submission changed the course: grade nothing more
        raise CourseChanged(f"the course's files changed before {sub.notebook} was graded")
    run = secrets.token_hex(8)
    rows: list[dict] = []

    def emit(check: Check | None, status: str, message: str) -> None:
        row = _row(sub, check, status == "passed", status, message)
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
    if not _unchanged(opts.library, digest):  # only at the session level: the namespaces make it read-only
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
    try:
        cells = code_cells(sub.path)  # reading JSON is safe in this process; running the notebook is not
    except Exception as e:
        for c in checks:
            emit(c, "not graded", f"the file is not a readable notebook ({type(e).__name__}: {str(e)[:150]})")
        return
    checks = judge_from_source(cells, checks, emit)
    if not checks:
        return
    rng = random.Random(secrets.randbits(64))
    cases = {c.name: c.cases(rng) for c in checks}  # they stay here: the kernel sees one task's public part
    box = Path(tempfile.mkdtemp(prefix="box-", dir=opts.workspace))
    token = secrets.token_hex(12)
    try:
        env = sandbox.environment(box, token, {}, opts.library)
        if opts.level == "namespaces":
            env.update(sandbox.namespace_env(box, opts.library, [opts.workspace, *opts.hidden]))
        shutil.copy(sub.path, box / "work" / sub.path.name)
        memory = int(opts.memory_gb * 2**30)  # resident, all its processes together: sandbox.MemoryWatch
        limits = {
            # Address space only as a far backstop (torch alone reserves ~3 GB of it), none with CUDA (far more)
            "as": 0 if _cuda_visible() else memory + ADDRESS_SPACE_SLACK,
            "cpu": int(opts.total_timeout * 2),
        }

        def start(faults: Faults) -> Attempt:
            return Attempt(box, opts.level, env, box / "kernel.log", faults, limits, memory)

        faults = run_submission(
            box / "work" / sub.path.name,
            checks,
            cases,
            start,
            opts.cell_timeout,
            time.monotonic() + opts.total_timeout,
            emit,
        )
        if os.environ.get("AMP_GRADER_DEBUG"):
            # one write per line: print() writes its parts one by one, and the jobs' threads interleave them
            sys.stderr.write(f"{sub.notebook} {json.dumps(faults.outcomes)}\n")
            sys.stderr.flush()
    finally:
        shutil.rmtree(box, ignore_errors=True)


def judge_from_source(cells: list[str], checks: list[Check], emit) -> list[Check]:
    """What the grader decides from the notebook's source, in its own process, before its kernel runs
    (course_lib/tooling/source_rules.py); returns the checks left for the kernel to answer.

    Code that could reach into the grading code in the kernel: no task is graded automatically. A
    task whose function is still the stub: not attempted. A task whose function reaches a module the
    task forbids: failed. Nothing the kernel does later can change these."""
    if os.environ.get("AMP_GRADER_NO_SOURCE_READING") == "1":  # tests of the defences beneath the reading
        return checks
    nb = source_rules.read(cells)
    reaching = source_rules.reaching_code(nb)
    if reaching:
        first, more = reaching[0], len(reaching) - 1
        also = f" (and {more} more place{'s' if more > 1 else ''})" if more else ""
        for c in checks:
            emit(
                c,
                "not graded",
                f"{first.where()} uses {first.what}{also}: code that can read or rewrite the grader's own code "
                "inside your notebook's Python process, so this notebook is not graded automatically. Remove it "
                "and resubmit, or ask your instructor to grade it by hand",
            )
        return []
    left = []
    for c in checks:
        stubs = source_rules.stub_tasks(nb, c.args)
        found = source_rules.forbidden_use(nb, c.args, tuple(c.forbidden))
        if stubs:
            emit(
                c,
                "not attempted",
                f"not attempted yet: `{stubs[0]}` is still the exercise's stub (NotImplementedError)",
            )
        elif found is not None:
            emit(
                c,
                "failed",
                f"{c.args[0]} uses {found.what} ({found.where()}), which this task asks you not to use"
                + (f": {c.forbidden_why}" if c.forbidden_why else ""),
            )
        else:
            left.append(c)
    return left


def _cuda_visible() -> bool:
    if "torch" not in sys.modules:
        return False
    import torch  # another thread may be importing it (a chapter's checks): this waits until it is whole

    return bool(torch.cuda.is_available())


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
            "grader: each submission runs in its own namespaces: no network, no other processes, "
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
    opts = Options(
        cell_timeout,
        total_timeout,
        memory_gb,
        level,
        workspace,
        library,
        (Path(submissions).resolve(), Path(out_dir).resolve()),
    )
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


if __name__ == "__main__":
    sys.exit(main())
