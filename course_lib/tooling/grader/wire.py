"""The grader's end of the wire: one task judged in a task process of its own, whatever that process does.

Used by the batch grader (one call per task of every submission) and by the inline check() alike,
so that both say the same thing about the same notebook:

1. `judge_task` reads the notebook's source (course_lib/tooling/slicing.py): a task whose function
   is still the exercise's stub is not attempted; otherwise the statements its functions need are
   its *slice*. The cases are drawn by the caller and stay here.
2. It starts the task process (course_lib/tooling/task.py) in a sandbox of its own
   (`Sandboxes.start`, course_lib/tooling/grader/sandbox.py): a fresh folder and HOME, the task's
   forbidden modules absent, a memory cap, and a socket pair whose one end only this process holds.
3. It sends the slice; the process runs it and says what raised. Then, and only then, it sends the
   public cases and a fresh nonce; the probe may ask questions (answered by the check's `host`);
   exactly one answer carrying that nonce must come back before the task's time limit. The process
   is then ended, with everything it started.
4. The answer is judged here (course_lib.tooling.checkbase.judge_response): nothing the process prints,
   writes or sends can claim a pass, only values compared with answers computed here.

Whatever the process writes, at whatever rate, no limit moves: the channel is read a bounded amount
between looks at the clock (`Channel`), capped in bytes per task, and a line is parsed only by
`read_message`, which never raises and refuses what no answer looks like (too long, too deep, too
many values). A process that dies, hangs or floods costs its own task and nothing else.
"""

from __future__ import annotations

import ast
import fcntl
import json
import secrets
import select
import shutil
import socket
import struct
import sys
import tempfile
import termios
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import slicing
from ..checkbase import Check, cannot_judge_here, judge_response
from ..task import ANSWER_FD_ENV, MAX_ITEMS
from . import sandbox

__all__ = ["Sandboxes", "Verdict", "judge_task", "Channel", "read_message", "MAX_CHANNEL_BYTES", "MAX_LINE"]

MAX_LINE = 64 * 2**20  # bytes: the largest message a task process may send
# The channel is read a bounded amount per turn of the wait loop, which looks at the clock every
# turn: a process that writes without end cannot hold the grader in its read, past any time limit.
READ_PER_TURN = 2**20  # bytes
MAX_CHANNEL_BYTES = 256 * 2**20  # per task: a process that writes more is stopped
MAX_DEPTH = 32  # nesting of a message (answers are plain data, a few levels deep)
MAX_ASKS = 10_000  # questions for the grader per task (a probe asks a few dozen)
BOOT = "import course_lib.tooling.task as t; t.main()"  # what the task process runs


def read_message(line: bytes) -> tuple[Any, str]:
    """One line from the channel as plain data, or (None, why it was not read). Never raises.

    Whatever the bytes: not UTF-8, not JSON, an integer too long to convert, nesting deep enough
    to overflow a recursive parser, or more values than any answer holds. What comes back is
    checked before anything recursive (a judge, json.dumps into the gradebook) touches it."""
    try:
        if len(line) > MAX_LINE:
            return None, f"it is longer than {MAX_LINE >> 20} MiB"
        text = bytes(line).decode("utf-8")
        # json.loads would build every value before the shape is checked: count them first (each
        # value but the first follows a comma or an opening bracket)
        if text.count(",") + text.count("[") + text.count("{") > MAX_ITEMS:
            return None, f"it holds more than {MAX_ITEMS:,} values"
        try:
            value = json.loads(text)
        except RecursionError:
            return None, f"it is nested more than {MAX_DEPTH} levels deep"
        problem = _shape_problem(value)
    except UnicodeDecodeError:
        return None, "it is not UTF-8 text"
    except ValueError as e:  # not JSON, or an integer of more digits than Python converts
        return None, f"it is not JSON that the grader reads ({_clip(e)})"
    except MemoryError:
        return None, "it is too large to read"
    except Exception as e:  # noqa: BLE001  nothing a process sends may stop the grader
        return None, f"it could not be read ({type(e).__name__})"
    return (None, problem) if problem else (value, "")


def _shape_problem(value: Any) -> str:
    """Why a parsed message is no plain answer (too deep, too many values), found without recursion."""
    stack, count = ([(value, 1)] if isinstance(value, (list, dict)) else []), 1
    while stack:  # only containers are stacked
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"it is nested more than {MAX_DEPTH} levels deep"
        values = item.values() if isinstance(item, dict) else item
        count += len(values)
        if count > MAX_ITEMS:
            return f"it holds more than {MAX_ITEMS:,} values"
        stack.extend((v, depth + 1) for v in values if isinstance(v, (list, dict)))
    return ""


