"""Exercises and grading: the inline check(), exercise generation and the batch grader.

The learner's side: every exercise cell ends with `check("00.name", obj)`,
which prints one line, pass or fail with a hint. The checks live in course_lib/tooling/checks/chNN.py
(so they work on Colab, where there is no repository checkout) and test behaviour on fresh
random inputs, so a hard-coded answer fails.

The instructor's side:
  python -m course_lib.tooling.grading generate [--check]     solutions/ -> exercises/ (make exercises)
  python -m course_lib.tooling.grading grade SUBMISSIONS       gradebook.csv + gradebook.json (make grade)

The grader never runs learner code in its own process: each submission runs in a child
process (`run-one`) that drives a fresh kernel, and the child is killed with its whole
process group (and the kernel's) when the total time limit passes. This protects against
accidents (crashes, hangs, megabytes of output, a redefined `check`), not against a learner
who sets out to cheat with arbitrary code: run untrusted submissions in a container.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import inspect
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = ["CheckFailure", "register", "check", "get_check", "checks_for", "exercise_text", "generate",
           "grade_notebook", "grade_folder"]

# nbformat / nbclient are imported inside the functions that need them: `check()` runs in
# every exercise notebook and should cost nothing but this module.

ROOT = Path(__file__).resolve().parents[2]
STUB = 'raise NotImplementedError("Exercise: write your solution here")'
MD_STUB = "_Your answer here._"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
MD_BEGIN, MD_END = "<!-- BEGIN SOLUTION -->", "<!-- END SOLUTION -->"
OUTPUT_CAP = 1_000_000  # bytes of cell output kept per submission; the rest is counted and dropped
NAME_RE = re.compile(r"^(\d{2})\.[A-Za-z0-9_]+$")
CSV_FIELDS = ("student", "notebook", "exercise", "points", "max_points", "passed", "status", "message")


# --------------------------------------------------------------------------- checks

class CheckFailure(AssertionError):
    """Raised by a check; its message is shown to the learner as it is."""


@dataclass(frozen=True)
class Check:
    """One registered check. `args` name the notebook globals it grades, in order."""
    name: str
    fn: Callable[..., None]
    args: tuple[str, ...]
    points: int
    hint: str
    chapter: str


_REGISTRY: dict[str, Check] = {}  # insertion order = the order checks are graded and listed


def register(name: str, *, args: tuple[str, ...], points: int = 1, hint: str = "") -> Callable:
    """Decorator for a check in course_lib/tooling/checks/chNN.py.

    The check is called as fn(*objects) and returns None on success or raises CheckFailure
    (or AssertionError) with a message for the learner. The batch grader re-imports course_lib
    before grading, so compare results by value, never by class identity (isinstance, or ==
    on a course_lib dataclass): the learner's objects come from the first import.
    """
    m = NAME_RE.match(name)
    if not m:
        raise ValueError(f"check name {name!r} must look like '03.scaler_update'")
    if isinstance(args, str) or not all(isinstance(a, str) and a.isidentifier() for a in args):
        raise ValueError(f"check {name}: args must be a tuple of global names, e.g. ('decode_fp16',)")

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        try:
            inspect.signature(fn).bind(*args)
        except TypeError:
            raise ValueError(f"check {name}: {fn.__qualname__} cannot be called with {len(args)} args {args}") from None
        old = _REGISTRY.get(name)
        # Re-importing the same module re-registers the same function; two different
        # functions under one name is a copy-paste mistake.
        if old and (old.fn.__module__, old.fn.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(f"check {name} registered twice ({old.fn.__module__} and {fn.__module__})")
        _REGISTRY[name] = Check(name, fn, tuple(args), points, hint, m.group(1))
        return fn
    return decorate


def _load() -> None:
    import course_lib.tooling.checks  # noqa: F401  imports every chNN module, which register their checks


def _load_errors(chapter: str) -> str:
    from course_lib.tooling import checks
    return "; ".join(f"{k}: {v}" for k, v in checks.errors.items() if k == f"ch{chapter}" or not k.startswith("ch"))


def get_check(name: str) -> Check:
    """The registered check called `name` (KeyError if there is none)."""
    _load()
    if name not in _REGISTRY:
        errors = _load_errors(name.split(".")[0])
        why = f" (check modules failed to load: {errors})" if errors else ""
        raise KeyError(f"there is no check called {name!r}{why}")
    return _REGISTRY[name]


def checks_for(chapter: str) -> list[Check]:
    """The checks of one chapter ('03'), in the order they were registered."""
    _load()
    errors = _load_errors(chapter)
    if errors:  # a half-loaded chapter would grade with missing checks: say so instead
        raise RuntimeError(f"checks for chapter {chapter} failed to load: {errors}")
    return [c for c in _REGISTRY.values() if c.chapter == chapter]


class _CheckTimeout(BaseException):
    """BaseException, so that a learner's `except Exception:` cannot swallow the time limit."""


