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
3. A kernel that dies or cannot be stopped costs only what it was doing: the grader starts a
   fresh attempt, runs the cells again (without a cell that killed or hung the kernel) and goes
   on with the next task (`run_submission`).
"""

from __future__ import annotations

import json
import secrets
import select
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import sandbox
from .grading import ANSWER_FD_ENV, Check, judge_response

__all__ = ["code_cells", "Attempt", "run_submission", "Faults"]

INTERRUPT_GRACE_S = 10  # how long an interrupted cell may take to stop before the kernel is abandoned
MAX_LINE = 64 * 2**20  # bytes: the largest message a kernel may send on the channel
MAX_ATTEMPTS = 4  # fresh kernels per submission: each one is paid for by a crash or a hang


def code_cells(path: Path) -> list[str]:
    """The code cells' sources of a notebook file (nbformat 4), read as plain JSON."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    sources = [c["source"] for c in cells if isinstance(c, dict) and c.get("cell_type") == "code"]
    return ["".join(s) if isinstance(s, list) else str(s) for s in sources]


@dataclass
class Faults:
    """What went wrong in a submission's run, in the grader's own words (never the kernel's)."""

    cells: dict[int, str] = field(default_factory=dict)  # cell index -> 'hung' / 'died'
    ignored: int = 0  # messages on the channel that answered no open question
    no_kernel: bool = False  # a kernel did not start at all
    outcomes: list[list[str]] = field(default_factory=list)  # per attempt, each cell's outcome

    def note(self) -> str:
        parts = []
        for i, what in sorted(self.cells.items()):
            did = "ran too long and could not be stopped" if what == "hung" else "stopped the Python process"
            parts.append(f"cell {i + 1} {did}; the grader ran the notebook again without it")
        if self.ignored:
            parts.append(
                f"the grader ignored {self.ignored} message(s) that the notebook wrote to the answer channel itself"
            )
        return "; ".join(parts)


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
    ) -> None:
        from jupyter_client.blocking import BlockingKernelClient

        self.box, self.token, self.faults = box, env["AMP_SANDBOX"], faults
        self.ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.ours.setblocking(False)
        self.buffer = b""
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
        self.kc.start_channels(iopub=False, stdin=False, hb=False)
        self.ready = self._wait_ready(120)

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

    # -- the answer channel

    def _lines(self) -> list[bytes]:
        """Whole lines that arrived on the channel so far (an endless line is dropped, not kept)."""
        while True:
            try:
                chunk = self.ours.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            if not chunk:
                break
            self.buffer += chunk
            if len(self.buffer) > MAX_LINE and b"\n" not in self.buffer:
                self.buffer = b""
                self.faults.ignored += 1
        *lines, self.buffer = self.buffer.split(b"\n")
        return lines

    def drain(self) -> None:
        """Count and drop whatever the kernel wrote while no question was open."""
        self.faults.ignored += len([line for line in self._lines() if line.strip()])

    def _reply(self, message: dict) -> None:
        data = json.dumps(message).encode() + b"\n"
        self.ours.setblocking(True)
        try:
            self.ours.settimeout(10)
            self.ours.sendall(data)
        except OSError:
            pass
        finally:
            self.ours.setblocking(False)

    # -- running code

    def _interrupt(self) -> None:
        msg = self.kc.session.msg("interrupt_request", content={})
        self.kc.control_channel.send(msg)

    def execute(self, code: str, timeout: float, on_channel: Callable[[], None] | None = None) -> str:
        """'ok', 'error', 'timeout' (interrupted and stopped), 'hung' (would not stop) or 'died'."""
        msg_id = self.kc.execute(code, store_history=False, allow_stdin=False, stop_on_error=False)
        deadline, interrupted = time.monotonic() + timeout, False
        while True:
            # Wait on the answer channel, not on Jupyter's: a probe that asks the grader (to sleep a
            # time it is timing) must be answered at once, or the wait would count in its timing.
            if select.select([self.ours], [], [], 0.02)[0]:
                (on_channel or self.drain)()
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
            (on_channel or self.drain)()
            if interrupted:
                return "timeout"
            return "ok" if reply.get("content", {}).get("status") == "ok" else "error"

    def task(self, check: Check, cases: list) -> tuple[str, Any]:
        """Ask the kernel for one task's answer. ('answered', response) / ('rejected', why) /
        ('timeout' | 'hung' | 'died' | 'no answer', None)."""
        self.drain()  # anything written before the question is not an answer to it
        nonce = secrets.token_hex(16)
        request = {
            "nonce": nonce,
            "name": check.name,
            "args": list(check.args),
            "forbidden": list(check.forbidden),
            "cases": [check.public(c) for c in cases],
        }
        answers: list[Any] = []
        trouble: list[str] = []

        def on_channel() -> None:
            for line in self._lines():
                try:
                    message = json.loads(line)
                except ValueError:
                    message = None
                if not isinstance(message, dict) or message.get("nonce") != nonce:
                    self.faults.ignored += 1 if line.strip() else 0
                    continue
                if "ask" in message:  # the probe asks the grader (e.g. to sleep a time only it knows)
                    i = message.get("case")
                    if answers or not isinstance(i, int) or not 0 <= i < len(cases):
                        trouble.append("a question for the grader arrived out of order")
                        self._reply({"nonce": nonce, "error": "out of order"})
                        continue
                    try:
                        self._reply({"nonce": nonce, "reply": check.host(cases[i], message["ask"])})
                    except Exception as e:  # noqa: BLE001  a malformed question is the submission's
                        self._reply({"nonce": nonce, "error": f"{type(e).__name__}: {e}"[:200]})
                elif "response" in message:
                    answers.append(message["response"])
                else:
                    self.faults.ignored += 1

        code = (
            "__import__('course_lib.tooling.grading', fromlist=['serve']).serve("
            f"{json.loads(json.dumps(request))!r}, globals())"
        )
        outcome = self.execute(code, check.time_limit, on_channel)
        if outcome in ("hung", "died"):
            return outcome, None
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
            if not attempt.ready:
                faults.no_kernel = True
                break
            broken = False
            for i, source in enumerate(cells):
                if i in faults.cells:
                    outcomes.append("skipped")
                    continue
                outcome = attempt.execute(source, min(cell_timeout, max(1.0, deadline - time.monotonic())))
                outcomes.append(outcome)
                if outcome in ("hung", "died"):
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
                elif what == "died":
                    finish(
                        check,
                        "crashed",
                        "your notebook's Python process stopped while this task was being "
                        "checked (a crash, os._exit or a kill); other tasks keep their points",
                    )
                else:
                    finish(
                        check,
                        "failed",
                        "no answer came back for this task (did the notebook replace the grading helpers?)",
                    )
                if what in ("hung", "died"):
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