def _clip(e: Any, limit: int = 120) -> str:
    try:
        text = str(e)
    except Exception:  # noqa: BLE001
        text = type(e).__name__
    return text if len(text) <= limit else text[:limit] + " …"


class Channel:
    """The grader's end of a task process's socket, read so that no process can outlast a limit.

    Each `lines()` reads at most READ_PER_TURN bytes, so the wait loop that calls it looks at the
    clock between reads however fast the process writes; the buffer holds at most one partial line
    of MAX_LINE bytes (a longer one is dropped as it arrives); `received` counts every byte, for
    the cap MAX_CHANNEL_BYTES."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setblocking(False)
        self.buffer = bytearray()
        self.skipping = False  # inside a line longer than MAX_LINE: dropped up to its end
        self.received = 0
        self.nonce = b""  # the open question's: an overlong line that carries it was meant as an answer
        self.lost = 0  # overlong lines that carried the nonce
        self.overlong = 0
        self.deaf = False  # a reply could not be sent in time: the process does not read them

    @property
    def flooded(self) -> bool:
        return self.received > MAX_CHANNEL_BYTES

    def queued(self) -> int:
        """Bytes the process has written that were not read yet."""
        try:
            return struct.unpack("i", fcntl.ioctl(self.sock, termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:
            return 0

    def lines(self) -> list[bytes]:
        """The whole lines among the next READ_PER_TURN bytes (or fewer) that arrived."""
        lines: list[bytes] = []
        got = 0
        while got < READ_PER_TURN:
            try:
                chunk = self.sock.recv(min(1 << 20, READ_PER_TURN - got))
            except OSError:  # BlockingIOError: nothing more for now
                break
            if not chunk:
                break
            got += len(chunk)
            self.received += len(chunk)
            if self.skipping:
                end = chunk.find(b"\n")
                if end < 0:
                    continue
                chunk, self.skipping = chunk[end + 1 :], False
            self.buffer += chunk
            if b"\n" in chunk:
                *whole, rest = self.buffer.split(b"\n")
                lines.extend(bytes(line) for line in whole)
                self.buffer = bytearray(rest)
            if len(self.buffer) > MAX_LINE:
                if self.nonce and self.nonce in self.buffer:
                    self.lost += 1
                self.buffer, self.skipping = bytearray(), True
                self.overlong += 1
        return lines

    def reply(self, message: dict, timeout: float) -> None:
        """Send one line to the process, giving up after `timeout` s (and on every later reply)."""
        if self.deaf:
            return
        data = json.dumps(message).encode() + b"\n"
        try:
            self.sock.settimeout(max(0.05, min(10.0, timeout)))
            self.sock.sendall(data)
        except OSError:
            self.deaf = True
        finally:
            self.sock.setblocking(False)


@dataclass
class Sandboxes:
    """How task processes are started: the isolation level, where their folders go, what they see."""

    level: str  # "namespaces" or "session" (course_lib/tooling/grader/sandbox.py)
    workspace: Path  # each task's sandbox folder is made here
    library: Path  # the learner library (sandbox.learner_library)
    hidden: tuple[Path, ...] = ()  # folders no sandbox may see: submissions, gradebook
    memory: int = 6 * 2**30  # resident bytes of a task process and everything it starts
    limits: dict[str, int] = field(default_factory=dict)  # prlimit's: address space, CPU seconds

    @classmethod
    def here(cls, workspace: Path | None = None, memory_gb: float = 6, cpu_seconds: int = 1800) -> Sandboxes:
        """The best level this machine allows, with a learner library of its own (the inline check)."""
        level = "namespaces" if sandbox.available() else "session"
        workspace = Path(workspace or tempfile.mkdtemp(prefix="amp-check-"))
        library = sandbox.learner_library(workspace)
        memory = int(memory_gb * 2**30)
        return cls(level, workspace, library, (), memory, default_limits(memory, cpu_seconds))

    def start(self, check: Check) -> TaskProcess:
        return TaskProcess(self, check)


def default_limits(memory: int, cpu_seconds: int) -> dict[str, int]:
    """prlimit's caps: address space only as a far backstop (torch alone reserves ~3 GB of it; none
    with CUDA, which reserves far more), and CPU seconds."""
    return {"as": 0 if _cuda_visible() else memory + 16 * 2**30, "cpu": cpu_seconds}


def _cuda_visible() -> bool:
    if "torch" not in sys.modules:
        return False
    import torch  # another thread may be importing it (a chapter's checks): this waits until it is whole

    return bool(torch.cuda.is_available())


class TaskProcess:
    """One task process in a sandbox of its own, with the grader's end of its channel."""

    def __init__(self, boxes: Sandboxes, check: Check) -> None:
        self.box = Path(tempfile.mkdtemp(prefix="task-", dir=boxes.workspace))
        self.token = secrets.token_hex(12)
        self.ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.channel = Channel(self.ours)
        self.ignored = 0  # lines that answered no open question
        env = sandbox.environment(self.box, self.token, {ANSWER_FD_ENV: str(theirs.fileno())}, boxes.library)
        why = f"this task asks you not to use it ({check.forbidden_why})" if check.forbidden_why else "forbidden"
        if boxes.level == "namespaces":
            masks = sandbox.absent_modules(tuple(check.forbidden), boxes.library, boxes.workspace / "stand-ins", why)
            env.update(sandbox.namespace_env(self.box, boxes.library, [boxes.workspace, *boxes.hidden], masks))
        self.why = why
        argv = sandbox.command(boxes.level, [sys.executable, "-c", BOOT], boxes.limits)
        self.watch = None
        try:
            with open(self.box / "task.log", "ab") as log:
                self.proc = sandbox.start(argv, env, self.box / "work", log, pass_fds=(theirs.fileno(),))
            theirs.close()
            self.watch = sandbox.MemoryWatch(self.proc, self.token, boxes.memory) if boxes.memory else None
        except BaseException:
            theirs.close()
            self.close()
            raise

    def alive(self) -> bool:
        return getattr(self, "proc", None) is not None and self.proc.poll() is None

    def over_memory(self) -> str:
        """The memory cap in words ('6 GiB') if the memory watch killed this process, else ''."""
        if self.watch is None or self.watch.killed is None:
            return ""
        cap = self.watch.cap
        return f"{cap / 2**30:g} GiB" if cap >= 2**30 else f"{cap / 2**20:g} MiB"

    def send(self, message: dict, deadline: float) -> None:
        self.channel.reply(message, deadline - time.monotonic())

    def wait(self, deadline: float | list[float], on_line) -> str:
        """Read lines into `on_line(line) -> bool` (True: done) until it is done ('ok') or the process
        'died', went past `deadline` ('timeout'; a one-item list may be moved by `on_line`) or wrote
        past the cap ('flooded')."""
        until = deadline if isinstance(deadline, list) else [deadline]
        while True:
            ready = select.select([self.ours], [], [], 0.02)[0]
            if ready or not self.alive():
                done = [on_line(line) for line in self.channel.lines()]  # every line read: none dropped
                if any(done):
                    return "ok"
                if self.channel.flooded:
                    return "flooded"
                if not self.alive() and not self.channel.queued():
                    if any([on_line(line) for line in self.channel.lines()]):  # what arrived with the end
                        return "ok"
                    return "died"
            if time.monotonic() > until[0]:
                return "timeout"

    def last_words(self) -> str:
        """The last line the task process wrote to its log (for the instructor's notes), or ''."""
        try:
            with open(self.box / "task.log", "rb") as log:
                log.seek(max(0, log.seek(0, 2) - 2000))
                lines = [line.strip() for line in log.read().decode("utf-8", "replace").splitlines() if line.strip()]
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        if getattr(self, "proc", None) is not None:
            sandbox.end(self.proc, self.token)
        self.ours.close()
        shutil.rmtree(self.box, ignore_errors=True)