def _brief(e: BaseException, limit: int = 300) -> str:
    try:
        text = str(e)
    except Exception:  # a learner's exception with a broken __str__
        text = "<unprintable>"
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[:limit] + " …"


def _run_check(c: Check, objects: tuple, time_limit: float | None = None) -> tuple[bool, str]:
    """Run one check; never raises (except KeyboardInterrupt). Returns (passed, message)."""
    # The alarm can only interrupt the main thread; the graded kernel runs cells there.
    alarm = bool(time_limit) and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if alarm:
        def on_alarm(signum: int, frame: Any) -> None:
            raise _CheckTimeout
        old_handler = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, time_limit)
    try:
        c.fn(*objects)
        return True, "passed"
    except _CheckTimeout:
        return False, f"took longer than {time_limit:g} s (an endless loop?)"
    except NotImplementedError as e:
        # Only our stub means "untouched"; torch raises NotImplementedError for missing kernels too.
        if not str(e) or str(e).startswith("Exercise"):
            return False, "not attempted yet (the cell still raises NotImplementedError)"
        return False, f"raised {_brief(e)}"
    except AssertionError as e:  # CheckFailure or a bare assert: the message is for the learner
        text = _brief(e, 500).split(": ", 1)
        return False, text[1] if len(text) == 2 else "a check assertion failed"
    except (Exception, SystemExit) as e:
        return False, f"raised {_brief(e)}"
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)


def check(name: str, *objects: Any) -> bool:
    """The inline check at the end of an exercise cell, e.g.
    `check("00.precision_policy", choose_precision)`. Prints one line; never raises."""
    try:
        c = get_check(name)
        if len(objects) != len(c.args):
            ok, msg = False, (f"check({name!r}, ...) takes {len(c.args)} object(s): {', '.join(c.args)}; "
                              f"got {len(objects)}")
        else:
            ok, msg = _run_check(c, objects)
    except KeyError as e:
        print(f"❌ {name} — {e.args[0]}")
        return False
    except Exception as e:  # a broken check module must not break the learner's notebook
        print(f"❌ {name} — the check itself failed: {_brief(e)}")
        return False
    if ok:
        print(f"✅ {name} — passed ({c.points}/{c.points} points)")
    else:
        print(f"❌ {name} — {msg}" + (f"\n   hint: {c.hint}" if c.hint else ""))
    return ok


# --------------------------------------------------------------------------- generate

def _strip_code(src: str, where: str) -> str:
    out: list[str] = []
    inside = False
    for n, line in enumerate(src.split("\n"), 1):
        if BEGIN in line:
            if inside:
                raise ValueError(f"{where}: nested {BEGIN!r} at line {n}")
            inside = True
            out.append(line[: len(line) - len(line.lstrip())] + STUB)
        elif END in line:
            if not inside:
                raise ValueError(f"{where}: {END!r} without a BEGIN at line {n}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: {BEGIN!r} without an END")
    return "\n".join(out)


def _strip_markdown(src: str, where: str) -> str:
    if BEGIN in src or END in src:  # would leak the answer as a heading
        raise ValueError(f"{where}: code markers in a markdown cell; use {MD_BEGIN} ... {MD_END}")
    new = re.sub(re.escape(MD_BEGIN) + ".*?" + re.escape(MD_END), MD_STUB, src, flags=re.S)
    if MD_BEGIN in new or MD_END in new:
        raise ValueError(f"{where}: unbalanced or nested {MD_BEGIN} / {MD_END}")
    return new


