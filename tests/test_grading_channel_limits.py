"""The grader's end of the wire against a task process that writes anything, at any size and rate.

Whatever bytes a task process sends, the batch goes on: a message is parsed only by
`wire.read_message`, which never raises and checks the shape of what it parsed without recursion;
after the cases are sent, only a line carrying the open question's nonce is parsed at all; the
channel is read a bounded amount between looks at the clock, its buffer holds at most one partial
line, and a task that writes more than MAX_CHANNEL_BYTES is stopped. The grader's own failure on one
notebook becomes that notebook's rows, not the end of the run.

These tests drive the wire over a socket pair, with a stand-in for the task process (fast); the
class in tests/test_grader.py sends the same floods from real task processes, end to end.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from grading_class import GOOD_ADD, IMPORT, notebook

from course_lib.tooling import slicing
from course_lib.tooling.checkbase import Check, CheckFailure
from course_lib.tooling.grader import cli as grader
from course_lib.tooling.grader import wire
from course_lib.tooling.grader.wire import MAX_DEPTH, MAX_LINE, READ_PER_TURN, Channel, TaskProcess, read_message
from course_lib.tooling.task import MAX_ITEMS

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
    return Channel(ours), theirs


def _writer(sock: socket.socket, chunks, stop: threading.Event | None = None) -> threading.Thread:
    """Writes `chunks` (an iterable of bytes) to the process's end, in a thread, until done or stopped."""

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
    channel.nonce = b"f" * 32
    mib = b"1" * 2**20
    t = _writer(theirs, [b'{"nonce": "' + b"f" * 32 + b'", "response": '] + [mib] * 200 + [b"\n", b'{"ok": 1}\n'])
    lines, biggest, deadline = [], 0, time.monotonic() + 60
    while (t.is_alive() or channel.queued()) and time.monotonic() < deadline:
        lines += channel.lines()
        biggest = max(biggest, len(channel.buffer))
    lines += channel.lines()
    assert biggest <= MAX_LINE + READ_PER_TURN
    assert lines == [b'{"ok": 1}']  # the endless line is gone, the next one arrives whole
    assert channel.overlong == 1 and channel.lost == 1  # it carried the nonce: an answer, lost
    assert channel.received > 200 * 2**20


@pytest.mark.timing
def test_each_read_takes_a_bounded_amount_however_fast_the_process_writes():
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


def test_millions_of_tiny_lines_are_read_in_bounded_steps():
    channel, theirs = _pair()
    t = _writer(theirs, [b"1\n" * 500_000] * 6)  # 3,000,000 lines
    count, deadline = 0, time.monotonic() + 60
    while (t.is_alive() or channel.queued()) and time.monotonic() < deadline:
        count += len(channel.lines())
        assert len(channel.buffer) <= READ_PER_TURN
    count += len(channel.lines())
    assert count == 3_000_000


@pytest.mark.timing
def test_a_reply_the_process_does_not_read_costs_at_most_its_timeout_once():
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


# --------------------------------------------------------------------------- a task judged with a stand-in process


class Add(Check):
    name, args, points, time_limit = "99.add", ("add",), 2, 20.0

    def judge(self, cases, results):
        if results != [a + b for a, b in cases]:
            raise CheckFailure("wrong")


class StandIn(TaskProcess):
    """A task process played by a thread: it reads the code request, says the code loaded, reads the
    cases and then does `behave(nonce, sock)`: what a hostile task process could write."""

    def __init__(self, behave) -> None:
        self.ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.channel, self.ignored, self.why, self.watch = Channel(self.ours), 0, "forbidden", None
        self.done = threading.Event()

        def run() -> None:
            reader = theirs.makefile("rb")
            try:
                reader.readline()  # the statements to run
                theirs.sendall(b'{"loaded": {"errors": [], "missing": []}}\n')
                nonce = json.loads(reader.readline())["nonce"]
                behave(nonce, theirs)
            except OSError:
                pass
            finally:
                self.done.set()

        threading.Thread(target=run, daemon=True).start()

    def alive(self) -> bool:
        return not self.done.is_set() or bool(self.channel.queued())

    def over_memory(self) -> str:
        return ""

    def last_words(self) -> str:
        return ""

    def close(self) -> None:
        self.ours.close()


def judged_with(behave, check: Check | None = None, limit: float = 20) -> wire.Verdict:
    check = check or Add()
    nb = slicing.read([GOOD_ADD])
    boxes = type("Boxes", (), {"start": lambda self, c: StandIn(behave)})()
    return wire.judge_task(check, nb, [[1, 2], [3, 4]], boxes, limit, time.monotonic() + 120)


