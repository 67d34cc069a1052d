"""The batch grader on a whole class, as an instructor runs it: one run, every row fair.

The class (tests/grading_class.py) mixes honest work, everyday habits, forgeries by every spelling,
hostile code, the real chapters' solutions and untouched exercises. It is graded once, by a separate
process (`python -m course_lib.tooling.grader`, as `make grade` runs it) from a throw-away copy of the
course with a HOME of its own, so that a submission that broke out could only damage copies, and the
test can tell. Then: every row is the fair grade, nothing outside the sandboxes changed, no process
is left, and the class view is written. tests/test_grading_inline.py shows that the inline check()
gives every notebook of the class the same grade.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from grading_class import (
    FORGERIES,
    FULL,
    GOOD_ADD,
    GOOD_CLIP,
    HABITS,
    HONEST,
    IMPORT,
    expected_rows,
    hostile,
    notebook,
    write_class,
)

from course_lib.tooling.exercises import exercise_text
from course_lib.tooling.grader import sandbox

pytestmark = pytest.mark.slow  # the batch grader on a whole class: left out by make test-fast

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "99_fixture.ipynb"
NAMESPACES = sandbox.available()
needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason="this machine cannot create user namespaces")
REAL = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


def course_copy(dest: Path) -> Path:
    """What the grader needs of the course, copied: the library, the data, exercises, fixtures, config."""
    shutil.copytree(ROOT / "course_lib", dest / "course_lib", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "data").mkdir(parents=True)
    for npz in (ROOT / "data").glob("*.npz"):
        shutil.copy(npz, dest / "data")
    shutil.copytree(ROOT / "exercises", dest / "exercises")
    shutil.copytree(ROOT / "tests" / "fixtures", dest / "tests" / "fixtures")
    shutil.copy(ROOT / "pyproject.toml", dest)
    (dest / "solutions").mkdir()  # what a forger would love to read: the sandbox must not show it
    (dest / "solutions" / "99_fixture.ipynb").write_text(notebook([IMPORT, GOOD_ADD, GOOD_CLIP]))
    return dest


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def fixture_checks(course: Path) -> dict[str, str]:
    """Chapters 99 and 97's checks for the grader, and 99's probes, which are all a sandbox sees of them."""
    fixtures = course / "tests" / "fixtures"
    checks = [str(fixtures / "checks_ch99.py"), str(fixtures / "checks_ch97.py")]
    return {"COURSE_EXTRA_CHECKS": os.pathsep.join(checks), "COURSE_EXTRA_PROBES": str(fixtures / "probes_ch99.py")}


def grader_env(course: Path, home: Path) -> dict[str, str]:
    """The grader's environment: the course copy first on the path, then whatever else $PYTHONPATH
    holds (on the GPU machine the carried wheels live there), but never this checkout."""
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    temp = home.parent / "grader-tmp"  # the run's workspace and every sandbox: found by grading_processes
    temp.mkdir(exist_ok=True)
    return {
        **os.environ,
        "HOME": str(home),
        "TMPDIR": str(temp),
        "PYTHONPATH": os.pathsep.join([str(course), *kept]),
        **fixture_checks(course),
    }


def grade(
    course: Path,
    submissions: Path,
    out: Path,
    home: Path,
    *extra: str,
    timeout: float = 900,
    env_extra: dict | None = None,
) -> subprocess.CompletedProcess:
    env = {**grader_env(course, home), **(env_extra or {})}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "course_lib.tooling.grader",
            str(submissions),
            "--out",
            str(out),
            "--cell-timeout",
            "15",
            "--total-timeout",
            "300",
            "--jobs",
            "2",
            *extra,
        ],
        cwd=course,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def by_student(out: Path) -> dict[str, dict[str, dict]]:
    rows = json.loads((out / "gradebook.json").read_text())
    table: dict[str, dict[str, dict]] = {}
    for r in rows:
        table.setdefault(r["student"], {})[r["exercise"]] = r
    return table


def points(table: dict, student: str) -> dict[str, tuple[int, str]]:
    return {ex: (r["points"], r["status"]) for ex, r in table[student].items()}


def grading_processes(under: Path) -> list[int]:
    """Processes that still carry the environment of a sandbox made under `under` (a test's own folder:
    another test may be grading at the same time): there must be none once grading is over."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"AMP_COURSE_GRADING=1" in environ and any(str(under).encode() in v for v in environ):
                found.append(int(entry.name))
    return found