def exercise_text(solution: Path, cfg: dict[str, str] | None = None) -> str:
    """The exact bytes (as text) of the exercise generated from one solution notebook."""
    import nbformat

    from course_lib.tooling.colab import stamp_notebook

    nb = nbformat.read(solution, as_version=4)
    nb.nbformat_minor = max(nb.nbformat_minor, 5)  # cell ids
    for i, cell in enumerate(nb.cells):
        if not cell.get("id"):  # deterministic, so that `generate --check` is stable
            cell["id"] = hashlib.sha1(f"{solution.name}:{i}".encode()).hexdigest()[:8]
        where = f"{solution.name} cell {i} (id {cell['id']})"
        if cell.cell_type == "code":
            cell.source = _strip_code(cell.source, where)
            cell.outputs, cell.execution_count = [], None
        elif cell.cell_type == "markdown":
            cell.source = _strip_markdown(cell.source, where)
        for key in ("execution", "ExecuteTime"):  # run timings: noise in diffs
            cell.metadata.pop(key, None)
    nb.metadata.pop("widgets", None)
    nb.metadata["amp_course"] = {"exercise": solution.name[:2], "source": f"solutions/{solution.name}"}
    stamp_notebook(nb, f"exercises/{solution.name}", cfg)
    return nbformat.writes(nb) + "\n"


def generate(solutions_dir: Path = ROOT / "solutions", exercises_dir: Path = ROOT / "exercises",
             check: bool = False) -> list[Path]:
    """Write exercises/NN_x.ipynb from every solutions/NN_x.ipynb (make exercises).

    Returns the exercise paths that were (check=True: would be) written or deleted. A stale
    exercise is one that differs from what its solution generates, or has no solution.
    """
    from course_lib.tooling.colab import read_config

    cfg = read_config()
    solutions = sorted(p for p in Path(solutions_dir).glob("*.ipynb") if re.match(r"\d{2}_", p.name))
    texts = {Path(exercises_dir) / p.name: exercise_text(p, cfg) for p in solutions}  # all errors before any write
    stale = [p for p, text in texts.items() if not p.exists() or p.read_bytes() != text.encode("utf-8")]
    orphans = [p for p in sorted(Path(exercises_dir).glob("*.ipynb")) if p not in texts]
    if not check:
        Path(exercises_dir).mkdir(parents=True, exist_ok=True)
        for p in stale:
            p.write_bytes(texts[p].encode("utf-8"))
        for p in orphans:
            p.unlink()
    return sorted(stale + orphans)


# --------------------------------------------------------------------------- grading

def chapter_of(path: Path, nb: Any = None) -> str | None:
    """The chapter a submission belongs to: notebook metadata, else the NN_ file prefix."""
    try:
        if nb is None:
            nb = json.loads(Path(path).read_text(encoding="utf-8"))
        chapter = str(nb["metadata"]["amp_course"]["exercise"])
        if re.fullmatch(r"\d{2}", chapter):
            return chapter
    except Exception:
        pass
    m = re.match(r"(\d{2})_", Path(path).name)
    return m.group(1) if m else None


# Injected after the learner's cells, with a nonce drawn after they ran. It grades with a
# freshly imported course_lib, so a redefined `check` or a monkeypatched module does not count.
_GRADE_CELL = """\
import sys as _amp_sys, importlib as _amp_importlib
for _amp_m in [m for m in list(_amp_sys.modules) if m == "course_lib" or m.startswith("course_lib.")]:
    del _amp_sys.modules[_amp_m]
_amp_grading = _amp_importlib.import_module("course_lib.tooling.grading")
_amp_grading._grade_in_kernel({chapter!r}, {nonce!r}, globals(), {limit!r})
"""


def _grade_in_kernel(chapter: str, nonce: str, ns: dict, time_limit: float) -> None:
    """Runs inside the graded kernel: one nonce-tagged JSON line per check."""
    def emit(**fields: Any) -> None:
        # Leading newline: learner output without a trailing newline must not swallow our line.
        sys.stdout.write(f"\n{nonce} {json.dumps(fields)}\n")
        sys.stdout.flush()

    emit(python=sys.executable)
    try:
        checks = checks_for(chapter)
    except Exception as e:
        emit(error=_brief(e, 1000))
        return
    for c in checks:
        missing = [a for a in c.args if a not in ns]
        try:
            if missing:
                ok, msg = False, f"`{missing[0]}` is not defined — did you run/keep the cell?"
            else:
                ok, msg = _run_check(c, tuple(ns[a] for a in c.args), time_limit)
        except _CheckTimeout:  # the alarm fired just after the check returned
            ok, msg = False, f"took longer than {time_limit:g} s"
        emit(name=c.name, passed=ok, message=msg)


