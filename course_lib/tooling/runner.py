"""Runs one submission inside the grader's sandbox: its cells, then the kernel side of each check.

    python -m course_lib.tooling.runner SANDBOX_DIR      (started by course_lib.tooling.grader)

Everything here is untrusted by construction: the submission's code shares this sandbox and can
stop or fool this process. So it reports no verdicts. It executes the notebook's code cells in a
fresh kernel (outputs are discarded: a flood costs nothing), then asks the kernel to answer each
request of SANDBOX_DIR/io/requests.json with course_lib.tooling.grading.serve, which appends the
learner's plain-data answers to io/responses.jsonl. The grader, outside, judges them. What
happened along the way (a cell that timed out, a kernel that died) goes to io/status.jsonl, used
only to word the messages of tasks that were not answered.
"""
from __future__ import annotations

import json
import os
import queue
import resource
import sys
import time
from pathlib import Path

__all__ = ["code_cells"]

INTERRUPT_GRACE_S = 10  # how long an interrupted cell may take to stop before the kernel is abandoned


_T0 = time.monotonic()


def _status(io: Path, **event: object) -> None:
    with open(io / "status.jsonl", "a") as f:
        f.write(json.dumps({**event, "t": round(time.monotonic() - _T0, 2)}) + "\n")


def _limits(job: dict) -> None:
    """Resource limits the kernel inherits: memory (address space), file size, CPU seconds, no core dumps."""
    def cap(kind: int, value: int) -> None:
        soft, hard = resource.getrlimit(kind)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))

    if job.get("memory_bytes"):
        cap(resource.RLIMIT_AS, int(job["memory_bytes"]))
    cap(resource.RLIMIT_FSIZE, 512 * 2**20)
    cap(resource.RLIMIT_CPU, int(job["cpu_seconds"]))
    cap(resource.RLIMIT_CORE, 0)


class _Kernel:
    """A fresh ipykernel in this interpreter, talking over unix sockets in the sandbox (no network needed)."""

    def __init__(self, workdir: Path, rundir: Path) -> None:
        from jupyter_client.kernelspec import KernelSpec
        from jupyter_client.manager import KernelManager

        class ThisPython(KernelManager):
            @property
            def kernel_spec(self) -> KernelSpec:
                if self._kernel_spec is None:
                    from ipykernel.kernelspec import RESOURCES, make_ipkernel_cmd
                    self._kernel_spec = KernelSpec(argv=make_ipkernel_cmd(executable=sys.executable),
                                                   display_name="Python 3", language="python", resource_dir=RESOURCES)
                return self._kernel_spec

        rundir.mkdir(parents=True, exist_ok=True)
        self.km = ThisPython(transport="ipc", ip=str(rundir / "kernel"),
                             connection_file=str(rundir / "kernel.json"))
        self.km.start_kernel(cwd=str(workdir), stderr=open(os.devnull, "w"), stdout=open(os.devnull, "w"))
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def _drain_iopub(self) -> None:
        while True:  # nobody reads the outputs: discard them so they cannot pile up
            try:
                self.kc.get_iopub_msg(timeout=0)
            except queue.Empty:
                return

    def execute(self, code: str, timeout: float) -> str:
        """'ok', 'error', 'timeout' (interrupted and stopped), 'hung' (would not stop) or 'died'."""
        msg_id = self.kc.execute(code, store_history=False, allow_stdin=False, stop_on_error=False)
        deadline, interrupted = time.monotonic() + timeout, False
        while True:
            self._drain_iopub()
            try:
                reply = self.kc.get_shell_msg(timeout=0.5)
            except queue.Empty:
                if not self.km.is_alive():
                    return "died"
                if time.monotonic() > deadline:
                    if interrupted:
                        return "hung"
                    self.km.interrupt_kernel()
                    interrupted, deadline = True, time.monotonic() + INTERRUPT_GRACE_S
                continue
            if reply.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if interrupted:
                return "timeout"
            return "ok" if reply["content"].get("status") == "ok" else "error"

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=True)
        except Exception:
            pass


def code_cells(path: Path) -> list[str]:
    """The code cells' sources of a notebook file (nbformat 4), read as plain JSON."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    sources = [c["source"] for c in cells if isinstance(c, dict) and c.get("cell_type") == "code"]
    return ["".join(s) if isinstance(s, list) else str(s) for s in sources]


def main(sandbox: str) -> int:
    root = Path(sandbox)
    io, job = root / "io", json.loads((root / "io" / "job.json").read_text())
    _limits(job)
    try:
        cells = code_cells(root / "work" / job["notebook"])
    except Exception as e:
        _status(io, event="unreadable", detail=f"{type(e).__name__}: {str(e)[:200]}")
        return 0
    kernel = _Kernel(root / "work", root / "run")
    _status(io, event="kernel", outcome="started")
    try:
        for i, source in enumerate(cells):
            outcome = kernel.execute(source, job["cell_timeout"])
            _status(io, event="cell", index=i, outcome=outcome)
            if outcome in ("hung", "died"):
                return 0
        requests = json.loads((io / "requests.json").read_text())
        outcome = kernel.execute("__import__('course_lib.tooling.grading', fromlist=['prepare']).prepare("
                                 f"{job['chapter']!r})", job["cell_timeout"])
        _status(io, event="prepare", outcome=outcome)
        if outcome in ("hung", "died"):
            return 0
        for index, request in enumerate(requests):
            code = ("__import__('course_lib.tooling.grading', fromlist=['serve']).serve("
                    f"{str(io / 'requests.json')!r}, {index}, {str(io / 'responses.jsonl')!r}, globals())")
            outcome = kernel.execute(code, request["time_limit"])
            _status(io, event="check", name=request["name"], outcome=outcome)
            if outcome in ("hung", "died"):
                return 0
    finally:
        kernel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
