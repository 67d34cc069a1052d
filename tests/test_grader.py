"""The batch grader against a class of hostile submissions, as an instructor would run it.

Chapter 99 is a fixture chapter (tests/fixtures/checks_ch99.py, 99_fixture.ipynb): fast to run,
so one grader run can grade a whole class of adversarial notebooks. The grader runs as a
separate process (`python -m course_lib.tooling.grader`, as `make grade` does) from a
throw-away copy of the course, with a HOME of its own, so that a submission that breaks out
could only damage copies, and the test can tell. Each test then asserts the fair grade and an
unchanged machine.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest

from course_lib.tooling import sandbox
from course_lib.tooling.exercises import exercise_text

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "99_fixture.ipynb"
NAMESPACES = sandbox.available()
needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason="this machine cannot create user namespaces")


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


def notebook(cells: list[str], metadata: dict | None = None) -> str:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata.update(metadata or {})
    return nbformat.writes(nb)


GOOD_ADD = "def add(a, b):\n    return a + b"
GOOD_CLIP = "LIMIT = 3.0\n\ndef clip(x):\n    return max(-LIMIT, min(LIMIT, x))"
WRONG_ADD = "def add(a, b):\n    return a - b"
IMPORT = "from course_lib.tooling import check"


def grader_env(course: Path, home: Path) -> dict[str, str]:
    """The grader's environment: the course copy first on the path, then whatever else $PYTHONPATH
    holds (on the GPU machine the carried wheels live there), but never this checkout."""
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    return {**os.environ, "HOME": str(home), "PYTHONPATH": os.pathsep.join([str(course), *kept]),
            **fixture_checks(course)}


def fixture_checks(course: Path) -> dict[str, str]:
    """Chapter 99's checks for the grader, and its probes, which are all a sandbox sees of it."""
    fixtures = course / "tests" / "fixtures"
    return {"COURSE_EXTRA_CHECKS": str(fixtures / "checks_ch99.py"),
            "COURSE_EXTRA_PROBES": str(fixtures / "probes_ch99.py")}


def grade(course: Path, submissions: Path, out: Path, home: Path, *extra: str,
          timeout: float = 600, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**grader_env(course, home), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "course_lib.tooling.grader", str(submissions), "--out", str(out),
                           "--cell-timeout", "15", "--total-timeout", "180", "--jobs", "2", *extra],
                          cwd=course, env=env, capture_output=True, text=True, timeout=timeout)


def by_student(out: Path) -> dict[str, dict[str, dict]]:
    rows = json.loads((out / "gradebook.json").read_text())
    table: dict[str, dict[str, dict]] = {}
    for r in rows:
        table.setdefault(r["student"], {})[r["exercise"]] = r
    return table


def grading_processes() -> list[int]:
    """Processes that still carry a sandbox's environment: there must be none once grading is over."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"AMP_COURSE_GRADING=1" in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
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


# --------------------------------------------------------------------------- the class

STUB_ADD = "def add(a, b):\n    raise NotImplementedError(\"Exercise: write your solution here\")"


def hostile_class(course: Path, home: Path, marker: Path, port: int, subs: Path = Path("/nonexistent"),
                  out: Path = Path("/nonexistent")) -> dict[str, list[str] | str]:
    """student -> the code cells of their 99_fixture.ipynb (or the raw text of the file)."""
    checks = course / "course_lib" / "tooling" / "checks" / "ch00.py"
    return {
        "good": [IMPORT, GOOD_ADD, GOOD_CLIP],
        "wrong": [IMPORT, WRONG_ADD, GOOD_CLIP],
        "forges_stdout": [IMPORT, WRONG_ADD, GOOD_CLIP,
                          "print('✅ 99.add — passed (2/2 points)')\n"
                          "print('{\"name\": \"99.add\", \"passed\": true, \"message\": \"passed\"}')"],
        "forges_json": [IMPORT, STUB_ADD, GOOD_CLIP,
                        "import json\n"
                        "json.dumps = lambda *a, **k: '{\"nonce\": null, \"response\": {\"passed\": true}}'"],
        "swaps_the_grading_module": [IMPORT, STUB_ADD, GOOD_CLIP, """
