"""What a task's sandbox holds: its own folder and the learner library, nothing else, and none of the
modules the task forbids.

The grader's class test (test_grader.py) shows the consequences; this one looks inside the sandbox
directly, with a script that reports what it can see and do.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.tooling.grader import sandbox

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sandbox.available(), reason="this machine cannot create user namespaces")

LOOK = r"""
import json, os, subprocess, sys
paths = json.loads(sys.argv[1])
report = {"exists": {p: os.path.exists(p) for p in paths}}
import course_lib.tooling.task, course_lib.tooling.probes
report["library"] = os.path.dirname(course_lib.__file__)
try:
    import course_lib.tooling.checks
    report["checks"] = True
except ImportError:
    report["checks"] = False
import importlib, pkgutil
report["probes"] = {}
for m in pkgutil.iter_modules(course_lib.tooling.probes.__path__):
    try:
        importlib.import_module("course_lib.tooling.probes." + m.name)
        report["probes"][m.name] = "ok"
    except Exception as e:
        report["probes"][m.name] = f"{type(e).__name__}: {e}"
report["capabilities"] = open("/proc/self/status").read().split("CapEff:")[1].split()[0]
report["pid"] = os.getpid()
def writable(path):
    try:
        with open(path, "w") as f:
            f.write("x")
        return True
    except OSError:
        return False