def answer(payload):
    """A stand-in whose answer is `payload(nonce)` (bytes), sent in pieces."""

    def behave(nonce: str, sock: socket.socket) -> None:
        data = payload(nonce)
        for i in range(0, len(data), 2**20):
            sock.sendall(data[i : i + 2**20])

    return behave


def head(nonce: str) -> bytes:
    return b'{"nonce": "' + nonce.encode() + b'", "response": '


ANSWERS = {
    "100,000 nested lists": (lambda n: head(n) + b"[" * DEEP + b"]" * DEEP + b"}\n", "nested more than 32"),
    "100,000 nested dicts": (lambda n: head(n) + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}\n", "nested more"),
    "mixed [{[{": (lambda n: head(n) + b'[{"a": ' * (DEEP // 2) + b"0" + b"}]" * (DEEP // 2) + b"}\n", "nested"),
    "invalid UTF-8": (lambda n: head(n) + b'{"results": ["\xff"]}}\n', "not UTF-8 text"),
    "a 10,000-digit integer": (lambda n: head(n) + b'{"results": [' + b"7" * 10_000 + b"]}}\n", "4300 digits"),
    "a 200 MB line": (lambda n: head(n) + b"1" * (200 * 2**20), "longer than 64 MiB"),
}


@pytest.mark.parametrize("name", ANSWERS)
def test_an_unreadable_answer_with_the_right_nonce_fails_with_the_reason(name):
    payload, why = ANSWERS[name]
    verdict = judged_with(answer(payload))
    assert verdict.status == "failed" and why in verdict.message, verdict


def test_an_honest_answer_still_counts_after_junk_on_the_channel():
    junk = b"[" * DEEP + b"\n" + b"\xff\xfe\n" + b"1\n" * 100_000

    def payload(nonce: str) -> bytes:
        return junk + json.dumps({"nonce": nonce, "response": {"results": [3, 7]}}).encode() + b"\n"

    verdict = judged_with(answer(payload))
    assert (verdict.status, verdict.message) == ("passed", "passed")
    assert any("ignored 100002 line(s)" in n for n in verdict.notes), verdict.notes  # none of it parsed


def test_two_answers_to_one_question_fail_both():
    def payload(nonce: str) -> bytes:
        one = json.dumps({"nonce": nonce, "response": {"results": [3, 7]}}).encode() + b"\n"
        return one + one

    verdict = judged_with(answer(payload))
    assert verdict.status == "failed" and "2 answers arrived" in verdict.message


FLOOD = """import os, sys, time
fd, chunk, end = int(sys.argv[1]), sys.argv[2].encode() * 65536, time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    os.write(fd, chunk)
"""


def flood(char: str, seconds: float, procs: list):
    """A stand-in that writes 64 KiB of `char` at a time, as fast as another process can, for `seconds`,
    never answering (a process of its own: it must outrun the reader)."""

    def behave(nonce: str, sock: socket.socket) -> None:
        fd = sock.fileno()
        proc = subprocess.Popen(
            [sys.executable, "-c", FLOOD, str(fd), char, str(seconds)], pass_fds=[fd], stderr=subprocess.DEVNULL
        )
        procs.append(proc)
        proc.wait()

    return behave


@pytest.fixture
def writers():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.timing
def test_a_flood_cannot_hold_a_task_past_its_time_limit(monkeypatch, writers):
    """While the process keeps writing, the time limit still holds (the flood would go on for 60 s; the
    byte cap is lifted so that only the clock can stop it). The bound is the task's limit plus the
    reader's turns: it holds on a busy machine, and a reader that waited for the flood would take 60 s."""
    monkeypatch.setattr(wire, "MAX_CHANNEL_BYTES", 2**50)
    check = Add()
    check.time_limit = 1.0
    started = time.monotonic()
    verdict = judged_with(flood("x", 60, writers), check)
    took = time.monotonic() - started
    assert verdict.status == "timed out", verdict
    assert took < 20, f"judged after {took:.1f} s"


def test_a_task_that_writes_more_than_the_cap_is_stopped_as_flooded(monkeypatch, writers):
    monkeypatch.setattr(wire, "MAX_CHANNEL_BYTES", 32 * 2**20)
    verdict = judged_with(flood("y", 60, writers))
    assert verdict.status == "failed" and "more than 32 MiB" in verdict.message, verdict


# --------------------------------------------------------------------------- the grader's own failures


class FakeCheck(Check):
    args, points = ("add",), 2

    def __init__(self, name: str) -> None:
        self.name = name


def _class(tmp_path: Path, students: list[str]) -> Path:
    """Notebooks of chapter 99 whose grading the tests below break on purpose."""
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