def _output_size(content: dict) -> int:
    parts = [content.get("text", ""), *(content.get("data") or {}).values(), *(content.get("traceback") or [])]
    return sum(len(p) if isinstance(p, str) else len(json.dumps(p, default=str)) for p in parts)


def _make_client(nb: Any, path: Path, cell_timeout: float) -> Any:
    from jupyter_client.kernelspec import KernelSpec
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    class ThisPythonKernel(AsyncKernelManager):
        """ipykernel in the grader's own interpreter, whatever kernelspecs this machine has
        (a user-level `python3` spec would otherwise win and could be another Python)."""

        @property
        def kernel_spec(self) -> KernelSpec:
            if self._kernel_spec is None:
                from ipykernel.kernelspec import RESOURCES, make_ipkernel_cmd
                self._kernel_spec = KernelSpec(argv=make_ipkernel_cmd(executable=sys.executable),
                                               display_name="Python 3",
                                               language="python", resource_dir=RESOURCES)
            return self._kernel_spec

    class GradingClient(NotebookClient):
        """Keeps at most OUTPUT_CAP bytes of output and counts cells that hit the timeout."""
        kept = dropped = timed_out_cells = 0
        budget = OUTPUT_CAP

        def output(self, outs: list, msg: dict, display_id: str | None, cell_index: int) -> Any:
            size = _output_size(msg.get("content", {}))
            if size > self.budget:
                self.dropped += size
                return None
            self.budget -= size
            self.kept += size
            return super().output(outs, msg, display_id, cell_index)

        async def _async_handle_timeout(self, timeout: int, cell: Any = None) -> Any:
            self.timed_out_cells += 1
            return await super()._async_handle_timeout(timeout, cell)

    return GradingClient(nb, timeout=math.ceil(cell_timeout), allow_errors=True, interrupt_on_timeout=True,
                         kernel_name="python3", kernel_manager_class=ThisPythonKernel,
                         shutdown_kernel="immediate",  # nothing to save: a graceful stop costs ~1 s
                         resources={"metadata": {"path": str(path.parent)}})


