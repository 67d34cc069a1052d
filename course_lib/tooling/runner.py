"""Runs one submission for the grader: its kernel in the sandbox, its cells, then one task at a time.

Everything here runs in the grader's process; only the kernel runs in the sandbox
(course_lib.tooling.sandbox), and it is untrusted by construction. The grader drives it over
Jupyter's messaging on unix sockets in the sandbox folder, and reads answers from a socket pair
it created for this kernel alone (`Attempt`):

1. The notebook's code cells run first (outputs are not read: a flood costs nothing). No case,
   nonce or answer exists yet, so nothing the cells write to the channel can be an answer: it is
   counted and reported as ignored.
2. Then, per task, the grader sends the kernel the task's public part, its public cases and a
   fresh nonce (`grading.serve`). While the task runs, the probe may ask the grader questions
   (answered by the check's `host`); then exactly one answer carrying that nonce must come back.
   An answer with another nonce, a second answer, or one after the task's time is rejected.
   Whatever a kernel writes, at whatever rate, no limit moves: the channel is read a bounded
   amount between looks at the clock (`Channel`), capped in bytes per cell and task, and only a
   line that carries the open question's nonce is parsed, by `read_message`, which never raises.
3. A kernel that dies or cannot be stopped costs only what it was doing: the grader starts a
   fresh attempt, runs the cells again (without a cell that killed or hung the kernel) and goes
   on with the next task (`run_submission`).
"""

from __future__ import annotations

import fcntl
import json
import secrets
import select
import socket
import struct
import sys
import termios
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import sandbox
from .grading import ANSWER_FD_ENV, MAX_ITEMS, REQUEST_PLEASE, Check, judge_response

__all__ = ["code_cells", "Attempt", "Channel", "run_submission", "Faults", "read_message"]

INTERRUPT_GRACE_S = 10  # how long an interrupted cell may take to stop before the kernel is abandoned
MAX_LINE = 64 * 2**20  # bytes: the largest message a kernel may send on the channel
# The channel is read a bounded amount per turn of the wait loop, which looks at the clock every
# turn: a kernel that writes without end cannot hold the grader in its read, past any time limit.
READ_PER_TURN = 2**20  # bytes
MAX_CHANNEL_BYTES = 256 * 2**20  # per cell or task: a kernel that writes more is stopped
MAX_DEPTH = 32  # nesting of a message (answers are plain data, a few levels deep)
MAX_ASKS = 10_000  # questions for the grader per task (a probe asks a few dozen)
BOOTSTRAP = "import course_lib.tooling.grading, course_lib.tooling.probes"  # before the notebook's cells
MAX_ATTEMPTS = 4  # fresh kernels per submission: each one is paid for by a crash or a hang