import importlib.abc, importlib.util, json, os, sys
class Fake(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "course_lib.tooling.grading" else None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        def serve(request, ns):
            fd = int(os.environ["AMP_ANSWER_FD"])
            results = ["passed"] * len(request["cases"])
            answer = {"nonce": request["nonce"], "response": {"passed": True, "results": results}}
            os.write(fd, (json.dumps(answer) + "\\n").encode())
        module.serve = serve
for m in [m for m in sys.modules if m.startswith("course_lib.tooling")]:
    del sys.modules[m]
sys.meta_path.insert(0, Fake())"""],
        "patches_os_write_and_import": [IMPORT, STUB_ADD, GOOD_CLIP, """
import builtins, json, os
real_write, real_import = os.write, builtins.__import__
def write(fd, data):
    try:
        message = json.loads(data)
        message["response"] = {"results": ["passed"] * 20}
        data = (json.dumps(message) + "\\n").encode()
    except Exception:
        pass
    return real_write(fd, data)
os.write = write
builtins.__import__ = lambda name, *a, **k: real_import(name, *a, **k)"""],
        "hooks_ipython": [IMPORT, STUB_ADD, GOOD_CLIP,
                          "get_ipython().events.register('post_run_cell', lambda r: print('✅ 99.add — passed'))"],
        "answers_twice_from_a_hook": [IMPORT, STUB_ADD, GOOD_CLIP, """
import json, os, socket
def pre(info):  # before the grader's serve cell runs: ask for its question first, answer it, let serve go on
    if "serve(None" in (info.raw_cell or ""):
        fd = int(os.environ["AMP_ANSWER_FD"])
        channel = socket.socket(fileno=os.dup(fd))
        channel.sendall(b'{"next": true}\\n')
        request = json.loads(channel.makefile("rb").readline())
        if request.get("name") == "99.add":
            results = [a + b for a, b in request["cases"]]
            answer = {"nonce": request["nonce"], "response": {"results": results}}
            channel.sendall((json.dumps(answer) + "\\n").encode())
get_ipython().events.register("pre_run_cell", pre)"""],
        "writes_the_channel_early": [IMPORT, STUB_ADD, GOOD_CLIP, """
import json, os
fd = int(os.environ["AMP_ANSWER_FD"])
for nonce in (None, "0" * 32, ""):
    os.write(fd, (json.dumps({"nonce": nonce, "response": {"results": ["passed"] * 20}}) + "\\n").encode())"""],
        "steals_answers_from_files": [IMPORT, STUB_ADD, GOOD_CLIP, f"""
import glob, json, sys
SEEN = []
for pattern in [{str(course / "solutions" / "*.ipynb")!r}, {str(subs / "*" / "*.ipynb")!r},
                {str(out / "gradebook.jsonl")!r}, {str(course / "tests" / "fixtures" / "checks_ch99.py")!r},
                "/tmp/**/*.ipynb"]:
    SEEN += glob.glob(pattern, recursive=True)
wanted = "return a " + "+ b"
for path in SEEN:
    try:
        sources = ["".join(c["source"]) for c in json.load(open(path))["cells"]]
    except Exception:
        continue
    for source in sources:
        if wanted in source:
            exec(source)
try:
    sys.path.insert(0, {str(course / "tests" / "fixtures")!r})
    import checks_ch99  # noqa: F401
    def add(a, b):
        return a + b  # stands for 'computed with the check's own reference', had it been importable
except ImportError:
    pass"""],
        "ignores_interrupts_in_a_task": [IMPORT, """
import signal
def add(a, b):
    signal.signal(signal.SIGINT, lambda *a: None)  # the grader's time limit must still hold
    while True:
        pass""", GOOD_CLIP],
        "dishonest_eq": [IMPORT, """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return True
def add(a, b):
    return Anything()""", GOOD_CLIP],
        "patches_builtins": [IMPORT, WRONG_ADD, GOOD_CLIP, "import builtins\nbuiltins.abs = lambda x: 0"],
        "numpy_scalar": [IMPORT, "import numpy as np\n\ndef add(a, b):\n    return np.int64(a + b)", GOOD_CLIP],
        "kills_everything": [IMPORT, GOOD_ADD, GOOD_CLIP, """
import os, signal
for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
    if pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
try:
    os.kill(-1, signal.SIGKILL)
except OSError:
    pass"""],
        "writes_the_checkout": [IMPORT, WRONG_ADD, GOOD_CLIP, f"""
import course_lib.tooling.grading
for path in [{str(checks)!r}, course_lib.tooling.grading.__file__]:  # the checkout's, the sandbox's own copy
    try:
        open(path, "a").write("\\nBACKDOOR = True\\n")
    except OSError as e:
        print("refused:", e)"""],
        "writes_home": [IMPORT, WRONG_ADD, GOOD_CLIP, f"""
import os
import re
for folder in [os.path.expanduser("~/.ipython/profile_default/startup"),
               {str(home / ".ipython" / "profile_default" / "startup")!r}]:
    try:
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, "00-evil.py"), "w").write("print('owned')")
    except OSError as e:
        print("refused:", e)"""],
        "leaves_a_daemon": [IMPORT, GOOD_ADD, GOOD_CLIP, f"""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(4)
        try:
            open({str(marker)!r}, "w").write("the daemon outlived its grading")
        finally:
            while True:
                time.sleep(1)
    os._exit(0)"""],
        "reaches_the_network": [IMPORT, GOOD_ADD, GOOD_CLIP, f"""
