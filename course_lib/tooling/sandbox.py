"""Where a submission runs: a sandbox the grader can start, watch and end without trusting it.

Two levels, chosen once per grading run (course_lib.tooling.grader says which, at the start):

namespaces (Linux with unprivileged user namespaces, the usual case)
    `unshare` gives the submission its own user, PID, network and mount namespaces: it sees no
    process of the machine (so it can kill none, and all of its processes die with it), has no
    network at all, and sees every file system of the machine read-only, except its own sandbox
    folder and a fresh /dev/shm. HOME, TMPDIR, IPython and Jupyter folders are in the sandbox.
session (anywhere else)
    A new session with resource limits, its own HOME/TMPDIR and a throw-away copy of the
    course. It cannot stop a deliberate attack on the machine: a submission could write files the
    grader's user can write, or kill the grader's processes. Every process it started is still
    killed afterwards, and the checkout is checked for changes after every submission. Grade
    untrusted submissions at this level only inside a container or a VM.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

__all__ = ["available", "environment", "command", "start", "end", "course_copy"]

ROOT = Path(__file__).resolve().parents[2]

# Runs as PID 1 of the new namespaces, as root of the new user namespace (which is the caller's
# own user outside it): bring up the namespace's own loopback (processes of one submission may
# talk to each other, e.g. two DDP ranks, but reach nothing outside), make every mount
# read-only, give /dev/shm a private tmpfs, make the sandbox writable again, become the runner.
_NS_SCRIPT = r"""set -e
if command -v ip >/dev/null; then ip link set lo up; fi
for mp in $(findmnt -rn -o TARGET | sort -u); do
  case "$mp" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/*) ;; *) mount -o remount,bind,ro "$mp" ;; esac
done
if [ -d /dev/shm ]; then mount -t tmpfs -o size=256m,mode=1777 tmpfs /dev/shm; fi
mount --bind "$AMP_SANDBOX_DIR" "$AMP_SANDBOX_DIR"
mount -o remount,bind,rw "$AMP_SANDBOX_DIR"
exec "$@"
"""
_UNSHARE = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--mount-proc",
            "--net", "--mount", "--propagation", "private", "--"]
_PROBE = r"""
import os, socket, sys
root, sandbox = sys.argv[1], sys.argv[2]
for path, want in ((os.path.join(root, ".amp-probe"), False), (os.path.join(sandbox, "probe"), True)):
    try:
        open(path, "w").close()
        ok = True
    except OSError:
        ok = False
    assert ok is want, path
assert os.getpid() < 10  # a fresh PID namespace
try:
    socket.create_connection(("192.0.2.1", 9), timeout=1)  # TEST-NET-1: must be unreachable
    raise AssertionError("network")
except OSError:
    pass
print("isolated")
"""


@cache
def available() -> bool:
    """Can this machine run the namespaces level? Tried for real once: read-only host, no network."""
    if not sys.platform.startswith("linux") or not shutil.which("unshare") or not shutil.which("findmnt"):
        return False
    with tempfile.TemporaryDirectory(prefix="amp-probe-") as sandbox:
        try:
            out = subprocess.run(command("namespaces", sandbox, ["-c", _PROBE, str(ROOT), sandbox]),
                                 env={**environment(Path(sandbox), "probe", {}), "AMP_SANDBOX_DIR": sandbox},
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
        leaked = (ROOT / ".amp-probe").exists()
    return out.returncode == 0 and "isolated" in out.stdout and not leaked


def environment(sandbox: Path, token: str, extra: dict[str, str]) -> dict[str, str]:
    """The whole environment of the sandbox: its own HOME and TMPDIR, and nothing secret passed on."""
    home = sandbox / "home"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": str(home), "TMPDIR": str(sandbox / "tmp"), "IPYTHONDIR": str(home / ".ipython"),
        "JUPYTER_CONFIG_DIR": str(home / ".jupyter"), "JUPYTER_DATA_DIR": str(home / ".local/share/jupyter"),
        "JUPYTER_RUNTIME_DIR": str(sandbox / "run"), "MPLCONFIGDIR": str(home / ".config/matplotlib"),
        "XDG_CACHE_HOME": str(home / ".cache"), "MPLBACKEND": "Agg", "COURSE_OFFLINE": "1",
        "AMP_COURSE_GRADING": "1", "AMP_SANDBOX": token, "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    for key in ("COURSE_EXTRA_CHECKS", "CUDA_VISIBLE_DEVICES", "COURSE_DATA_DIR", "PYTHONPATH"):
        if os.environ.get(key) is not None:
            env[key] = os.environ[key]
    env.update(extra)
    for d in ("home", "tmp", "run"):
        (sandbox / d).mkdir(parents=True, exist_ok=True)
    return env


def course_copy(sandbox: Path) -> Path:
    """The session level's throw-away copy of the course (library and shipped data)."""
    dest = sandbox / "course"
    shutil.copytree(ROOT / "course_lib", dest / "course_lib", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "data", dest / "data", ignore=shutil.ignore_patterns("reference"))
    return dest


def command(level: str, sandbox: str | Path, python_args: list[str]) -> list[str]:
    """The argv that runs `python python_args...` at this isolation level."""
    python = [sys.executable, *python_args]
    if level == "namespaces":
        return [*_UNSHARE, "/bin/sh", "-c", _NS_SCRIPT, "sh", *python]
    return python


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the grader dies, the kernel kills this child
    # (at the namespaces level that ends the whole namespace). Linux only; elsewhere a no-op.
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


try:  # loaded here, not in the child: nothing but the prctl call may run between fork and exec
    import ctypes
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _PRCTL = None


def start(argv: list[str], env: dict[str, str], cwd: Path, log) -> subprocess.Popen:
    """Start a sandbox in a session of its own that dies with the grader."""
    return subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_die_with_parent)


def _pids_with_token(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if entry.name.isdigit():
            try:
                if f"AMP_SANDBOX={token}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def end(proc: subprocess.Popen, token: str) -> None:
    """End a sandbox and everything it started. At the namespaces level killing `unshare` ends the
    namespace and every process in it; at the session level we kill its process group and then
    any process that still carries its token (a daemon that left the group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    for pid in _pids_with_token(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