@dataclass
class Verdict:
    """A task's grade: its status, the learner's message, and notes for the instructor."""

    status: str
    message: str
    notes: list[str] = field(default_factory=list)


def _where(loading: list) -> str:
    return f"cell {loading[0]}, line {loading[1]}" if loading else "its first statement"


def judge_task(
    check: Check, nb: slicing.Notebook, cases: list, boxes: Sandboxes, cell_limit: float, deadline: float
) -> Verdict:
    """Grade one task of a notebook (module docstring): never raises for anything the notebook does.
    `cell_limit`: seconds each statement the task needs may run; `deadline`: when everything must be done."""
    fn = check.args[0]
    stubs = slicing.stub_tasks(nb, check.args)
    if stubs:
        return Verdict(
            "not attempted", f"not attempted yet: `{stubs[0]}` is still the exercise's stub (NotImplementedError)"
        )
    sl = slicing.needed(nb, check.args)
    if sl.missing:
        return Verdict("not attempted", f"`{sl.missing[0]}` is not defined in the notebook: define it in a cell")
    why = cannot_judge_here(check)
    if why:
        return Verdict("not graded", why)
    notes = [f"{n} in what {fn} runs" for n in sl.digging()]
    proc = boxes.start(check)
    try:
        return _judge(check, nb, sl, cases, proc, cell_limit, deadline, notes)
    finally:
        proc.close()