def code_cells(path: Path) -> list[str]:
    """The code cells' sources of a notebook file (nbformat 4), read as plain JSON."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    sources = [c["source"] for c in cells if isinstance(c, dict) and c.get("cell_type") == "code"]
    return ["".join(s) if isinstance(s, list) else str(s) for s in sources]


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
    except Exception as e:  # noqa: BLE001  nothing a kernel sends may stop the grader
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


def _clip(e: BaseException, limit: int = 120) -> str:
    try:
        text = str(e)
    except Exception:  # noqa: BLE001
        text = type(e).__name__
    return text if len(text) <= limit else text[:limit] + " …"


@dataclass
class Faults:
    """What went wrong in a submission's run, in the grader's own words (never the kernel's)."""

    cells: dict[int, str] = field(default_factory=dict)  # cell index -> 'hung' / 'died' / 'memory'
    ignored: int = 0  # messages on the channel that answered no open question
    no_kernel: bool = False  # a kernel did not start at all
    outcomes: list[list[str]] = field(default_factory=list)  # per attempt, each cell's outcome
    memory: str = ""  # the memory cap in words, once a kernel was killed for going over it
    overlong: int = 0  # messages longer than MAX_LINE, dropped unread

    def note(self) -> str:
        parts = []
        for i, what in sorted(self.cells.items()):
            did = {
                "hung": "ran too long and could not be stopped",
                "memory": f"used more than {self.memory} of memory (resident)",
                "flooded": f"wrote more than {MAX_CHANNEL_BYTES >> 20} MiB to the grader's answer channel",
            }.get(what, "stopped the Python process")
            parts.append(f"cell {i + 1} {did}; the grader ran the notebook again without it")
        if self.ignored:
            parts.append(
                f"the grader ignored {self.ignored} message(s) that the notebook wrote to the answer channel itself"
            )
        if self.overlong:
            parts.append(
                f"the grader dropped {self.overlong} message(s) longer than {MAX_LINE >> 20} MiB, unread, "
                "that the notebook wrote to the answer channel"
            )
        return "; ".join(parts)


class Channel:
    """The grader's end of a kernel's answer channel, read so that no kernel can outlast a limit.

    Each `lines()` reads at most READ_PER_TURN bytes, so the wait loop that calls it looks at the
    clock between reads however fast the kernel writes; the buffer holds at most one partial line
    of MAX_LINE bytes (a longer one is dropped as it arrives); `received` counts the bytes since
    the last `reset()`, for the per-cell and per-task cap MAX_CHANNEL_BYTES."""

    def __init__(self, sock: socket.socket, faults: Faults) -> None:
        self.sock, self.faults = sock, faults
        sock.setblocking(False)
        self.buffer = bytearray()
        self.skipping = False  # inside a line longer than MAX_LINE: dropped up to its end
        self.received = 0
        self.nonce = b""  # the open question's: an overlong line that carries it was meant as an answer
        self.lost = 0  # overlong lines that carried the nonce
        self.deaf = False  # a reply could not be sent in time: the kernel does not read them

    def reset(self, nonce: bytes = b"") -> None:
        """Before a cell or a task: a line begun before it is no message of it, whatever follows."""
        self.received, self.nonce, self.lost = 0, nonce, 0
        self.buffer, self.skipping = bytearray(), False

    @property
    def flooded(self) -> bool:
        return self.received > MAX_CHANNEL_BYTES

    def queued(self) -> int:
        """Bytes the kernel has written that were not read yet."""
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
                self.faults.overlong += 1
        return lines

    def reply(self, message: dict, timeout: float) -> None:
        """Send one line to the kernel, giving up after `timeout` s (and on every later reply)."""
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


class Attempt:
    """One fresh kernel of a submission, started in its sandbox, with the grader's answer channel."""

    def __init__(
        self,
        box: Path,
        level: str,
        env: dict[str, str],
        log_path: Path,
        faults: Faults,
        limits: dict[str, int] | None = None,
        memory: int | None = None,
    ) -> None:
        """`limits` go to prlimit (sandbox.command); `memory`, in bytes, caps the resident memory of the
        kernel and every process it starts together (sandbox.MemoryWatch)."""
        from jupyter_client.blocking import BlockingKernelClient

        self.box, self.token, self.faults = box, env["AMP_SANDBOX"], faults
        self.ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.channel = Channel(self.ours, faults)
        self.time_up = 0.0  # when the code running now reaches its time limit
        run = box / "run"
        for stale in run.glob("kernel*"):
            stale.unlink()
        self.kc = BlockingKernelClient(connection_file=str(run / "kernel.json"))
        self.kc.transport, self.kc.ip = "ipc", str(run / "kernel")
        self.kc.session.key = secrets.token_hex(16).encode()
        self.kc.write_connection_file()
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", str(run / "kernel.json")]
        with open(log_path, "ab") as log:
            self.proc = sandbox.start(
                sandbox.command(level, argv, limits),
                {**env, ANSWER_FD_ENV: str(theirs.fileno())},
                box / "work",
                log,
                pass_fds=(theirs.fileno(),),
            )
        theirs.close()
        self.watch = None
        try:
            self.watch = sandbox.MemoryWatch(self.proc, self.token, memory) if memory else None
            self.kc.start_channels(iopub=False, stdin=False, hb=False)
            self.ready = self._wait_ready(120)
        except BaseException:  # a kernel must not outlive a start that failed: the batch goes on without it
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            self.kc.kernel_info()
            try:
                reply = self.kc.get_shell_msg(timeout=2)
            except Exception:  # noqa: BLE001  queue.Empty, or a message that is not one
                continue
            if isinstance(reply, dict) and reply.get("msg_type") == "kernel_info_reply":  # any of our requests'
                return True
        return False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def over_memory(self) -> str:
        """The memory cap in words ('6 GiB') if the memory watch killed this kernel, else ''."""
        if self.watch is None or self.watch.killed is None:
            return ""
        cap = self.watch.cap
        return f"{cap / 2**30:g} GiB" if cap >= 2**30 else f"{cap / 2**20:g} MiB"

    # -- the answer channel

    def drain(self) -> None:
        """Count and drop whatever the kernel wrote while no question was open (nothing is parsed)."""
        self.faults.ignored += len([line for line in self.channel.lines() if line.strip()])

    # -- running code

    def _interrupt(self) -> None:
        msg = self.kc.session.msg("interrupt_request", content={})
        self.kc.control_channel.send(msg)

    def execute(self, code: str, timeout: float, on_channel: Callable[[], None] | None = None) -> str:
        """'ok', 'error', 'timeout' (interrupted and stopped), 'hung' (would not stop), 'died' or
        'flooded' (wrote more than MAX_CHANNEL_BYTES to the channel: the kernel is to be abandoned)."""
        read = on_channel or self.drain
        msg_id = self.kc.execute(code, store_history=False, allow_stdin=False, stop_on_error=False)
        deadline, interrupted = time.monotonic() + timeout, False
        self.time_up = deadline
        if not on_channel:
            self.channel.reset()  # a task resets it with its nonce
        while True:
            # Wait on the answer channel, not on Jupyter's: a probe that asks the grader (to sleep a
            # time it is timing) must be answered at once, or the wait would count in its timing.
            # One bounded read per turn, then the clock: however fast the kernel writes.
            if select.select([self.ours], [], [], 0.02)[0]:
                read()
                if self.channel.flooded:
                    return "flooded"
            try:
                reply = self.kc.get_shell_msg(timeout=0)
            except Exception:  # noqa: BLE001  queue.Empty, or a malformed message (a kernel's patched json)
                reply = None
            if reply is None:
                if not self.alive():
                    return "died"
                if time.monotonic() > deadline:
                    if interrupted:
                        return "hung"
                    self._interrupt()
                    interrupted, deadline = True, time.monotonic() + INTERRUPT_GRACE_S
                continue
            if not isinstance(reply, dict) or reply.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            # What the kernel wrote before its reply (an answer, perhaps behind a flood), and no more.
            target, until = self.channel.received + self.channel.queued(), time.monotonic() + 2
            while self.channel.received < target and time.monotonic() < until:
                before = self.channel.received
                read()
                if self.channel.flooded:
                    return "flooded"
                if self.channel.received == before:
                    break
            if interrupted:
                return "timeout"
            return "ok" if reply.get("content", {}).get("status") == "ok" else "error"

    def task(self, check: Check, cases: list) -> tuple[str, Any]:
        """Ask the kernel for one task's answer. ('answered', response) / ('rejected', why) /
        ('timeout' | 'hung' | 'died' | 'flooded' | 'no answer', None)."""
        self.drain()  # anything written before the question is not an answer to it
        nonce = secrets.token_hex(16)
        request = {
            "nonce": nonce,
            "name": check.name,
            "args": list(check.args),
            # forbidden modules are judged from the notebook's source (grader.judge_from_source), not
            # by a profiler in the kernel, which the notebook's own code could switch off
            "forbidden": [],
            "cases": [check.public(c) for c in cases],
        }
        please = (json.dumps(REQUEST_PLEASE) + "\n").encode()
        sent = [False]
        answers: list[Any] = []
        trouble: list[str] = []
        asked = [0]
        self.channel.reset(nonce.encode())

        def reply(message: dict) -> None:
            self.channel.reply({"nonce": nonce, **message}, self.time_up - time.monotonic())

        def on_channel() -> None:
            for line in self.channel.lines():
                if line + b"\n" == please:  # serve() runs: now, and only now, the question
                    if sent[0]:  # asked twice: the notebook's own code asked first
                        trouble.append("the question was asked for twice, so the notebook's own code asked for it")
                        reply({"error": "asked twice"})
                    else:
                        sent[0] = True
                        self.channel.reply(request, self.time_up - time.monotonic())
                    continue
                if nonce.encode() not in line:  # no message for this question: not even parsed
                    self.faults.ignored += 1 if line.strip() else 0
                    continue
                message, why = read_message(line)  # shape checked: nothing below recurses into it
                if message is None:
                    trouble.append(f"a message for this task on the answer channel could not be read: {why}")
                    continue
                if not isinstance(message, dict) or message.get("nonce") != nonce:
                    self.faults.ignored += 1
                    continue
                if "ask" in message:  # the probe asks the grader (e.g. to sleep a time only it knows)
                    i = message.get("case")
                    asked[0] += 1
                    if asked[0] > MAX_ASKS:
                        if asked[0] == MAX_ASKS + 1:
                            trouble.append(f"the notebook asked the grader more than {MAX_ASKS:,} questions")
                        reply({"error": "too many questions"})
                        continue
                    if answers or not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(cases):
                        trouble.append("a question for the grader arrived out of order")
                        reply({"error": "out of order"})
                        continue
                    if time.monotonic() > self.time_up:  # a host may sleep: none past the time limit
                        reply({"error": "the task's time is up"})
                        continue
                    try:
                        reply({"reply": check.host(cases[i], message["ask"])})
                    except Exception as e:  # noqa: BLE001  a malformed question is the submission's
                        reply({"error": f"{type(e).__name__}: {_clip(e, 200)}"[:200]})
                elif "response" in message:
                    answers.append(message["response"])
                else:
                    self.faults.ignored += 1

        code = "__import__('course_lib.tooling.grading', fromlist=['serve']).serve(None, globals())"
        outcome = self.execute(code, check.time_limit, on_channel)
        if outcome in ("hung", "died", "flooded"):
            return outcome, None
        if self.channel.lost:
            trouble.append(f"the answer for this task was longer than {MAX_LINE >> 20} MiB, so it was not read")
        if len(answers) > 1:
            return "rejected", (
                f"{len(answers)} answers arrived for this task, where the grader's own code sends "
                "one: the notebook wrote answers itself, so none of them counts"
            )
        if trouble:
            return "rejected", trouble[0]
        if outcome == "timeout":
            return "timeout", None
        if not answers:
            return "no answer", None
        return "answered", answers[0]

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        try:
            self.kc.stop_channels()
        except Exception:
            pass
        sandbox.end(self.proc, self.token)
        self.ours.close()


def run_submission(
    notebook: Path,
    checks: list[Check],
    cases: dict[str, list],
    start: Callable[[Faults], Attempt],
    cell_timeout: float,
    deadline: float,
    emit: Callable[[Check, str, str], None],
) -> Faults:
    """Run the notebook and judge every task, attempt after attempt until each task is judged.

    A cell that kills or hangs the kernel is skipped from the next attempt on (as a cell that
    raises is, in effect, by every attempt); a task that kills or hangs the kernel is judged
    'crashed' or 'timed out' and the next attempt goes on with the tasks after it. `emit` is
    called once per task, the moment it is judged; the fault notes go into the messages of the
    tasks judged after them."""
    cells = code_cells(notebook)
    faults = Faults()
    pending = list(checks)

    def ran_out() -> bool:
        return time.monotonic() > deadline

    def finish(check: Check, status: str, message: str) -> None:
        note = faults.note()
        emit(check, status, f"{message} (note: {note})" if note and status != "passed" else message)

    for _ in range(MAX_ATTEMPTS):
        if not pending or ran_out():
            break
        attempt = start(faults)
        outcomes: list[str] = []
        faults.outcomes.append(outcomes)
        try:
            # The grading code is imported before the notebook's first cell: a notebook that writes
            # its own course_lib/ into its working folder (first on the kernel's path) cannot put it
            # in its place afterwards.
            if not attempt.ready or attempt.execute(BOOTSTRAP, min(60.0, cell_timeout)) != "ok":
                faults.no_kernel = True
                break
            broken = False
            for i, source in enumerate(cells):
                if i in faults.cells:
                    outcomes.append("skipped")
                    continue
                outcome = attempt.execute(source, min(cell_timeout, max(1.0, deadline - time.monotonic())))
                if outcome == "died" and attempt.over_memory():
                    outcome, faults.memory = "memory", attempt.over_memory()
                outcomes.append(outcome)
                if outcome in ("hung", "died", "memory", "flooded"):
                    faults.cells[i] = outcome
                    broken = True
                    break
                if ran_out():
                    break
            if broken:
                continue
            while pending and not ran_out():
                check = pending.pop(0)
                what, response = attempt.task(check, cases[check.name])
                if what == "answered":
                    finish(check, *judge_response(check, cases[check.name], response))
                elif what == "rejected":
                    finish(check, "failed", response)
                elif what in ("timeout", "hung"):
                    finish(
                        check,
                        "timed out",
                        f"checking this task took longer than {check.time_limit:g} s (an endless loop?)",
                    )
                elif what == "died" and attempt.over_memory():
                    finish(
                        check,
                        "crashed",
                        f"your notebook used more than {attempt.over_memory()} of memory (resident) while this "
                        "task was being checked, so the grader stopped it; other tasks keep their points",
                    )
                elif what == "died":
                    finish(
                        check,
                        "crashed",
                        "your notebook's Python process stopped while this task was being "
                        "checked (a crash, os._exit or a kill); other tasks keep their points",
                    )
                elif what == "flooded":
                    finish(
                        check,
                        "failed",
                        f"your notebook wrote more than {MAX_CHANNEL_BYTES >> 20} MiB to the grader's answer "
                        "channel while this task was being checked, so the grader stopped it; other tasks keep "
                        "their points",
                    )
                else:
                    finish(
                        check,
                        "failed",
                        "no answer came back for this task (did the notebook replace the grading helpers?)",
                    )
                if what in ("hung", "died", "flooded"):
                    break
        finally:
            attempt.close()
    for check in pending:
        if ran_out():
            finish(check, "timed out", "your notebook ran past the total time limit before this task was checked")
        elif faults.no_kernel:
            finish(
                check,
                "not graded",
                "the grader could not start a Python kernel for this notebook: tell your "
                "instructor (the grader's log has the details)",
            )
        else:
            finish(
                check,
                "crashed",
                "your notebook could not be run far enough to check this task (its Python process kept stopping)",
            )
    return faults