class Listener:
    """A TCP server on this machine's loopback that counts connections (none may arrive)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.5)
        self.port, self.connections, self.stop = self.sock.getsockname()[1], 0, False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
                self.connections += 1
                conn.close()
            except OSError:
                continue


# --------------------------------------------------------------------------- the class, graded once


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict:
    if not NAMESPACES:
        pytest.skip("this machine cannot create user namespaces")
    tmp = tmp_path_factory.mktemp("class")
    course = course_copy(tmp / "course")
    home, subs, out = tmp / "home", tmp / "submissions", tmp / "out"
    (home / ".ipython").mkdir(parents=True)
    (home / "notes.txt").write_text("the instructor's files")
    marker, listener = tmp / "daemon-was-here", Listener()
    entries = {**HONEST, **HABITS, **FORGERIES, **hostile(marker, listener.port, course, subs, out)}
    write_class(entries, subs)
    odd = {
        "untouched": exercise_text(FIXTURE),
        "unreadable": "{not json",
        "lies_in_metadata": notebook([IMPORT, GOOD_ADD, GOOD_CLIP], {"amp_course": {"exercise": "00"}}),
    }
    for student, text in odd.items():
        (subs / student).mkdir()
        (subs / student / "99_fixture.ipynb").write_text(text)
    (subs / "submits_twice").mkdir()
    for name in ("99_fixture.ipynb", "99_again.ipynb"):
        (subs / "submits_twice" / name).write_text(notebook([IMPORT, GOOD_ADD, GOOD_CLIP]))
    (subs / "no_chapter").mkdir()
    (subs / "no_chapter" / "homework.ipynb").write_text(notebook([IMPORT, GOOD_ADD]))
    for sol in REAL:  # every chapter's solution and its untouched exercise
        for who, folder in (("solution", ROOT / "solutions"), ("exercise", ROOT / "exercises")):
            (subs / who).mkdir(exist_ok=True)
            shutil.copy(folder / sol.name, subs / who / sol.name)
    before = {"course": tree_digest(course), "home": tree_digest(home)}
    started = time.monotonic()
    proc = grade(course, subs, out, home)
    seconds = time.monotonic() - started
    time.sleep(5)  # a daemon would write its marker 4 s after its task ran
    listener.stop = True
    assert (out / "gradebook.json").exists(), f"the grader wrote no gradebook:\n{proc.stdout}\n{proc.stderr}"
    return {
        "proc": proc,
        "table": by_student(out),
        "out": out,
        "course": course,
        "home": home,
        "entries": entries,
        "before": before,
        "marker": marker,
        "listener": listener,
        "seconds": seconds,
        "submissions": len(list(subs.rglob("*.ipynb"))),
    }


@needs_namespaces
def test_the_run_finishes_and_grades_every_student(graded):
    assert graded["proc"].returncode == 0, graded["proc"].stdout + graded["proc"].stderr
    assert "each task runs in its own namespaces" in graded["proc"].stdout
    assert set(graded["entries"]) <= set(graded["table"])
    print(f"{graded['submissions']} notebooks graded in {graded['seconds']:.0f} s")  # the class's wall time


@needs_namespaces
@pytest.mark.parametrize("group", ["HONEST", "HABITS", "FORGERIES", "hostile"])
def test_every_notebook_of_the_class_gets_its_fair_grade(graded, group):
    entries = {"HONEST": HONEST, "HABITS": HABITS, "FORGERIES": FORGERIES}.get(group) or {
        k: e for k, e in graded["entries"].items() if k not in {**HONEST, **HABITS, **FORGERIES}
    }
    wrong = []
    for (student, task), want in expected_rows(entries).items():
        row = graded["table"][student].get(task)
        got = (row["points"], row["status"]) if row else None
        if got != want:
            wrong.append(f"{student} {task}: {got}, expected {want}: {row and row['message']}")
            continue
        words = entries[student].says.get(task)
        if words and words not in row["message"]:
            wrong.append(f"{student} {task}: the message lacks {words!r}: {row['message']}")
        noted = entries[student].noted.get(task)
        if noted and noted not in row["notes"]:
            wrong.append(f"{student} {task}: the notes lack {noted!r}: {row['notes']}")
    assert not wrong, "\n".join(wrong)


@needs_namespaces
def test_every_solution_scores_full_marks_and_every_exercise_zero_without_a_process(graded):
    table = graded["table"]
    for sol in REAL:
        rows = [r for r in table["solution"].values() if r["notebook"].endswith(sol.name)]
        # on an older torch (make test-floor) a check that needs a newer one says so and judges nothing
        judged = [r for r in rows if not (r["status"] == "not graded" and "needs torch" in r["message"])]
        assert rows and all(r["passed"] for r in judged), [(r["exercise"], r["message"]) for r in rows]
    assert any(r["passed"] for r in table["solution"].values())
    for row in table["exercise"].values():
        assert (row["points"], row["status"]) == (0, "not attempted") and "still the exercise's stub" in row["message"]


@needs_namespaces
def test_habits_are_noted_for_the_instructor_never_graded(graded):
    row = graded["table"]["shell_nvidia_smi"]["99.add"]
    assert row["passed"] and "!nvidia-smi" in row["notes"] and "noticed, not graded" in row["notes"]
    row = graded["table"]["eval_in_a_helper"]["99.add"]
    assert row["passed"] and "eval()" in row["notes"] and "worth a look" in row["notes"]


@needs_namespaces
def test_the_class_view_counts_each_task_and_names_its_common_failures(graded):
    out = graded["out"]
    assert "class view ->" in graded["proc"].stdout
    with open(out / "class.csv", newline="") as f:
        view = {r["exercise"]: r for r in csv.DictReader(f)}
    rows = [r for r in json.loads((out / "gradebook.json").read_text()) if r["exercise"] == "97.mean"]
    mean = view["97.mean"]
    assert int(mean["notebooks"]) == len(rows)
    assert int(mean["passed"]) == sum(r["status"] == "passed" for r in rows)
    assert int(mean["failed"]) == sum(r["status"] == "failed" for r in rows)
    assert int(mean["not_attempted"]) == sum(r["status"] == "not attempted" for r in rows)
    top = mean["top_failures"].split(" | ")[0]  # the shortcut many tried, counted once per notebook
    assert "statistics" in top and int(top.split("×")[0]) >= 3, mean["top_failures"]
    assert "returned #, expected #" in view["99.add"]["top_failures"] or "#" in mean["top_failures"]
    page = (out / "class.html").read_text()
    assert "99.add" in page and "04.accumulate" in page and "<ol>" in page


@needs_namespaces
def test_the_instructors_files_are_unchanged(graded):
    assert tree_digest(graded["course"]) == graded["before"]["course"]
    assert tree_digest(graded["home"]) == graded["before"]["home"]


@needs_namespaces
def test_nothing_outlives_its_grading(graded):
    assert not graded["marker"].exists()
    assert grading_processes(graded["home"].parent) == []


@needs_namespaces
def test_no_network_inside_the_sandbox_but_its_own_loopback(graded):
    assert graded["listener"].connections == 0
    assert points(graded["table"], "talks_to_itself")["99.add"] == (2, "passed")


@needs_namespaces
def test_the_file_name_is_the_slot(graded):
    t = graded["table"]
    assert points(t, "lies_in_metadata") == FULL  # metadata said chapter 00: ignored
    assert points(t, "untouched") == {"99.add": (0, "not attempted"), "99.clip": (0, "not attempted")}
    twice = [r for r in json.loads((graded["out"] / "gradebook.json").read_text()) if r["student"] == "submits_twice"]
    counted = {r["notebook"] for r in twice if r["status"] != "duplicate"}
    assert len(counted) == 1 and sum(r["points"] for r in twice) == 3
    assert all("is graded" in r["message"] for r in twice if r["status"] == "duplicate")
    assert t["no_chapter"][""]["status"] == "not graded" and "NN_" in t["no_chapter"][""]["message"]
    assert (
        t["unreadable"]["99.add"]["status"] == "not graded"
        and "not a readable notebook" in t["unreadable"]["99.add"]["message"]
    )


@needs_namespaces
def test_csv_and_json_gradebooks_agree(graded):
    with open(graded["out"] / "gradebook.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    json_rows = json.loads((graded["out"] / "gradebook.json").read_text())
    assert [(r["student"], r["exercise"], int(r["points"]), r["notes"]) for r in csv_rows] == [
        (r["student"], r["exercise"], r["points"], r["notes"]) for r in json_rows
    ]


# --------------------------------------------------------------------------- resuming

SLOW_CLIP = (
    "import time\n\ndef wait():\n    time.sleep(60)\n    return 3.0\n\nLIMIT = wait()\n\n"
    "def clip(x):\n    return max(-LIMIT, min(LIMIT, x))"
)


def test_a_rerun_resumes_and_a_killed_grader_loses_only_the_submission_in_flight(tmp_path):
    course = course_copy(tmp_path / "course")
    subs, out, home = tmp_path / "submissions", tmp_path / "out", tmp_path / "home"
    home.mkdir()
    for student, cells in {"a_fast": [IMPORT, GOOD_ADD, GOOD_CLIP], "b_slow": [IMPORT, GOOD_ADD, SLOW_CLIP]}.items():
        (subs / student).mkdir(parents=True)
        (subs / student / "99_fixture.ipynb").write_text(notebook(cells))
    env = grader_env(course, home)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "course_lib.tooling.grader",
            str(subs),
            "--out",
            str(out),
            "--jobs",
            "2",
            "--cell-timeout",
            "120",
        ],
        cwd=course,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    journal = out / "gradebook.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        '"done", "submission": "a_fast' in (text := journal.read_text() if journal.exists() else "")
        and "b_slow" in text
    ):
        time.sleep(0.5)
    time.sleep(1)  # b_slow's clip is in flight, asleep while its statements load
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert set(by_student(out)) == {"a_fast"}  # what was finished is on disk
    if NAMESPACES:  # a namespace dies with its grader (at the session level a process may outlive it)
        time.sleep(2)
        assert grading_processes(tmp_path) == []
    (subs / "b_slow" / "99_fixture.ipynb").write_text(notebook([IMPORT, GOOD_ADD, GOOD_CLIP]))  # fixed meanwhile
    rerun = grade(course, subs, out, home)
    assert "resuming: 1 of 2 submissions already graded" in rerun.stdout
    assert journal.read_text().count('"done", "submission": "a_fast') == 1  # not graded twice
    table = by_student(out)
    assert points(table, "a_fast") == points(table, "b_slow") == FULL


# --------------------------------------------------------------------------- without namespaces


def test_without_namespaces_the_grader_warns_kills_every_process_and_detects_a_changed_checkout(tmp_path):
    course = course_copy(tmp_path / "course")
    subs, out, home, marker = tmp_path / "submissions", tmp_path / "out", tmp_path / "home", tmp_path / "marker"
    home.mkdir()
    cells = hostile(marker, 9, course, subs, out)
    for student in ("leaves_a_daemon", "crashes_after_a_pass"):
        (subs / student).mkdir(parents=True)
        (subs / student / "99_fixture.ipynb").write_text(notebook(cells[student].cells))
    first = grade(course, subs, out, home, "--isolation", "session")
    assert first.returncode == 0 and "WARNING: no namespace isolation (as asked" in first.stdout
    table = by_student(out)
    assert points(table, "leaves_a_daemon") == FULL
    assert points(table, "crashes_after_a_pass") == {"99.add": (2, "passed"), "99.clip": (0, "crashed")}
    time.sleep(5)
    assert not marker.exists() and grading_processes(tmp_path) == []
    (subs / "a_tamper").mkdir()
    (subs / "a_tamper" / "99_fixture.ipynb").write_text(notebook(cells["writes_the_checkout"].cells))
    for n in range(4):  # queued behind it: none of them may be graded on a changed checkout
        (subs / f"z_after_{n}").mkdir()
        (subs / f"z_after_{n}" / "99_fixture.ipynb").write_text(notebook([IMPORT, GOOD_ADD, GOOD_CLIP]))
    second = grade(course, subs, out, home, "--isolation", "session", "--jobs", "1")
    assert second.returncode == 2 and "the course's files changed while a_tamper" in second.stderr
    table = by_student(out)
    assert all(
        r["points"] == 0 and "changed the course's own files" in r["message"] for r in table["a_tamper"].values()
    )
    assert not [s for s in table if s.startswith("z_after")]