def _peak_rss_mb() -> float:
    try:
        import resource
    except ImportError:  # Windows
        return 0.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def run_one(path: Path, out: Path, cell_timeout: float = 60, chapter: str | None = None) -> dict:
    """The child process of grade_notebook: execute one submission, grade it in
    its kernel, write the result JSON to `out`. Statuses: ok, timeout, crashed, unreadable, error."""
    import nbformat
    from nbclient.exceptions import DeadKernelError

    res: dict[str, Any] = {"status": "ok", "detail": "", "results": {}, "chapter": chapter}
    try:
        try:
            nb = nbformat.read(path, as_version=4)
            if not isinstance(nb.get("cells"), list):
                raise ValueError("it has no list of cells")
        except Exception as e:
            res.update(status="unreadable", detail=f"could not read notebook: {_brief(e, 200)}")
            return res
        res["chapter"] = chapter = chapter or chapter_of(path, nb)
        n_checks = len(checks_for(chapter)) if chapter else 0
        client = _make_client(nb, Path(path), cell_timeout)
        rss_before = _peak_rss_mb()
        try:
            with client.setup_kernel():
                # The kernel runs in its own session: the parent kills it by this pid if we hang.
                Path(f"{out}.kernel-pid").write_text(str(client.km.provisioner.pid))
                for i, cell in enumerate(list(nb.cells)):
                    client.execute_cell(cell, i)
                if chapter:
                    nonce = secrets.token_hex(16)  # drawn only now: learner code cannot know it
                    source = _GRADE_CELL.format(chapter=chapter, nonce=nonce, limit=float(cell_timeout))
                    cell = nbformat.v4.new_code_cell(source)
                    nb.cells.append(cell)
                    client.budget = OUTPUT_CAP  # the grading cell gets its own output budget
                    # a backstop: the per-check alarms come first
                    client.timeout = math.ceil(cell_timeout) * (n_checks + 1) + 10
                    timeouts_before = client.timed_out_cells
                    client.execute_cell(cell, len(nb.cells) - 1)
                    if client.timed_out_cells > timeouts_before:
                        res["detail"] = "the grading cell timed out"
                    text = "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")
                    for line in text.splitlines():
                        _, tagged, payload = line.partition(nonce)
                        try:
                            fields = json.loads(payload) if tagged else None
                        except ValueError:
                            continue
                        if isinstance(fields, dict) and "name" in fields:
                            res["results"][str(fields["name"])] = {"passed": fields.get("passed") is True,
                                                                   "message": str(fields.get("message", ""))[:1000]}
                        elif isinstance(fields, dict):
                            res.update({k: str(v) for k, v in fields.items() if k in ("python", "error")})
        except DeadKernelError:
            res.update(status="crashed",
                       detail="kernel crashed (a cell ended the Python process, e.g. os._exit or a segfault)")
        res.update(output_bytes_kept=client.kept, output_bytes_dropped=client.dropped,
                   timed_out_cells=client.timed_out_cells, rss_growth_mb=round(_peak_rss_mb() - rss_before, 1))
        if res["status"] == "ok" and client.timed_out_cells:
            res["status"] = "timeout"
        if res.get("error"):
            res.update(status="error", detail=res["error"])
        elif res.get("python", sys.executable) != sys.executable:
            res.update(status="error", detail=f"grading kernel ran {res.get('python')!r}, not {sys.executable!r}")
    except Exception as e:
        res.update(status="error", detail=f"grader error: {_brief(e, 500)}")
    return res


def _kill_group(pid: int) -> None:
    try:
        if hasattr(os, "killpg"):
            if os.getpgid(pid) == pid:  # only a group leader we started, never a reused pid's group
                os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass


def _row(student: str, notebook: str, exercise: str, max_points: int, passed: bool, message: str, status: str) -> dict:
    return {"student": student, "notebook": notebook, "exercise": exercise, "points": max_points if passed else 0,
            "max_points": max_points, "passed": passed, "status": status, "message": message}


def grade_notebook(path: Path, *, cell_timeout: float = 60, total_timeout: float = 600,
                   student: str | None = None, notebook: str | None = None) -> list[dict]:
    """Grade one submission in a separate process; one row per check of its chapter."""
    path = Path(path)
    student, notebook = student or path.stem, notebook or path.name

    def problem(message: str) -> list[dict]:  # one row: nothing could be graded
        return [_row(student, notebook, "", 0, False, message, "error")]

    chapter = chapter_of(path)
    if chapter is None:
        return problem("cannot tell the chapter: no amp_course metadata and no NN_ prefix in the file name")
    try:
        checks = checks_for(chapter)
    except Exception as e:
        return problem(_brief(e, 1000))
    if not checks:
        return problem(f"no checks registered for chapter {chapter}")

    with tempfile.TemporaryDirectory(prefix="amp-grade-") as tmp:
        out, log = Path(tmp) / "result.json", Path(tmp) / "log.txt"
        cmd = [sys.executable, "-m", "course_lib.tooling.grading", "run-one", str(path), "--json", str(out),
               "--cell-timeout", str(cell_timeout), "--chapter", chapter]
        # The child (and through it the kernel) imports the same course_lib as this process.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        with open(log, "wb") as logf:
            # Its own session, so that one killpg ends the child and anything it started.
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
            try:
                rc, killed = proc.wait(timeout=total_timeout), False
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                rc, killed = proc.wait(), True
        # jupyter_client starts the kernel in a session of its own: end it too if the child
        # could not shut it down.
        pidfile = Path(f"{out}.kernel-pid")
        if (killed or rc != 0) and pidfile.exists():
            _kill_group(int(pidfile.read_text()))
        if killed:
            res = {"status": "timeout", "detail": f"notebook ran past the total time limit ({total_timeout:g} s)"}
        else:
            try:
                res = json.loads(out.read_text())
            except (OSError, ValueError):
                tail = log.read_bytes()[-1000:].decode("utf-8", "replace").strip()
                res = {"status": "error", "detail": f"grader process exited with {rc}: {tail}"}
    status, results = res.get("status", "error"), res.get("results", {})
    missing = res.get("detail") or "no result from the grading cell"
    return [_row(student, notebook, c.name, c.points, results.get(c.name, {}).get("passed") is True,
                 results.get(c.name, {}).get("message", missing), status) for c in checks]


