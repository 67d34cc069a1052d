"""The sandbox's memory cap counts what the machine really loses: resident memory, not address space.

`import torch` alone reserves about 3 GB of address space (0.5 GB resident), so the old cap on
address space failed fair answers. Now `sandbox.MemoryWatch` sums the resident memory of all a
sandbox's processes and kills them once the sum is over the cap; the grader then says so in the row.
The unit tests drive sandbox.start and the watch directly, with small scripts; the last one grades
fixture notebooks (chapter 99) with the real grader, as tests/test_grader.py does.
"""

from __future__ import annotations

import secrets
import sys
import threading
import time
from pathlib import Path

import pytest
from grading_class import GOOD_ADD, GOOD_CLIP, IMPORT, notebook
from test_grader import by_student, course_copy, grade

from course_lib.tooling.grader import sandbox
from course_lib.tooling.grader.wire import default_limits

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watch reads Linux's /proc")
MiB, GiB = 2**20, 2**30
LEVELS = ["session", *(["namespaces"] if sandbox.available() else [])]


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    return sandbox.learner_library(tmp_path_factory.mktemp("workspace"))


def boxed(
    tmp_path: Path, library: Path, level: str, code: str, cap: int, limits: dict | None = None, timeout: float = 60
) -> dict:
    """Run `python -c code` in a sandbox under the grader's limits (or `limits`) and a memory watch."""
    box = tmp_path / f"box-{secrets.token_hex(4)}"
    box.mkdir()
    token = secrets.token_hex(8)
    env = sandbox.environment(box, token, {}, library)
    if level == "namespaces":
        env.update(sandbox.namespace_env(box, library, [library.parent]))
    limits = {**default_limits(cap, 120)} if limits is None else limits
    threads = threading.active_count()
    started = time.monotonic()
    with open(box / "log", "wb") as log:
        proc = sandbox.start(sandbox.command(level, [sys.executable, "-c", code], limits), env, box / "work", log)
    watch = sandbox.MemoryWatch(proc, token, cap)
    try:
        rc = proc.wait(timeout)
        seconds = time.monotonic() - started
        for _ in range(40):  # what the watch killed is gone without sandbox.end's help
            left = sandbox._pids_with_token(token)
            if not left:
                break
            time.sleep(0.05)
    finally:
        watch.stop()
        sandbox.end(proc, token)
    assert threading.active_count() == threads, "the watch left a thread behind"
    return {
        "rc": rc,
        "log": (box / "log").read_text(errors="replace"),
        "killed": watch.killed,
        "seconds": seconds,
        "left": left,
    }


GROWS = """
import time
hog = []
for _ in range(30):  # 600 MiB in 20 MiB steps, each one touched
    hog.append(b"\\1" * (20 * 2**20))
    time.sleep(0.025)
print("survived", flush=True)
time.sleep(30)
"""

CHILDREN = """
import subprocess, sys, time
hold = "import time; x = b'\\\\1' * (200 * 2**20); time.sleep(30)"  # 200 MiB each: under the cap alone
kids = [subprocess.Popen([sys.executable, "-c", hold], start_new_session=bool(i)) for i in range(2)]
time.sleep(30)
"""

FORKED = """
import os, time
x = b"\\1" * (200 * 2**20)
kids = []
for _ in range(3):  # like DataLoader workers: they share the parent's pages until they write them
    pid = os.fork()
    if pid == 0:
        time.sleep(1.5)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
print("done", flush=True)
"""

MAPS = """
import mmap
m = mmap.mmap(-1, 4 * 2**30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # 4 GiB of address space
m[: 2**20] = b"\\1" * 2**20  # 1 MiB of it resident
print("mapped", flush=True)
"""

TORCH = """
import torch
t = torch.ones(2**29)  # 2 GiB of float32, every page written
assert t.sum().item() == 2**29
print("fits", flush=True)
"""


@pytest.mark.timing
@pytest.mark.parametrize("level", LEVELS)
def test_growing_past_the_cap_is_killed_promptly(tmp_path, library, level):
    run = boxed(tmp_path, library, level, GROWS, 300 * MiB)
    assert run["rc"] != 0 and "survived" not in run["log"], run
    assert run["killed"] is not None and run["killed"] > 300 * MiB
    assert run["seconds"] < 10 and not run["left"], run


@pytest.mark.parametrize("level", LEVELS)
def test_child_processes_count_together_even_in_a_session_of_their_own(tmp_path, library, level):
    run = boxed(tmp_path, library, level, CHILDREN, 300 * MiB)
    assert run["rc"] != 0 and run["killed"] is not None and run["killed"] > 300 * MiB, run
    assert not run["left"], "every process of the sandbox was killed"


