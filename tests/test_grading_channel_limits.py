"""The grader's answer channel against a kernel that writes anything, at any size and rate (issue 27).

Whatever bytes a kernel sends, the batch goes on: a message is parsed only if it carries the open
question's nonce, by `runner.read_message`, which never raises and checks the shape of what it
parsed without recursion; the channel is read a bounded amount between looks at the clock, its
buffer holds at most one partial line, and a cell or task that writes more than
MAX_CHANNEL_BYTES is stopped. The grader's own failure on one notebook becomes that notebook's
rows, not the end of the run.

Most tests drive the runner's classes over a socket pair, with a stand-in for the kernel (fast);
one grader run grades a small class of hostile notebooks end to end, beside an honest one.
"""
from __future__ import annotations

import json
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_grader import GOOD_ADD, GOOD_CLIP, IMPORT, NAMESPACES, course_copy, grader_env, notebook

from course_lib.tooling import grader, runner
from course_lib.tooling.grading import MAX_ITEMS, REQUEST_PLEASE, Check, CheckFailure
from course_lib.tooling.runner import MAX_DEPTH, MAX_LINE, READ_PER_TURN, Attempt, Channel, Faults, read_message

DEEP = 100_000

# --------------------------------------------------------------------------- read_message


HOSTILE_LINES = {
    "lists 100,000 deep": (b"[" * DEEP + b"]" * DEEP, "nested more than 32 levels deep"),
    "dicts 100,000 deep": (b'{"a": ' * DEEP + b"1" + b"}" * DEEP, "nested more than 32 levels deep"),
    "mixed [{[{ 100,000 deep": (b'[{"a": ' * (DEEP // 2) + b"1" + b"}]" * (DEEP // 2), "nested more than 32"),
    "40 deep (parses, too deep)": (b"[" * 40 + b"]" * 40, "nested more than 32 levels deep"),
    "invalid UTF-8": (b'{"nonce": "\xff\xfe", "response": 1}', "not UTF-8 text"),
    "10,000-digit integer": (b'{"response": ' + b"9" * 10_000 + b"}", "4300 digits"),
    "too many values": (b"[" + b"0," * MAX_ITEMS + b"0]", f"more than {MAX_ITEMS:,} values"),
    "not JSON": (b"\x00{\x00}", "not JSON"),
    "a lone bracket": (b"[", "not JSON"),
}


@pytest.mark.parametrize("name", HOSTILE_LINES)
def test_read_message_never_raises_and_says_why_it_did_not_read_a_line(name):
    line, why = HOSTILE_LINES[name]
    message, problem = read_message(line)
    assert message is None and why in problem, problem


def test_read_message_reads_a_plain_answer_and_its_depth_limit_is_exact():
    message, problem = read_message(b'{"nonce": "n", "response": {"results": [[1, 2.5], {"array": [[1]]}, "x"]}}')
    assert problem == "" and message["response"]["results"][1] == {"array": [[1]]}
    assert read_message(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH)[1] == ""
    assert "nested" in read_message(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1))[1]


# --------------------------------------------------------------------------- Channel over a socket pair


def _pair() -> tuple[Channel, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Channel(ours, Faults()), theirs


def _writer(sock: socket.socket, chunks, stop: threading.Event | None = None) -> threading.Thread:
    """Writes `chunks` (an iterable of bytes) to the kernel's end, in a thread, until done or stopped."""

    def run() -> None:
        try:
            for chunk in chunks:
                if stop is not None and stop.is_set():
                    return
                sock.sendall(chunk)
        except OSError:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_200_mb_line_without_newline_is_dropped_as_it_arrives_and_the_buffer_stays_bounded():
    channel, theirs = _pair()
    channel.reset(b"f" * 32)
    mib = b"1" * 2**20
    t = _writer(theirs, [b'{"nonce": "' + b"f" * 32 + b'", "response": '] + [mib] * 200 + [b"\n", b'{"ok": 1}\n'])
    lines, biggest, deadline = [], 0, time.monotonic() + 60
    while (t.is_alive() or channel.queued()) and time.monotonic() < deadline:
        lines += channel.lines()
        biggest = max(biggest, len(channel.buffer))
    lines += channel.lines()
    assert biggest <= MAX_LINE + READ_PER_TURN
    assert lines == [b'{"ok": 1}']  # the endless line is gone, the next one arrives whole
    assert channel.faults.overlong == 1 and channel.lost == 1  # it carried the nonce: an answer, lost
    assert channel.received > 200 * 2**20
    t = _writer(theirs, [b"1" * 2**20] * 65)  # a line never ended: the next question's answer must not join it
    while t.is_alive() or channel.queued():
        channel.lines()
    channel.reset(b"e" * 32)
    theirs.sendall(b'{"next": 1}\n')
    time.sleep(0.05)
    assert channel.lines() == [b'{"next": 1}']


def test_each_read_takes_a_bounded_amount_however_fast_the_kernel_writes():
    channel, theirs = _pair()
    stop = threading.Event()
    _writer(theirs, iter(lambda: b"x" * 2**16 + b"\n", None), stop)
    try:
        time.sleep(0.2)
        for _ in range(20):
            before, started = channel.received, time.monotonic()
            channel.lines()
            assert channel.received - before <= READ_PER_TURN
            assert time.monotonic() - started < 1.0
    finally:
        stop.set()
        theirs.close()


def test_millions_of_tiny_lines_are_counted_not_kept():
    channel, theirs = _pair()
    t = _writer(theirs, [b"1\n" * 500_000] * 6)  # 3,000,000 lines
    attempt = object.__new__(Attempt)
    attempt.channel, attempt.faults = channel, channel.faults
    deadline = time.monotonic() + 60
    while (t.is_alive() or channel.queued()) and time.monotonic() < deadline:
        attempt.drain()
        assert len(channel.buffer) <= READ_PER_TURN
    attempt.drain()
    assert channel.faults.ignored == 3_000_000


def test_a_reply_the_kernel_does_not_read_costs_at_most_its_timeout_once():
    channel, theirs = _pair()
    started = time.monotonic()
    for _ in range(100_000):  # far more than a socket buffer holds
        channel.reply({"nonce": "n", "error": "x" * 100}, timeout=0.3)
        if channel.deaf:
            break
    for _ in range(1000):
        channel.reply({"nonce": "n", "error": "x"}, timeout=0.3)
    assert channel.deaf and time.monotonic() - started < 5
    theirs.close()


# --------------------------------------------------------------------------- Attempt with a stand-in kernel


class FakeKernel:
    """Jupyter's side of an Attempt: `execute` hands the code to `behave(code, sock, done)` in a
    thread, which writes to the kernel's end of the channel and calls done(status) to reply (or never)."""

    def __init__(self, sock: socket.socket, behave) -> None:
        self.sock, self.behave, self.replies = sock, behave, queue.Queue()
        self.session = self
        self.control_channel = self
        self.interrupts = 0

    def execute(self, code: str, **kw) -> str:
        msg_id = f"m{time.monotonic_ns()}"

        def done(status: str = "ok") -> None:
            self.replies.put({"parent_header": {"msg_id": msg_id}, "content": {"status": status}})

        threading.Thread(target=self.behave, args=(code, self.sock, done), daemon=True).start()
        return msg_id

    def get_shell_msg(self, timeout: float = 0):
        return self.replies.get_nowait()  # queue.Empty: no reply yet

    def msg(self, kind: str, content: dict) -> dict:  # session.msg
        return {"kind": kind}

    def send(self, msg: dict) -> None:  # control_channel.send: an interrupt
        self.interrupts += 1


class Alive:
    def poll(self):
        return None


def fake_attempt(behave) -> tuple[Attempt, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    attempt = object.__new__(Attempt)
    attempt.faults = Faults()
    attempt.ours, attempt.channel = ours, Channel(ours, attempt.faults)
    attempt.kc, attempt.proc, attempt.watch, attempt.time_up = FakeKernel(theirs, behave), Alive(), None, 0.0
    return attempt, theirs


FLOOD = """import os, sys, time
fd, chunk, end = int(sys.argv[1]), sys.argv[2].encode() * 65536, time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    os.write(fd, chunk)
"""


def flood(char: str, seconds: float, procs: list):
    """A kernel that writes 64 KiB of `char` at a time, as fast as another process can, for `seconds`,
    never answering and deaf to interrupts (a process of its own: it must outrun the reader)."""

    def behave(code: str, sock: socket.socket, done) -> None:
        fd = sock.fileno()
        procs.append(subprocess.Popen([sys.executable, "-c", FLOOD, str(fd), char, str(seconds)], pass_fds=[fd],
                                      stderr=subprocess.DEVNULL))

    return behave


@pytest.fixture
def writers():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_a_flood_cannot_hold_a_cell_past_its_time_limit(monkeypatch, writers):
    """The audit's case: while the kernel keeps writing, the time limit still holds (the flood
    would go on for 60 s; the byte cap is lifted so that only the clock can stop it)."""
    monkeypatch.setattr(runner, "INTERRUPT_GRACE_S", 0.5)
    monkeypatch.setattr(runner, "MAX_CHANNEL_BYTES", 2**50)
    attempt, theirs = fake_attempt(flood("x", 60, writers))  # no newline: one endless line
    started = time.monotonic()
    try:
        outcome = attempt.execute("while True: flood()", timeout=1.0)
    finally:
        theirs.close()
    took = time.monotonic() - started
    assert outcome == "hung" and attempt.kc.interrupts == 1
    assert took < 1.0 + 0.5 + 1.5, f"judged after {took:.1f} s"
    assert len(attempt.channel.buffer) <= MAX_LINE + READ_PER_TURN


def test_a_cell_that_writes_more_than_the_cap_is_stopped_as_flooded(monkeypatch, writers):
    monkeypatch.setattr(runner, "MAX_CHANNEL_BYTES", 32 * 2**20)
    attempt, theirs = fake_attempt(flood("y", 60, writers))
    started = time.monotonic()
    try:
        outcome = attempt.execute("flood()", timeout=30)
    finally:
        theirs.close()
    assert outcome == "flooded" and time.monotonic() - started < 10
    assert Faults(cells={2: "flooded"}).note().startswith("cell 3 wrote more than")


class Add(Check):
    name, args, points, time_limit = "99.add", ("add",), 2, 20.0

    def judge(self, cases, results):
        if results != [a + b for a, b in cases]:
            raise CheckFailure("wrong")


def the_question(sock: socket.socket) -> dict:
    """What serve(None, ...) does first: ask for the task's question on the channel and read it."""
    sock.setblocking(True)
    sock.sendall((json.dumps(REQUEST_PLEASE) + "\n").encode())
    line = b""
    while not line.endswith(b"\n"):
        line += sock.recv(1)
    return json.loads(line)


def answering(payload):
    """A kernel whose serve writes `payload(nonce)` (bytes) to the channel, then replies."""

    def behave(code: str, sock: socket.socket, done) -> None:
        nonce = the_question(sock)["nonce"]
        data = payload(nonce)
        try:
            for i in range(0, len(data), 2**20):
                sock.sendall(data[i : i + 2**20])
        except OSError:
            pass
        done("ok")

    return behave


def head(nonce: str) -> bytes:
    return b'{"nonce": "' + nonce.encode() + b'", "response": '


ANSWERS = {
    "100,000 nested lists": (lambda n: head(n) + b"[" * DEEP + b"]" * DEEP + b"}\n", "nested more than 32"),
    "100,000 nested dicts": (lambda n: head(n) + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}\n", "nested more"),
    "mixed [{[{": (lambda n: head(n) + b'[{"a": ' * (DEEP // 2) + b"0" + b"}]" * (DEEP // 2) + b"}\n", "nested"),
    "invalid UTF-8": (lambda n: head(n) + b'{"results": ["\xff"]}}\n', "not UTF-8 text"),
    "a 10,000-digit integer": (lambda n: head(n) + b'{"results": [' + b"7" * 10_000 + b"]}}\n", "4300 digits"),
    "a 200 MB line": (lambda n: head(n) + b"1" * (200 * 2**20), "longer than 64 MiB, so it was not read"),
}


@pytest.mark.parametrize("name", ANSWERS)
def test_an_unreadable_answer_with_the_right_nonce_is_rejected_with_the_reason(name):
    payload, why = ANSWERS[name]
    attempt, theirs = fake_attempt(answering(payload))
    try:
        what, message = attempt.task(Add(), [[1, 2], [3, 4]])
    finally:
        theirs.close()
    assert what == "rejected" and why in message, message


def test_an_honest_answer_still_counts_after_junk_on_the_channel():
    junk = b"[" * DEEP + b"\n" + b"\xff\xfe\n" + b"1\n" * 100_000

    def payload(nonce: str) -> bytes:
        return junk + json.dumps({"nonce": nonce, "response": {"results": [3, 7]}}).encode() + b"\n"

    attempt, theirs = fake_attempt(answering(payload))
    try:
        assert attempt.task(Add(), [[1, 2], [3, 4]]) == ("answered", {"results": [3, 7]})
    finally:
        theirs.close()
    assert attempt.faults.ignored == 100_002  # none of the junk was parsed: it carried no nonce


# --------------------------------------------------------------------------- the grader's own failures


class FakeCheck(Check):
    args, points = ("add",), 2

    def __init__(self, name: str) -> None:
        self.name = name


def _class(tmp_path: Path, students: list[str]) -> Path:
    subs = tmp_path / "subs"
    for s in students:
        (subs / s).mkdir(parents=True)
        (subs / s / "99_fixture.ipynb").write_text(notebook([IMPORT, GOOD_ADD]))
    return subs


def test_an_exception_on_one_submission_becomes_its_rows_and_a_rerun_finishes(tmp_path, monkeypatch, capsys):
    """RecursionError inside the sandbox run (its earned rows kept) and inside grade_submission
    itself: each becomes 'not graded' rows, the batch goes on, exit 0, and a rerun resumes."""
    subs, out = _class(tmp_path, ["a_honest", "b_breaks_the_run", "c_breaks_grading"]), tmp_path / "out"
    checks = [FakeCheck("99.add"), FakeCheck("99.clip")]
    monkeypatch.setattr(grader, "checks_for", lambda chapter: checks)
    monkeypatch.setattr(grader.sandbox, "learner_library", lambda ws: ws)

    def run_in_sandbox(sub, checks, opts, emit):
        emit(checks[0], "passed", "passed")
        if sub.student == "b_breaks_the_run":
            raise RecursionError("maximum recursion depth exceeded")
        emit(checks[1], "passed", "passed")

    real = grader.grade_submission

    def grade_submission(sub, *a):
        if sub.student == "c_breaks_grading":
            raise RecursionError("maximum recursion depth exceeded while encoding a JSON object")
        return real(sub, *a)

    monkeypatch.setattr(grader, "_run_in_sandbox", run_in_sandbox)
    monkeypatch.setattr(grader, "grade_submission", grade_submission)
    argv = [str(subs), "--out", str(out), "--isolation", "session", "--jobs", "2"]
    assert grader.main(argv) == 0
    rows = {(r["student"], r["exercise"]): r for r in json.loads((out / "gradebook.json").read_text())}
    assert rows["a_honest", "99.add"]["points"] == 2 and rows["a_honest", "99.clip"]["points"] == 2
    assert rows["b_breaks_the_run", "99.add"]["status"] == "passed"  # judged before the failure: kept
    for key in [("b_breaks_the_run", "99.clip"), ("c_breaks_grading", "99.add"), ("c_breaks_grading", "99.clip")]:
        row = rows[key]
        assert row["status"] == "not graded" and row["points"] == 0, row
        assert "the grader itself failed" in row["message"] and "RecursionError" in row["message"]
        assert "grade it again" in row["message"]
    assert "recorded it as not graded" in capsys.readouterr().err
    assert grader.main(argv) == 0  # the same gradebook: resumes, nothing stops it
    assert "resuming: 3 of 3 submissions already graded" in capsys.readouterr().out


def test_a_changed_course_still_stops_the_run_loudly(tmp_path, monkeypatch, capsys):
    subs = _class(tmp_path, ["a"])
    monkeypatch.setattr(grader.sandbox, "learner_library", lambda ws: ws)

    def changed(*a):
        raise grader.CourseChanged("the course's files changed while a/99_fixture.ipynb was graded")

    monkeypatch.setattr(grader, "grade_submission", changed)
    assert grader.main([str(subs), "--out", str(tmp_path / "out"), "--isolation", "session"]) == 2
    assert "stopped: the course's files changed" in capsys.readouterr().err


def test_a_kernels_string_cannot_break_the_gradebook():
    sub = grader.Submission(Path("x.ipynb"), "s/99_x.ipynb", "s", "99")
    row = grader._row(sub, FakeCheck("99.add"), False, "failed", "`\ud800" + "x" * 10**6 + "` is not defined")
    json.dumps(row, ensure_ascii=False).encode("utf-8")
    assert len(row["message"]) < 2100


# --------------------------------------------------------------------------- a hostile class, graded

# Each hostile notebook writes its code into a module and imports it: the runtime limits tested here
# must hold whatever the kernel runs, whether or not the grader's reading of the source would see it.
HOSTILE_PRELUDE = '''
import os, signal, time
import course_lib.tooling.grading as grading
REAL_SERVE = grading.serve
FD = int(os.environ["AMP_ANSWER_FD"])

def send(data):
    view = memoryview(data)
    while view:
        view = view[os.write(FD, view[: 1 << 20]):]

def head(request):
    return ('{"nonce": "%s", "response": ' % request["nonce"]).encode()

def question():  # what serve(None, ...) does first: ask for the task's question, read it
    send(b'{"next": true}\\n')
    line = b""
    while not line.endswith(b"\\n"):
        line += os.read(FD, 1)
    return __import__("json").loads(line)

def hostile_serve(task):
    def serve(request, namespace):
        request = request or question()
        if request["name"] in task:
            return task[request["name"]](request)
        return REAL_SERVE(request, namespace)
    grading.serve = serve
'''

DEEPEST = str(DEEP)
HOSTILE_MODULES = {
    "deep_answers": f'''
hostile_serve({{
    "99.add": lambda r: send(head(r) + b"[" * {DEEPEST} + b"]" * {DEEPEST} + b"}}\\n"),
    "99.clip": lambda r: send(head(r) + b'{{"a": ' * {DEEPEST} + b"1" + b"}}" * {DEEPEST} + b"}}\\n"),
}})''',
    "odd_answers": f'''
hostile_serve({{
    "99.add": lambda r: send(head(r) + b'[{{"a": ' * {DEEP // 2} + b"1" + b"}}]" * {DEEP // 2} + b"}}\\n"),
    "99.clip": lambda r: send(head(r) + b'{{"results": [' + b"9" * 10000 + b']}}}}\\n'),
}})''',
    "bad_utf8_answer": '''
hostile_serve({"99.add": lambda r: send(head(r) + b'{"results": ["\\xff\\xfe"]}}\\n')})''',
    "a_200_mb_line": '''
hostile_serve({"99.add": lambda r: [send(head(r))] + [send(b"1" * (1 << 20)) for _ in range(200)]})''',
    "floods_in_cells": '''
send(b"1\\n" * 3_000_000)  # millions of tiny lines
send(b"[" * 100_000 + b"\\n" + b'[{"a": ' * 50_000 + b"\\n")  # deep, but no nonce: never parsed
''',
    "floods_a_task_past_its_time": '''
def slow_flood(request):  # ~13 MB/s, below the byte cap, for a minute, deaf to interrupts
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        send(b"z" * 65536)
        time.sleep(0.005)
hostile_serve({"99.clip": slow_flood})''',
    "floods_a_task_at_full_speed": '''
def fast_flood(request):
    chunk = b"w" * (1 << 20)
    while True:
        send(chunk)
hostile_serve({"99.add": fast_flood})''',
}
FLOOD_A_CELL_FAST = "import hostile\nwhile True:\n    hostile.send(b'q' * (1 << 20))"
FLOOD_A_CELL_SLOWLY = "import hostile, time\nwhile True:  # interruptible\n    hostile.send(b'p' * 65536)\n" \
                      "    time.sleep(0.005)"


WRONG_CLIP = "LIMIT = 3.0\n\ndef clip(x):\n    return x"


def hostile_notebook(name: str) -> str:
    module = HOSTILE_PRELUDE + HOSTILE_MODULES[name]
    load = f"from pathlib import Path\nPath('hostile.py').write_text({module!r})\nimport hostile"
    cells = [IMPORT, load, GOOD_ADD, GOOD_CLIP]
    if name == "floods_in_cells":
        cells = [IMPORT, load, FLOOD_A_CELL_FAST, FLOOD_A_CELL_SLOWLY, GOOD_ADD, WRONG_CLIP]
    return notebook(cells)


def _watch(proc: subprocess.Popen, journal: Path, seen: dict, peak: list) -> None:
    """Until the grader exits: when each gradebook row first appears, and its peak resident memory.
    The journal is read once more after the exit: the last rows may be written just before it."""
    offset = 0
    while True:
        running = proc.poll() is None
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            peak[0] = max(peak[0], int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024)
        except (OSError, AttributeError):
            pass
        if journal.exists():
            with open(journal) as f:
                f.seek(offset)
                for line in f.readlines():
                    if line.endswith("\n"):
                        offset += len(line.encode())
                        entry = json.loads(line)
                        if entry["kind"] == "row":
                            key = (entry["submission"].split("/")[0], entry["row"]["exercise"])
                            seen.setdefault(key, time.monotonic())
        if not running:
            return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def hostile_class(tmp_path_factory) -> dict:
    if not NAMESPACES:
        pytest.skip("this machine cannot create user namespaces")
    tmp = tmp_path_factory.mktemp("channel")
    course = course_copy(tmp / "course")
    home, subs, out = tmp / "home", tmp / "subs", tmp / "out"
    home.mkdir()
    (subs / "honest").mkdir(parents=True)
    (subs / "honest" / "99_fixture.ipynb").write_text(notebook([IMPORT, GOOD_ADD, GOOD_CLIP]))
    for name in HOSTILE_MODULES:
        (subs / name).mkdir()
        (subs / name / "99_fixture.ipynb").write_text(hostile_notebook(name))
    argv = [sys.executable, "-m", "course_lib.tooling.grader", str(subs), "--out", str(out), "--jobs", "2",
            "--cell-timeout", "8", "--total-timeout", "120"]
    # The reading of the notebook's source off: these notebooks are to reach the kernel, whatever that
    # reading would make of them, since the limits tested here must hold whatever the kernel runs.
    env = {**grader_env(course, home), "AMP_GRADER_NO_SOURCE_READING": "1"}
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=course, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen: dict = {}
    peak = [0]
    watcher = threading.Thread(target=_watch, args=(proc, out / "gradebook.jsonl", seen, peak), daemon=True)
    watcher.start()
    stdout, stderr = proc.communicate(timeout=400)
    watcher.join()
    rows = json.loads((out / "gradebook.json").read_text()) if (out / "gradebook.json").exists() else []
    table: dict = {}
    for r in rows:
        table.setdefault(r["student"], {})[r["exercise"]] = r
    return {"rc": proc.returncode, "out": stdout + stderr, "table": table, "seen": seen, "peak": peak[0],
            "seconds": time.monotonic() - started}


def grades(table: dict, student: str) -> dict:
    return {ex: (r["points"], r["status"]) for ex, r in table[student].items()}


needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason="this machine cannot create user namespaces")


@needs_namespaces
def test_the_batch_finishes_and_the_honest_notebook_gets_its_full_grade(hostile_class):
    assert hostile_class["rc"] == 0, hostile_class["out"]
    assert set(hostile_class["table"]) == {"honest", *HOSTILE_MODULES}
    assert grades(hostile_class["table"], "honest") == {"99.add": (2, "passed"), "99.clip": (1, "passed")}


@needs_namespaces
@pytest.mark.parametrize("student, task, why", [
    ("deep_answers", "99.add", "nested more than 32 levels deep"),
    ("deep_answers", "99.clip", "nested more than 32 levels deep"),
    ("odd_answers", "99.add", "nested more than 32 levels deep"),
    ("odd_answers", "99.clip", "4300 digits"),
    ("bad_utf8_answer", "99.add", "it is not UTF-8 text"),
    ("a_200_mb_line", "99.add", "longer than 64 MiB, so it was not read"),
    ("floods_a_task_at_full_speed", "99.add", "wrote more than 256 MiB to the grader's answer channel"),
    ("floods_a_task_past_its_time", "99.clip", "took longer than 5 s"),
])
def test_each_hostile_answer_gets_zero_and_a_clear_reason(hostile_class, student, task, why):
    row = hostile_class["table"][student][task]
    assert row["points"] == 0 and why in row["message"], row


@needs_namespaces
def test_the_tasks_a_hostile_notebook_left_alone_keep_their_points(hostile_class):
    t = hostile_class["table"]
    assert grades(t, "a_200_mb_line")["99.clip"] == (1, "passed")
    assert grades(t, "bad_utf8_answer")["99.clip"] == (1, "passed")
    assert grades(t, "floods_a_task_at_full_speed")["99.clip"] == (1, "passed")  # in a fresh kernel
    assert grades(t, "floods_a_task_past_its_time")["99.add"] == (2, "passed")


@needs_namespaces
def test_floods_in_cells_move_no_limit_and_are_reported(hostile_class):
    """3,000,000 tiny lines, deep lines without a nonce, a cell that floods past the 256 MiB cap
    (abandoned, the notebook run again without it) and one that floods past its time limit."""
    t = hostile_class["table"]["floods_in_cells"]
    assert grades(hostile_class["table"], "floods_in_cells") == {"99.add": (2, "passed"), "99.clip": (0, "failed")}
    note = t["99.clip"]["message"]  # a failed task carries the notes: the clip here is wrong on purpose
    assert "cell 3 wrote more than 256 MiB to the grader's answer channel; the grader ran the notebook again" in note
    assert re.search(r"ignored \d{7,} message\(s\)", note), note


@needs_namespaces
def test_a_flooded_task_is_judged_within_its_time_limit_not_after_the_flood(hostile_class):
    """The flood in 99.clip lasts 60 s and ignores interrupts: the grader judges the task at its
    5 s limit plus the interrupt grace (10 s), while the flood would still run."""
    seen = hostile_class["seen"]
    took = seen["floods_a_task_past_its_time", "99.clip"] - seen["floods_a_task_past_its_time", "99.add"]
    assert took < 5 + runner.INTERRUPT_GRACE_S + 6, f"judged {took:.0f} s after the task before it"


@needs_namespaces
def test_the_graders_memory_stays_bounded(hostile_class):
    """A 200 MB line, 256 MiB floods, 3 million lines: two jobs each hold at most about a line at a time."""
    assert 0 < hostile_class["peak"] < 400 * 2**20, f"peak {hostile_class['peak'] / 2**20:.0f} MiB"