def grade_folder(submissions: Path, out_dir: Path, *, cell_timeout: float = 60, total_timeout: float = 600,
                 jobs: int = 1) -> list[dict]:
    """Grade every *.ipynb under `submissions`; write gradebook.csv and gradebook.json.

    submissions/alice/00_x.ipynb is student "alice"; a flat submissions/alice.ipynb is too.
    `jobs` submissions run at once (each is a kernel process).
    """
    submissions, out_dir = Path(submissions), Path(out_dir)
    paths = sorted(p for p in submissions.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts and p.is_file())
    started = time.monotonic()

    def one(path: Path) -> list[dict]:
        rel = path.relative_to(submissions)
        student = rel.parts[0] if len(rel.parts) > 1 else path.stem
        try:
            return grade_notebook(path, cell_timeout=cell_timeout, total_timeout=total_timeout,
                                  student=student, notebook=rel.as_posix())
        except Exception as e:  # keep going: one row that says what happened
            return [_row(student, rel.as_posix(), "", 0, False, f"grader error: {_brief(e)}", "error")]

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        rows = [row for rows in pool.map(one, paths) for row in rows]
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "gradebook.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    (out_dir / "gradebook.json").write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    _print_summary(rows, time.monotonic() - started, out_dir)
    return rows


def _print_summary(rows: list[dict], seconds: float, out_dir: Path) -> None:
    per: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        per.setdefault((r["student"], r["notebook"]), []).append(r)
    width = max([len(n) for _, n in per] + [8])
    print(f"{'student':<16} {'notebook':<{width}}  {'points':>7}  status")
    for (student, nb), rs in per.items():
        pts = f"{sum(r['points'] for r in rs)}/{sum(r['max_points'] for r in rs)}"
        print(f"{student[:16]:<16} {nb:<{width}}  {pts:>7}  {rs[0]['status']}")
    print(f"{len(per)} submission(s) graded in {seconds:.0f} s -> {out_dir / 'gradebook.csv'}")


# --------------------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.tooling.grading",
                                description="amp-course exercises and grading")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="write exercises/ from solutions/")
    g.add_argument("--check", action="store_true", help="write nothing; list stale exercises, exit 1 if any")
    gr = sub.add_parser("grade", help="grade a folder of submitted notebooks")
    gr.add_argument("submissions", type=Path)
    gr.add_argument("--out", type=Path, default=Path("gradebook"))
    gr.add_argument("--cell-timeout", type=float, default=60)
    gr.add_argument("--total-timeout", type=float, default=600)
    gr.add_argument("--jobs", type=int, default=1)
    one = sub.add_parser("run-one", help="(internal) execute and grade one notebook, write JSON")
    one.add_argument("path", type=Path)
    one.add_argument("--json", type=Path, required=True)
    one.add_argument("--cell-timeout", type=float, default=60)
    one.add_argument("--chapter")
    args = p.parse_args(argv)

    if args.command == "generate":
        paths = generate(check=args.check)
        for path in paths:
            state = "stale" if args.check else ("written" if path.exists() else "deleted")
            print(f"{state}: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        return 1 if (args.check and paths) else 0
    if args.command == "grade":
        rows = grade_folder(args.submissions, args.out, cell_timeout=args.cell_timeout,
                            total_timeout=args.total_timeout, jobs=args.jobs)
        return 0 if rows else 1
    # jsonschema imports this optional IRI grammar when nbformat loads, ~1-2 s per submission;
    # notebook validation never uses it, and this process only runs the one notebook.
    sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[arg-type]
    res = run_one(args.path, args.json, args.cell_timeout, args.chapter)
    args.json.write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    # Run the imported module, not this __main__ copy: the check modules register into
    # `course_lib.tooling.grading`, and a second registry here would stay empty.
    from course_lib.tooling.grading import main as _main
    sys.exit(_main())