def test_forked_workers_sharing_their_parents_pages_count_them_once(tmp_path, library, monkeypatch):
    # resident memory summed is ~4 x 210 MiB, over the cap; what the machine holds is ~260 MiB
    run = boxed(tmp_path, library, LEVELS[-1], FORKED, 400 * MiB)
    assert run["rc"] == 0 and "done" in run["log"] and run["killed"] is None, run
    monkeypatch.setattr(sandbox, "_proportional", sandbox._resident)  # shared pages counted once per process
    run = boxed(tmp_path, library, LEVELS[-1], FORKED, 400 * MiB)
    assert run["killed"] is not None and "done" not in run["log"], "the case needs PSS"


def test_address_space_without_resident_memory_passes_where_the_old_cap_failed_it(tmp_path, library):
    now = boxed(tmp_path, library, LEVELS[-1], MAPS, 300 * MiB)
    assert now["rc"] == 0 and "mapped" in now["log"] and now["killed"] is None, now
    before = boxed(tmp_path, library, LEVELS[-1], MAPS, 300 * MiB, limits={"as": 300 * MiB, "cpu": 120})
    assert before["rc"] != 0 and "mapped" not in before["log"]  # the old cap: address space


def test_torch_and_a_2_gib_tensor_fit_a_3_gib_cap(tmp_path, library):
    pytest.importorskip("torch")
    run = boxed(tmp_path, library, LEVELS[-1], TORCH, 3 * GiB, timeout=120)
    assert run["rc"] == 0 and "fits" in run["log"] and run["killed"] is None, run


def test_the_watch_ends_with_its_processes_and_on_stop(tmp_path):
    proc = sandbox.start([sys.executable, "-c", "pass"], {"AMP_SANDBOX": "w"}, tmp_path, None)
    watch = sandbox.MemoryWatch(proc, "w-" + secrets.token_hex(8), GiB)
    proc.wait(30)
    watch._thread.join(5)
    assert not watch._thread.is_alive() and watch.killed is None
    proc = sandbox.start([sys.executable, "-c", "import time; time.sleep(30)"], {}, tmp_path, None)
    watch = sandbox.MemoryWatch(proc, "w-" + secrets.token_hex(8), GiB)
    watch.stop()
    assert not watch._thread.is_alive() and proc.poll() is None
    sandbox.end(proc, "nothing")


HOG = 'HOG = [b"\\1" * 2**25 for _ in range(40)]  # 1.25 GiB'


@pytest.mark.slow
def test_the_grader_says_a_task_or_its_code_used_too_much_memory_and_other_tasks_keep_their_points(tmp_path):
    course = course_copy(tmp_path / "course")
    home = tmp_path / "home"
    (home / ".ipython").mkdir(parents=True)
    cells = {
        "task_hog": [IMPORT, f"def add(a, b):\n    global HOG\n    {HOG}\n    return a + b", GOOD_CLIP],
        "cell_hog": [
            IMPORT,
            GOOD_ADD,
            f"{HOG}\nimport time\ntime.sleep(5)\nLIMIT = 3.0 + 0 * len(HOG)",
            "def clip(x):\n    return max(-LIMIT, min(LIMIT, x))",
        ],
        "hog_nobody_needs": [IMPORT, f"{HOG}\nimport time\ntime.sleep(5)", GOOD_ADD, GOOD_CLIP],
    }
    for student, source in cells.items():
        (tmp_path / "subs" / student).mkdir(parents=True)
        (tmp_path / "subs" / student / "99_fixture.ipynb").write_text(notebook(source))
    proc = grade(course, tmp_path / "subs", tmp_path / "out", home, "--memory-gb", "0.5", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = by_student(tmp_path / "out")
    add, clip = table["task_hog"]["99.add"], table["task_hog"]["99.clip"]
    assert add["status"] == "crashed" and "used more than 512 MiB of memory (resident)" in add["message"], add
    assert clip["status"] == "passed" and clip["points"] == 1
    add, clip = table["cell_hog"]["99.add"], table["cell_hog"]["99.clip"]
    assert add["status"] == "passed"
    assert clip["status"] == "crashed" and "more than 512 MiB" in clip["message"] and "cell 3" in clip["message"], clip
    assert all(r["passed"] for r in table["hog_nobody_needs"].values())  # its cell never runs