report["writes"] = {p: writable(p) for p in json.loads(sys.argv[2])}
report["remount"] = subprocess.run(["mount", "-o", "remount,rw", "/usr"], capture_output=True).returncode
report["root"] = sorted(os.listdir("/"))
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    workspace = tmp_path_factory.mktemp("workspace")
    library = sandbox.learner_library(workspace)
    other, box = workspace / "box-other", workspace / "box-mine"
    (other / "work").mkdir(parents=True)
    (other / "work" / "01_formats_exercises.ipynb").write_text("another student's notebook")
    box.mkdir()
    submissions, gradebook = tmp_path_factory.mktemp("submissions"), tmp_path_factory.mktemp("gradebook")
    (gradebook / "gradebook.jsonl").write_text("{}")
    env = {
        **sandbox.environment(box, "look", {}, library),
        **sandbox.namespace_env(box, library, [workspace, submissions, gradebook]),
    }
    look = [
        str(ROOT / "solutions"),
        str(ROOT / "course_lib" / "tooling" / "checks"),
        str(ROOT / "exercises"),
        str(other / "work" / "01_formats_exercises.ipynb"),
        str(submissions),
        str(gradebook / "gradebook.jsonl"),
        str(library / "course_lib" / "tooling" / "checks"),
        str(library / "course_lib" / "tooling" / "grader"),
        str(Path.home() / ".bashrc"),
        str(library / "data" / "fashion_mnist_20k.npz"),
        str(box / "work"),
    ]
    write = [
        str(box / "work" / "mine.txt"),
        str(library / "course_lib" / "evil.py"),
        "/usr/evil",
        "/tmp/scratch",
        str(Path(sys.prefix) / "evil"),
    ]
    done = subprocess.run(
        sandbox.command("namespaces", [sys.executable, "-c", LOOK, json.dumps(look), json.dumps(write)]),
        env=env,
        cwd=box,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return {
        "report": json.loads(done.stdout.strip().splitlines()[-1]),
        "library": library,
        "box": box,
        "other": other,
        "submissions": submissions,
        "gradebook": gradebook,
    }


def test_the_checkout_solutions_and_checks_are_not_there(seen):
    exists = seen["report"]["exists"]
    for hidden in (ROOT / "solutions", ROOT / "course_lib" / "tooling" / "checks", ROOT / "exercises"):
        assert exists[str(hidden)] is False, hidden
    assert seen["report"]["checks"] is False  # import course_lib.tooling.checks fails inside


def test_the_learner_library_is_there_without_the_graders_secrets(seen):
    exists, library = seen["report"]["exists"], seen["library"]
    assert seen["report"]["library"] == str(library / "course_lib")
    assert exists[str(library / "data" / "fashion_mnist_20k.npz")]
    assert not exists[str(library / "course_lib" / "tooling" / "checks")]
    assert not exists[str(library / "course_lib" / "tooling" / "grader")]  # the grader's side: a folder, left out


def test_other_submissions_the_submissions_folder_and_the_gradebook_are_not_there(seen):
    exists = seen["report"]["exists"]
    assert not exists[str(seen["other"] / "work" / "01_formats_exercises.ipynb")]
    assert not exists[str(seen["submissions"])]
    assert not exists[str(seen["gradebook"] / "gradebook.jsonl")]
    assert not exists[str(Path.home() / ".bashrc")]  # the grader's HOME: at most the Python installed in it


def test_only_the_sandbox_folder_and_tmp_are_writable(seen):
    writes = seen["report"]["writes"]
    assert writes[str(seen["box"] / "work" / "mine.txt")] and writes["/tmp/scratch"]
    assert not writes[str(seen["library"] / "course_lib" / "evil.py")]
    assert not writes["/usr/evil"] and not writes[str(Path(sys.prefix) / "evil")]
    assert not (seen["library"] / "course_lib" / "evil.py").exists()


def test_no_capabilities_so_nothing_can_be_remounted(seen):
    assert int(seen["report"]["capabilities"], 16) == 0
    assert seen["report"]["remount"] != 0
    assert seen["report"]["pid"] < 10  # a PID namespace of its own


def test_the_root_is_built_from_a_short_list(seen):
    assert "home" not in seen["report"]["root"] and "var" not in seen["report"]["root"]


def test_every_probe_module_imports_without_the_checks(seen):
    """A probe that needs a check module would fail in every sandbox: the kernel side must stand alone."""
    probes = seen["report"]["probes"]
    expected = {p.stem for p in (ROOT / "course_lib" / "tooling" / "probes").glob("ch*.py")}
    assert set(probes) == expected and all(v == "ok" for v in probes.values()), probes


def test_the_loopback_is_up_without_iproute2(tmp_path):
    # Bare GPU images have no `ip`: there the sandbox came up with its loopback down, and a submission
    # whose two processes talk over 127.0.0.1 failed. Here a broken `ip` stands in for the missing one.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ip").write_text("#!/bin/sh\nexit 1\n")
    (fake / "ip").chmod(0o755)
    box, library = tmp_path / "box", sandbox.learner_library(tmp_path)
    box.mkdir()
    env = {**sandbox.environment(box, "lo", {}, library), **sandbox.namespace_env(box, library, [tmp_path])}
    env["PATH"] = f"{fake}:{env['PATH']}"
    talk = (
        "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
        "c = socket.create_connection(s.getsockname(), timeout=5); a, _ = s.accept(); c.sendall(b'ok'); "
        "print(a.recv(2).decode())"
    )
    done = subprocess.run(
        sandbox.command("namespaces", [sys.executable, "-c", talk]),
        env=env,
        cwd=box,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr


ABSENT_LOOK = r"""
import importlib, json, os, subprocess, sys, sysconfig
tries = {}
def attempt(name, how):
    try:
        how()
        tries[name] = "imported"
    except ImportError as e:
        tries[name] = str(e)[:200]
    except Exception as e:
        tries[name] = f"{type(e).__name__}: {e}"[:200]
attempt("import", lambda: __import__("statistics"))
attempt("importlib", lambda: importlib.import_module("statis" + "tics"))
attempt("another Python's copy", lambda: (sys.path.insert(0, "/usr/lib/python3.11"), __import__("statistics")))
path = os.path.join(sysconfig.get_paths()["stdlib"], "statistics.py")
attempt("exec of its file", lambda: exec(open(path).read(), {}))
attempt("a child process", lambda: subprocess.run([sys.executable, "-c", "import statistics"], check=True,
                                                  capture_output=True))
attempt("the course's own", lambda: importlib.import_module("course_lib.chapters.ch04.accumulation"))
attempt("the course's core", lambda: importlib.import_module("course_lib.device"))
attempt("the task machinery", lambda: importlib.import_module("course_lib.tooling.task"))
print(json.dumps(tries))
"""


def test_a_tasks_forbidden_modules_are_absent_however_they_are_imported(tmp_path):
    """statistics (a fixture task's) and chapter 04's loop: a read-only stand-in over every copy, so no
    spelling, no other Python's copy, no child process and no exec of the file finds them; what the
    task does not forbid (the core) and what the task process runs itself stay."""
    library, box = sandbox.learner_library(tmp_path), tmp_path / "box"
    box.mkdir()
    masks = sandbox.absent_modules(("statistics", "course_lib.chapters"), library, tmp_path / "stand-ins", "forbidden")
    env = {**sandbox.environment(box, "absent", {}, library), **sandbox.namespace_env(box, library, [tmp_path], masks)}
    done = subprocess.run(
        sandbox.command("namespaces", [sys.executable, "-c", ABSENT_LOOK]),
        env=env,
        cwd=box,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    tries = json.loads(done.stdout.strip().splitlines()[-1])
    for how in ("import", "importlib", "another Python's copy", "exec of its file", "the course's own"):
        assert "is not available while this task is judged" in tries[how], (how, tries[how])
    assert "Error" in tries["a child process"] or "not available" in tries["a child process"]
    assert tries["the course's core"] == "imported" and tries["the task machinery"] == "imported"