import socket
for host in ("127.0.0.1", "localhost"):
    try:
        socket.create_connection((host, {port}), timeout=2).close()
    except OSError as e:
        print("no network:", e)"""],
        "talks_to_itself": [IMPORT, """
import socket
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
client = socket.create_connection(server.getsockname(), timeout=5)  # e.g. two DDP ranks of one submission
conn, _ = server.accept()
client.sendall(b"ok")
WORKS = conn.recv(2) == b"ok"
def add(a, b):
    return a + b if WORKS else 0""", GOOD_CLIP],
        "crashes_after_a_pass": [IMPORT, GOOD_ADD, "import os\nLIMIT = 3.0\n\ndef clip(x):\n    os._exit(1)"],
        "segfaults_after_a_pass": [IMPORT, GOOD_ADD, "import ctypes\nLIMIT = 3.0\n\ndef clip(x):\n"
                                                      "    return ctypes.string_at(0)"],
        "hangs_after_a_pass": [IMPORT, GOOD_ADD, "LIMIT = 3.0\n\ndef clip(x):\n    while True:\n        pass"],
        "interrupts_after_a_pass": [IMPORT, GOOD_ADD, "LIMIT = 3.0\n\ndef clip(x):\n    raise KeyboardInterrupt"],
        "floods": [IMPORT, "print('x' * 40_000_000)", GOOD_ADD, GOOD_CLIP],
        "hangs_in_a_cell": [IMPORT, "while True:\n    pass", GOOD_ADD, GOOD_CLIP],
        "hangs_uninterruptibly": [IMPORT, GOOD_ADD, "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                                                    "while True:\n    pass", GOOD_CLIP],
        "hangs_in_its_last_cell": [IMPORT, GOOD_ADD, GOOD_CLIP, "import signal\nsignal.signal(signal.SIGINT, "
                                                                "signal.SIG_IGN)\nwhile True:\n    pass"],
        "deleted_cells": [IMPORT],
        "unreadable": "{not json",
    }


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict:
    if not NAMESPACES:
        pytest.skip("this machine cannot create user namespaces")
    tmp = tmp_path_factory.mktemp("hostile")
    course = course_copy(tmp / "course")
    home = tmp / "home"
    (home / ".ipython").mkdir(parents=True)
    (home / "notes.txt").write_text("the instructor's files")
    marker, listener = tmp / "daemon-was-here", Listener()
    subs = tmp / "submissions"
    for student, cells in hostile_class(course, home, marker, listener.port, subs, tmp / "out").items():
        (subs / student).mkdir(parents=True)
        text = cells if isinstance(cells, str) else notebook(cells)
        (subs / student / "99_fixture.ipynb").write_text(text)
    (subs / "untouched").mkdir()
    (subs / "untouched" / "99_fixture.ipynb").write_text(exercise_text(FIXTURE))
    lying = notebook([IMPORT, GOOD_ADD, GOOD_CLIP], {"amp_course": {"exercise": "00"}})
    (subs / "lies_in_metadata").mkdir()
    (subs / "lies_in_metadata" / "99_fixture.ipynb").write_text(lying)
    (subs / "submits_twice").mkdir()
    for name in ("99_fixture.ipynb", "99_again.ipynb"):
        (subs / "submits_twice" / name).write_text(notebook([IMPORT, GOOD_ADD, GOOD_CLIP]))
    (subs / "no_chapter").mkdir()
    (subs / "no_chapter" / "homework.ipynb").write_text(notebook([IMPORT, GOOD_ADD]))
    before = {"course": tree_digest(course), "home": tree_digest(home)}
    started = time.monotonic()
    # This class tries the defences beneath the reading of the source (tests/test_source_rules.py and
    # tests/test_grading_round3.py try the reading itself): most of these notebooks would stop there.
    proc = grade(course, subs, tmp / "out", home, env_extra={"AMP_GRADER_NO_SOURCE_READING": "1"})
    seconds = time.monotonic() - started
    time.sleep(5)  # the daemon would write its marker 4 s after its notebook ran
    listener.stop = True
    assert (tmp / "out" / "gradebook.json").exists(), f"the grader wrote no gradebook:\n{proc.stdout}\n{proc.stderr}"
    return {"proc": proc, "table": by_student(tmp / "out"), "out": tmp / "out", "course": course, "home": home,
            "before": before, "marker": marker, "listener": listener, "seconds": seconds}


def points(table: dict, student: str) -> dict[str, tuple[int, str]]:
    return {ex: (r["points"], r["status"]) for ex, r in table[student].items()}


@needs_namespaces
def test_the_run_finishes_and_grades_every_student(graded):
    assert graded["proc"].returncode == 0, graded["proc"].stdout + graded["proc"].stderr
    assert "each submission runs in its own namespaces" in graded["proc"].stdout
    students = {"good", "wrong", "forges_stdout", "kills_everything", "unreadable", "untouched", "no_chapter"}
    assert students <= set(graded["table"])
    assert graded["seconds"] < 300, f"a class of ~30 fixture notebooks took {graded['seconds']:.0f} s"


@needs_namespaces
def test_fair_grades_for_honest_work(graded):
    t = graded["table"]
    assert points(t, "good") == {"99.add": (2, "passed"), "99.clip": (1, "passed")}
    assert points(t, "wrong") == {"99.add": (0, "failed"), "99.clip": (1, "passed")}
    assert points(t, "untouched") == {"99.add": (0, "not attempted"), "99.clip": (0, "not attempted")}
    assert points(t, "numpy_scalar")["99.add"] == (2, "passed")
    assert re.fullmatch(r"add\(-?\d+, -?\d+\) returned -?\d+, expected -?\d+", t["wrong"]["99.add"]["message"])


FORGERS = ["forges_stdout", "forges_json", "swaps_the_grading_module", "patches_os_write_and_import",
           "hooks_ipython", "answers_twice_from_a_hook", "writes_the_channel_early", "steals_answers_from_files",
           "patches_builtins"]


@needs_namespaces
@pytest.mark.parametrize("student", FORGERS)
def test_a_stub_gets_nothing_from_any_channel_the_kernel_can_reach(graded, student):
    """stdout, json/os/builtins, the import system, the grading module, IPython hooks, the answer
    channel itself and the files: a notebook whose `add` is still the stub earns nothing."""
    row = graded["table"][student]["99.add"]
    assert row["points"] == 0 and row["status"] in ("not attempted", "failed"), row


@needs_namespaces
def test_a_second_answer_to_a_question_rejects_both(graded):
    row = graded["table"]["answers_twice_from_a_hook"]["99.add"]
    assert row["status"] == "failed" and "2 answers arrived for this task" in row["message"], row


@needs_namespaces
def test_messages_written_before_a_question_are_ignored_and_reported(graded):
    row = graded["table"]["writes_the_channel_early"]["99.add"]
    assert row["status"] == "not attempted" and "ignored 3 message(s)" in row["message"], row


@needs_namespaces
def test_the_sandbox_shows_no_solution_no_other_submission_no_gradebook_and_no_check(graded):
    assert points(graded["table"], "steals_answers_from_files") == {"99.add": (0, "not attempted"),
                                                                   "99.clip": (1, "passed")}


@needs_namespaces
def test_an_object_that_equals_everything_is_not_an_answer(graded):
    row = graded["table"]["dishonest_eq"]["99.add"]
    assert row["points"] == 0 and "Anything object" in row["message"]


@needs_namespaces
def test_killing_processes_hurts_nobody_else(graded):
    assert points(graded["table"], "kills_everything") == {"99.add": (2, "passed"), "99.clip": (1, "passed")}
    assert graded["proc"].returncode == 0


@needs_namespaces
def test_the_instructors_files_are_unchanged(graded):
    assert tree_digest(graded["course"]) == graded["before"]["course"]
    assert tree_digest(graded["home"]) == graded["before"]["home"]
    assert graded["table"]["writes_the_checkout"]["99.add"]["points"] == 0


@needs_namespaces
def test_nothing_outlives_its_grading(graded):
    assert not graded["marker"].exists()
    assert grading_processes() == []


@needs_namespaces
def test_no_network_inside_the_sandbox_but_its_own_loopback(graded):
    assert graded["listener"].connections == 0
    assert points(graded["table"], "talks_to_itself")["99.add"] == (2, "passed")


@needs_namespaces
def test_points_earned_before_a_crash_hang_or_interrupt_are_kept(graded):
    t = graded["table"]
    assert points(t, "crashes_after_a_pass") == {"99.add": (2, "passed"), "99.clip": (0, "crashed")}
    assert points(t, "segfaults_after_a_pass") == {"99.add": (2, "passed"), "99.clip": (0, "crashed")}
    assert points(t, "hangs_after_a_pass") == {"99.add": (2, "passed"), "99.clip": (0, "timed out")}
    assert points(t, "interrupts_after_a_pass") == {"99.add": (2, "passed"), "99.clip": (0, "failed")}
    assert "KeyboardInterrupt" in t["interrupts_after_a_pass"]["99.clip"]["message"]
    assert "longer than 5 s" in t["hangs_after_a_pass"]["99.clip"]["message"]  # the task's limit, not the cell's
    assert "stopped while this task was being checked" in t["crashes_after_a_pass"]["99.clip"]["message"]


@needs_namespaces
def test_output_floods_and_interruptible_hangs_cost_nothing(graded):
    t = graded["table"]
    assert points(t, "floods") == {"99.add": (2, "passed"), "99.clip": (1, "passed")}
    assert points(t, "hangs_in_a_cell") == {"99.add": (2, "passed"), "99.clip": (1, "passed")}


@needs_namespaces
@pytest.mark.parametrize("student", ["hangs_uninterruptibly", "hangs_in_its_last_cell"])
def test_a_cell_that_cannot_be_stopped_costs_no_task_that_does_not_need_it(graded, student):
    """The grader abandons that kernel and runs the notebook again without the cell."""
    assert points(graded["table"], student) == {"99.add": (2, "passed"), "99.clip": (1, "passed")}


@needs_namespaces
def test_a_task_that_cannot_be_stopped_costs_only_itself_and_is_called_a_time_out(graded):
    t = graded["table"]["ignores_interrupts_in_a_task"]
    assert points(graded["table"], "ignores_interrupts_in_a_task") == {"99.add": (0, "timed out"),
                                                                      "99.clip": (1, "passed")}
    assert "longer than 5 s" in t["99.add"]["message"]


@needs_namespaces
def test_the_file_name_is_the_slot(graded):
    t = graded["table"]
    assert set(t["lies_in_metadata"]) == {"99.add", "99.clip"}  # metadata said chapter 00: ignored
    twice = [r for r in json.loads((graded["out"] / "gradebook.json").read_text()) if r["student"] == "submits_twice"]
    counted = {r["notebook"] for r in twice if r["status"] != "duplicate"}
    assert len(counted) == 1 and sum(r["points"] for r in twice) == 3
    assert all("is graded" in r["message"] for r in twice if r["status"] == "duplicate")
    assert t["no_chapter"][""]["status"] == "not graded" and "NN_" in t["no_chapter"][""]["message"]


@needs_namespaces
def test_missing_and_unreadable_notebooks_say_why(graded):
    t = graded["table"]
    assert points(t, "deleted_cells")["99.add"] == (0, "not attempted")
    assert "`add` is not defined" in t["deleted_cells"]["99.add"]["message"]
    assert t["unreadable"]["99.add"]["status"] == "not graded" and "not a readable notebook" in \
        t["unreadable"]["99.add"]["message"]


@needs_namespaces
def test_csv_and_json_gradebooks_agree(graded):
    with open(graded["out"] / "gradebook.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    json_rows = json.loads((graded["out"] / "gradebook.json").read_text())
    assert [(r["student"], r["exercise"], int(r["points"])) for r in csv_rows] == \
        [(r["student"], r["exercise"], r["points"]) for r in json_rows]


# --------------------------------------------------------------------------- resuming

def test_a_rerun_resumes_and_a_killed_grader_loses_only_the_submission_in_flight(tmp_path):
    course = course_copy(tmp_path / "course")
    subs, out, home = tmp_path / "submissions", tmp_path / "out", tmp_path / "home"
    home.mkdir()
    for student, cells in {"a_fast": [IMPORT, GOOD_ADD, GOOD_CLIP],
                           "b_slow": [IMPORT, GOOD_ADD, "import time\ntime.sleep(60)", GOOD_CLIP]}.items():
        (subs / student).mkdir(parents=True)
        (subs / student / "99_fixture.ipynb").write_text(notebook(cells))
    env = grader_env(course, home)
    proc = subprocess.Popen([sys.executable, "-m", "course_lib.tooling.grader", str(subs), "--out", str(out),
                             "--jobs", "2", "--cell-timeout", "120"], cwd=course, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    journal = out / "gradebook.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and '"done", "submission": "a_fast' not in \
            (journal.read_text() if journal.exists() else ""):
        time.sleep(0.5)
    time.sleep(3)  # b_slow is in flight, asleep in its second cell
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert by_student(out) == {"a_fast": by_student(out)["a_fast"]}  # what was finished is on disk
    if NAMESPACES:  # a namespace dies with its grader (at the session level a kernel may outlive it)
        time.sleep(2)
        assert grading_processes() == []
    rerun = grade(course, subs, out, home)
    assert "resuming: 1 of 2 submissions already graded" in rerun.stdout
    assert journal.read_text().count('"done", "submission": "a_fast') == 1  # not graded twice
    table = by_student(out)
    assert points(table, "a_fast") == points(table, "b_slow") == {"99.add": (2, "passed"), "99.clip": (1, "passed")}


# --------------------------------------------------------------------------- without namespaces

def test_without_namespaces_the_grader_warns_kills_every_process_and_detects_a_changed_checkout(tmp_path):
    course = course_copy(tmp_path / "course")
    subs, out, home, marker = tmp_path / "submissions", tmp_path / "out", tmp_path / "home", tmp_path / "marker"
    home.mkdir()
    cells = hostile_class(course, home, marker, 9)
    for student in ("good", "leaves_a_daemon", "crashes_after_a_pass"):
        (subs / student).mkdir(parents=True)
        (subs / student / "99_fixture.ipynb").write_text(notebook(cells[student]))
    first = grade(course, subs, out, home, "--isolation", "session")
    assert first.returncode == 0 and "WARNING: no namespace isolation (as asked" in first.stdout
    table = by_student(out)
    assert points(table, "good") == points(table, "leaves_a_daemon") == {"99.add": (2, "passed"),
                                                                         "99.clip": (1, "passed")}
    assert points(table, "crashes_after_a_pass") == {"99.add": (2, "passed"), "99.clip": (0, "crashed")}
    time.sleep(5)
    assert not marker.exists() and grading_processes() == []
    (subs / "a_tamper").mkdir()
    (subs / "a_tamper" / "99_fixture.ipynb").write_text(notebook(cells["writes_the_checkout"]))
    for n in range(4):  # queued behind it: none of them may be graded on a changed checkout
        (subs / f"z_after_{n}").mkdir()
        (subs / f"z_after_{n}" / "99_fixture.ipynb").write_text(notebook(cells["good"]))
    second = grade(course, subs, out, home, "--isolation", "session", "--jobs", "1")
    assert second.returncode == 2 and "the course's files changed while a_tamper" in second.stderr
    table = by_student(out)
    assert all(r["points"] == 0 and "changed the course's own files" in r["message"]
               for r in table["a_tamper"].values())
    assert not [s for s in table if s.startswith("z_after")]


# --------------------------------------------------------------------------- the real chapters

REAL_SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


def test_the_real_chapters_are_found():
    assert len(REAL_SOLUTIONS) >= 3  # an empty glob would silently skip the real-chapter tests below


@pytest.fixture(scope="module")
def real_graded(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("real")
    course, home = course_copy(tmp / "course"), tmp / "home"
    home.mkdir()
    for sol in REAL_SOLUTIONS:
        for who, folder in (("solution", ROOT / "solutions"), ("exercise", ROOT / "exercises")):
            (tmp / "subs" / who).mkdir(parents=True, exist_ok=True)
            shutil.copy(folder / sol.name, tmp / "subs" / who / sol.name)
    # AMP_GRADER_DEBUG: the grader prints each notebook's cell outcomes, per attempt, to stderr
    proc = grade(course, tmp / "subs", tmp / "out", home, "--cell-timeout", "120", timeout=900,
                 env_extra={"AMP_GRADER_DEBUG": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp / "out" / "gradebook.json").read_text())
    graded = {(r["student"], Path(r["notebook"]).name): [x for x in rows if x["notebook"] == r["notebook"]]
              for r in rows}
    cells = {}
    for line in proc.stderr.splitlines():
        name, _, events = line.partition(" ")
        if name.endswith(".ipynb") and events.startswith("["):
            who, notebook = Path(name).parts[-2:]
            attempts = json.loads(events)  # each attempt's cell outcomes: one attempt unless a cell hung or crashed
            cells[(who, notebook)] = attempts[0] if len(attempts) == 1 else attempts
    return {"rows": graded, "cells": cells}


def test_every_cell_of_every_solution_runs_without_error_in_the_grader(real_graded):
    """The solution notebooks are executed here, by the grader, not a second time by nbval (make test):
    so this is where a solution cell that raises must fail, as nbval would. (The exercise templates run
    under nbval; the grader reads them as stubs and starts no kernel for them.)"""
    for sol in REAL_SOLUTIONS:
        assert real_graded["cells"].get(("exercise", sol.name)) is None, "a kernel ran for a notebook of stubs"
        for who, folder in (("solution", ROOT / "solutions"),):
            outcomes = real_graded["cells"].get((who, sol.name))
            assert outcomes is not None, f"no cell outcomes for {who}/{sol.name}"
            n_code = sum(1 for c in nbformat.read(folder / sol.name, as_version=4).cells if c.cell_type == "code")
            bad = [(i + 1, o) for i, o in enumerate(outcomes) if o != "ok"]
            assert not bad and len(outcomes) == n_code, f"{who}/{sol.name}: cells (number, outcome) {bad}, " \
                                                         f"{len(outcomes)} of {n_code} code cells ran"


@pytest.mark.parametrize("solution", REAL_SOLUTIONS, ids=lambda p: p.stem)
def test_real_solution_scores_full_marks(real_graded, solution):
    rows = real_graded["rows"][("solution", solution.name)]
    failed = [(r["exercise"], r["status"], r["message"]) for r in rows if not r["passed"]]
    assert not failed and sum(r["max_points"] for r in rows) > 0


@pytest.mark.parametrize("solution", REAL_SOLUTIONS, ids=lambda p: p.stem)
def test_real_exercise_scores_zero_as_not_attempted(real_graded, solution):
    rows = real_graded["rows"][("exercise", solution.name)]
    assert rows and all(r["points"] == 0 and r["status"] == "not attempted" for r in rows), rows
    assert all("is still the exercise's stub" in r["message"] for r in rows), rows  # read from the source