def _judge(check, nb, sl, cases, proc: TaskProcess, cell_limit, deadline, notes) -> Verdict:
    fn = check.args[0]
    load_until = [min(deadline, time.monotonic() + cell_limit + 30)]  # + starting Python and the probe's imports
    proc.send({"name": check.name, "args": list(check.args), **sl.request(nb),
               "forbidden": list(check.forbidden), "why": proc.why}, load_until[0])  # fmt: skip
    loading: list = []
    loaded: list[dict] = []

    def on_load_line(line: bytes) -> bool:
        # Only the task process's own two messages are parsed (a flood of junk costs a prefix test
        # per line, however much of it the notebook's statements write while they load)
        if not line.startswith((b'{"loading": ', b'{"loaded": ')):
            proc.ignored += 1 if line.strip() else 0
            return False
        message, _ = read_message(line)
        if isinstance(message, dict) and isinstance(message.get("loading"), list):
            loading[:] = message["loading"][:2]
            load_until[0] = min(deadline, time.monotonic() + cell_limit)  # each statement its own time
        elif isinstance(message, dict) and isinstance(message.get("loaded"), dict):
            loaded.append(message["loaded"])
            return True
        else:
            proc.ignored += 1
        return False

    outcome = proc.wait(load_until, on_load_line)
    if outcome != "ok":
        last = proc.last_words()
        if outcome == "died" and last and not loading:  # before any statement of the notebook ran
            notes.append(f"the task process ended before the notebook's code ran: {last}")
        return _broken(check, proc, outcome, f"while the grader ran what {fn} needs ({_where(loading)})", notes)
    report = loaded[0]
    errors = [e for e in report.get("errors", []) if isinstance(e, dict)][:20]
    notes += [f"{_error(e)} while the grader loaded what {fn} needs" for e in errors]
    for module in [m for m in report.get("best_effort", []) if isinstance(m, str)]:
        if _mentions(sl, module):  # the task's own code names it: say how it was kept out
            notes.append(f"{module} was imported before the notebook's code ran, so only an import hook kept it out")
    missing = [m for m in report.get("missing", []) if isinstance(m, str)]
    absent = next((e for e in errors if e.get("absent")), None)
    if missing and absent is not None:
        return Verdict("failed", _needs_forbidden(check, absent), notes)
    if missing:
        why = f": {_error(errors[-1])}" if errors else ""
        return Verdict("not attempted", f"`{missing[0]}` is not defined when its statements run{why}", notes)
    nonce = secrets.token_hex(16)
    proc.channel.nonce = nonce.encode()
    task_until = min(deadline, time.monotonic() + check.time_limit)
    proc.send({"nonce": nonce, "cases": [check.public(c) for c in cases]}, task_until)
    answers: list = []
    trouble: list[str] = []
    asked = [0]

    def on_task_line(line: bytes) -> bool:
        if nonce.encode() not in line:  # no message for this question: not even parsed
            proc.ignored += 1 if line.strip() else 0
            return False
        message, why = read_message(line)  # shape checked: nothing below recurses into it
        if message is None:
            trouble.append(f"a message for this task on the answer channel could not be read: {why}")
            return False
        if not isinstance(message, dict) or message.get("nonce") != nonce:
            proc.ignored += 1
            return False
        if "ask" in message:  # the probe asks the grader (e.g. to sleep a time only it knows)
            _answer(check, cases, message, answers, trouble, asked, proc, nonce, task_until)
        elif "response" in message:
            answers.append(message["response"])
            return True  # the one answer: what the process may write after it is not read
        else:
            proc.ignored += 1
        return False

    outcome = proc.wait(task_until, on_task_line)
    if outcome == "ok":  # anything already sent behind the answer (a second answer) counts too
        time.sleep(0.05)
        for line in proc.channel.lines():
            on_task_line(line)
    if proc.channel.lost:
        trouble.append(f"the answer for this task was longer than {MAX_LINE >> 20} MiB, so it was not read")
    if len(answers) > 1:
        return Verdict("failed", f"{len(answers)} answers arrived for this task, where the grader's own code "
                       "sends one: the notebook wrote answers itself, so none of them counts", notes)  # fmt: skip
    if trouble:
        return Verdict("failed", trouble[0], notes)
    if outcome == "died" and proc.channel.overlong:
        return Verdict("failed", f"a line longer than {MAX_LINE >> 20} MiB arrived on the answer channel, so the "
                       "answer behind it was not read", notes)  # fmt: skip
    if outcome != "ok":
        return _broken(check, proc, outcome, "while this task was being checked", notes)
    status, message = judge_response(check, cases, answers[0])
    if status == "failed":
        absent = next((e for e in errors if e.get("absent")), None)
        if absent is not None:
            message = (
                f"{fn} needs {absent['absent']} ({_where([absent['cell'], absent['line']])}), which this "
                f"task asks you not to use" + (f": {check.forbidden_why}" if check.forbidden_why else "")
            )
        elif errors:
            message += f" (while the grader loaded what {fn} needs, {_error(errors[0])})"
    if proc.ignored:
        notes.append(f"the grader ignored {proc.ignored} line(s) the notebook wrote to the answer channel itself")
    return Verdict(status, message, notes)


def _answer(check, cases, message, answers, trouble, asked, proc, nonce, until) -> None:
    i = message.get("case")
    asked[0] += 1

    def reply(body: dict) -> None:
        proc.send({"nonce": nonce, **body}, until)

    if asked[0] > MAX_ASKS:
        if asked[0] == MAX_ASKS + 1:
            trouble.append(f"the notebook asked the grader more than {MAX_ASKS:,} questions")
        reply({"error": "too many questions"})
    elif answers or not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(cases):
        trouble.append("a question for the grader arrived out of order")
        reply({"error": "out of order"})
    elif time.monotonic() > until:  # a host may sleep: none past the time limit
        reply({"error": "the task's time is up"})
    else:
        try:
            reply({"reply": check.host(cases[i], message["ask"])})
        except Exception as e:  # noqa: BLE001  a malformed question is the notebook's
            reply({"error": f"{type(e).__name__}: {_clip(e, 200)}"[:200]})


def _mentions(sl: slicing.Slice, module: str) -> bool:
    """Does the code a task runs name `module` (its last part, as a name, an attribute or an import)?"""
    last = module.split(".")[-1]
    for s in sl.statements:
        for node in ast.walk(s.node):
            if (isinstance(node, ast.Name) and node.id == last) or (
                isinstance(node, ast.Attribute) and node.attr == last
            ):
                return True
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                if any(n == module or n.startswith(module + ".") for n in names):
                    return True
    return False


def _needs_forbidden(check: Check, absent: dict) -> str:
    why = f": {check.forbidden_why}" if check.forbidden_why else ""
    where = _where([absent.get("cell"), absent.get("line")])
    return f"{check.args[0]} needs {absent['absent']} ({where}), which this task asks you not to use{why}"


def _error(e: dict) -> str:
    return f"cell {e.get('cell')}, line {e.get('line')} raised {_clip(e.get('error', ''), 200)}"


def _broken(check: Check, proc: TaskProcess, outcome: str, during: str, notes: list[str]) -> Verdict:
    """The verdict for a task process that did not answer: it died, ran out of time or flooded."""
    memory = proc.over_memory()
    if memory:
        return Verdict("crashed", f"your notebook used more than {memory} of memory (resident) {during}, so the "
                       "grader stopped it; other tasks keep their points", notes)  # fmt: skip
    if outcome == "died":
        return Verdict("crashed", f"your notebook's Python process stopped {during} (a crash, os._exit or a "
                       "kill); other tasks keep their points", notes)  # fmt: skip
    if outcome == "flooded":
        return Verdict(
            "failed",
            f"your notebook wrote more than {MAX_CHANNEL_BYTES >> 20} MiB to the grader's "
            f"answer channel {during}, so the grader stopped it; other tasks keep their points",
            notes,
        )
    if "checked" in during:
        return Verdict("timed out", f"checking this task took longer than {check.time_limit:g} s (an endless loop?)",
                       notes)  # fmt: skip
    return Verdict("timed out", f"the grader stopped running your notebook's code {during}: it took too long "
                   "(an endless loop, or a long computation the task does not need?)", notes)  # fmt: skip
