"""Where a learner's code runs: a sandbox the grader can start, watch and end without trusting it.

Every task of every submission runs in a sandbox of its own, started fresh (its own folder, HOME,
/tmp: nothing an earlier task or attempt wrote is there). Two levels, chosen once per grading run
(course_lib.tooling.grader says which, at the start; the inline check() uses the same):

namespaces (Linux with unprivileged user namespaces, the usual case)
    `unshare` gives the task its own user, PID, network and mount namespaces. Its file system is
    built from nothing: a fresh root holding, read-only, the system's programs and libraries, the
    Python installation and the *learner library* (course_lib without the grader's two folders,
    tooling/checks/ and tooling/grader/, the shipped data and any $COURSE_EXTRA_PROBES:
    `learner_library`); writable, only its own sandbox folder and fresh /tmp and /dev/shm. The
    modules the task forbids are not there either: a stand-in that says so is mounted over every
    copy of them (`absent_modules`). The course checkout (solutions/, exercises/, the checks),
    the submissions, the gradebook, the grader's HOME and every other sandbox are not there at
    all. It sees no process of the machine (so it can kill none, and all of its processes die with
    it), has no network but its own loopback, and runs with no capabilities, so it cannot mount,
    remount or leave the root it was given.
session (anywhere else)
    A new session with resource limits, its own HOME/TMPDIR and the learner library first on
    its path. It cannot stop a deliberate attack on the machine: a submission could read or write
    files the grader's user can, or kill the grader's processes, and a forbidden module is kept out
    only by the task process's import hook. Every process it started is still killed afterwards,
    and the checkout is checked for changes after every submission. Grade untrusted submissions at
    this level only inside a container or a VM.

Limits, at both levels. Memory is capped by what the machine really loses: `MemoryWatch`, a thread
of the grader, sums the resident memory of all the sandbox's processes (the task process, its DataLoader
workers, anything they start) every 50 ms and kills them all once the sum is over the cap (the
runner then says so in the task's row). Address space is not capped by it: `import torch` alone
reserves about 3 GB of it (0.5 GB resident), CUDA far more, so a cap on it failed fair answers;
prlimit keeps one only as a far backstop (`command`). prlimit also caps CPU seconds and file
sizes; at the namespaces level /tmp and /dev/shm are tmpfs of 1 GiB and 256 MiB.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from functools import cache
from glob import glob
from pathlib import Path

__all__ = [
    "available",
    "environment",
    "command",
    "start",
    "end",
    "learner_library",
    "visible_paths",
    "absent_modules",
    "MemoryWatch",
]

ROOT = Path(__file__).resolve().parents[3]
# The grader's side lives in two folders, and the learner library is course_lib without them: the
# right answers (tooling/checks/) and the code that judges (tooling/grader/). A file added to
# either is kept out of every sandbox by where it lives.
GRADER_ONLY = ("tooling/checks", "tooling/grader")
# What the task process itself runs before the learner's code (course_lib/tooling/task.py): never
# hidden, even for a task that forbids all of course_lib.
TASK_MACHINERY = ("__init__.py", "tooling/__init__.py", "tooling/task.py", "tooling/probes")

# Runs as PID 1 of the new namespaces, as root of the new user namespace (the caller's own user
# outside it). Builds the sandbox's root in $AMP_NEW_ROOT: a tmpfs with read-only bind mounts of
# the paths in $AMP_READ_ONLY (one per line), a few device nodes, its own /proc, empty /tmp and
# /dev/shm, the sandbox folder writable at its own path, and the stand-ins of forbidden modules
# over their files. Then pivot_root into it, detach the old root, and run the command with every
# capability dropped: nothing inside can mount, remount or reach the old root again.
_NS_SCRIPT = r"""set -e
# The loopback up (two DDP ranks of one submission talk over it), by the ioctl that `ip link set lo
# up` makes: bare GPU images have no iproute2, and a sandbox there had no loopback at all.
"$AMP_PYTHON" -I -S -c 'import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH22x", fcntl.ioctl(s, 0x8913, struct.pack("16sH22x", b"lo", 0)))[1]  # SIOCGIFFLAGS
fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags | 1))'  # SIOCSIFFLAGS, IFF_UP
new="$AMP_NEW_ROOT"
mount -t tmpfs -o mode=755,size=64m tmpfs "$new"
mkdir -p "$new/proc" "$new/dev/shm" "$new/tmp" "$new/sys"
mount -t tmpfs -o size=1g,mode=1777 tmpfs "$new/tmp"
mount -t tmpfs -o size=256m,mode=1777 tmpfs "$new/dev/shm"
for node in null zero full random urandom tty $AMP_DEVICES; do  # $AMP_DEVICES: the GPUs' nodes
  if [ -d "/dev/$node" ]; then mkdir -p "$new/dev/$node"; mount --rbind "/dev/$node" "$new/dev/$node"
  elif [ -e "/dev/$node" ]; then touch "$new/dev/$node"; mount --bind "/dev/$node" "$new/dev/$node"; fi
done
ln -s /proc/self/fd "$new/dev/fd"
printf '%s
' "$AMP_READ_ONLY" | while IFS= read -r path; do
  if [ -z "$path" ] || [ ! -e "$path" ]; then continue; fi
  if [ -L "$path" ]; then  # /bin -> usr/bin and the like: the same link in the new root
    mkdir -p "$new$(dirname "$path")"; ln -sfn "$(readlink "$path")" "$new$path"; continue
  fi
  if [ -d "$path" ]; then mkdir -p "$new$path"; else mkdir -p "$new$(dirname "$path")"; touch "$new$path"; fi
  mount --rbind "$path" "$new$path"
  mount -o remount,bind,ro "$new$path"
done
# The modules the task forbids: a read-only stand-in over every copy ("target<TAB>stand-in" per line).
printf '%s\n' "$AMP_MASKS" | while IFS='	' read -r target stand_in; do
  if [ -z "$target" ] || [ ! -e "$new$target" ]; then continue; fi
  mount --bind "$stand_in" "$new$target"
  mount -o remount,bind,ro "$new$target"
done
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$new/sys" || true  # a fresh one: no cgroup files
mkdir -p "$new$AMP_SANDBOX_DIR"
mount --bind "$AMP_SANDBOX_DIR" "$new$AMP_SANDBOX_DIR"
mount -t proc proc "$new/proc"
mkdir "$new/.old"
cd "$new"
pivot_root . .old
umount -l /.old
rmdir /.old
cd "$AMP_WORKDIR"
exec setpriv --no-new-privs --inh-caps=-all --ambient-caps=-all --bounding-set=-all -- "$@"
"""
_UNSHARE = [
    "unshare",
    "--user",
    "--map-root-user",
    "--pid",
    "--fork",
    "--kill-child",
    "--mount-proc",
    "--net",
    "--mount",
    "--propagation",
    "private",
    "--",
]
_PROBE = r"""
import os, socket, sys
root, sandbox = sys.argv[1], sys.argv[2]
assert not os.path.exists(os.path.join(root, "course_lib", "tooling", "checks")), "the checkout is visible"
for path, want in ((os.path.join(sandbox, "probe"), True), ("/usr/.amp-probe", False)):
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
import course_lib.tooling.task  # the learner library imports
print("isolated")
"""


def learner_library(dest: Path) -> Path:
    """Copy what a learner may read into dest/course: course_lib without the grader's two folders
    (GRADER_ONLY), and the shipped data (not the GPU references: nothing there is an answer, but
    nothing there is needed either). Returns dest/course, to put first on the sandbox's path."""
    course = Path(dest) / "course"
    skip = {ROOT / "course_lib" / part for part in GRADER_ONLY}

    def ignore(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if n == "__pycache__" or Path(folder, n) in skip]

    shutil.copytree(ROOT / "course_lib", course / "course_lib", ignore=ignore)
    (course / "data").mkdir(parents=True)
    for npz in (ROOT / "data").glob("*.npz"):
        shutil.copy(npz, course / "data")
    (course / "extra_probes").mkdir()
    for file in _extra_probes():
        shutil.copy(file, course / "extra_probes" / file.name)
    return course


def _extra_probes() -> list[Path]:
    return [Path(f) for f in os.environ.get("COURSE_EXTRA_PROBES", "").split(os.pathsep) if f]


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def visible_paths(library: Path, hidden: list[Path]) -> list[str]:
    """What the namespaces level binds read-only into the sandbox's root: the system, Python and its
    packages (sys.path), $PYTHONPATH and the learner library. A path
    that is, holds or lies inside the checkout (other than its .venv and dot-folders such as .gpu)
    or a hidden folder (submissions, gradebook, the other sandboxes) is left out."""
    wanted = [Path(p) for p in ("/usr", "/etc", "/opt", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")]
    python = [
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
        *sys.path,
        *os.environ.get("PYTHONPATH", "").split(os.pathsep),
    ]
    wanted += [Path(os.path.realpath(p)) for p in python if p and os.path.isabs(p)]
    # and as named, where that is a link (a .venv linked from elsewhere): the link is made again inside
    wanted += [Path(p) for p in (sys.prefix, os.path.dirname(sys.executable)) if os.path.islink(p)]
    wanted.append(Path(library))
    root = ROOT.resolve()
    out: list[str] = []
    for path in wanted:
        if not path.exists() or any(_inside(h, path) for h in [root, *hidden]):  # binding it would show them
            continue
        if _inside(path, root) and not path.relative_to(root).parts[0].startswith("."):
            continue  # inside the checkout, only .venv, .gpu and the like
        if any(_inside(path, h) for h in hidden) and not _inside(path, Path(library)):
            continue
        if str(path) not in out and not any(_inside(path, Path(o)) for o in out if not Path(o).is_symlink()):
            out.append(str(path))
    return out


@cache
def available() -> bool:
    """Can this machine run the namespaces level? Tried for real once: a root without the checkout,
    read-only system, no network, the learner library importable."""
    if not sys.platform.startswith("linux") or not all(shutil.which(t) for t in ("unshare", "setpriv")):
        return False
    with tempfile.TemporaryDirectory(prefix="amp-probe-") as tmp:
        library = learner_library(Path(tmp))
        box = Path(tmp) / "box"
        box.mkdir()
        env = {**environment(box, "probe", {}, library), **namespace_env(box, library, [Path(tmp)])}
        try:
            out = subprocess.run(
                command("namespaces", [sys.executable, "-c", _PROBE, str(ROOT), str(box)]),
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                cwd=box,
            )
        except (OSError, subprocess.SubprocessError):
            return False
    return out.returncode == 0 and "isolated" in out.stdout


def namespace_env(
    box: Path, library: Path, hidden: list[Path], masks: list[tuple[str, str]] | None = None
) -> dict[str, str]:
    """The variables _NS_SCRIPT reads: where to build the root, what to show and to hide, where to start."""
    (box / ".root").mkdir(exist_ok=True)
    devices = " ".join(d for d in sorted(os.listdir("/dev")) if d.startswith("nvidia")) if os.path.isdir("/dev") else ""
    return {
        "AMP_NEW_ROOT": str(box / ".root"),
        "AMP_SANDBOX_DIR": str(box),
        "AMP_WORKDIR": str(box / "work"),
        "AMP_READ_ONLY": "\n".join(visible_paths(library, hidden)),
        "AMP_MASKS": "\n".join(f"{target}\t{stand_in}" for target, stand_in in masks or []),
        "AMP_DEVICES": devices,
        "AMP_PYTHON": sys.executable,
    }


def _search_folders() -> list[Path]:
    """Where a Python on this machine could find a module: this Python's path and standard library,
    and every Python installation under /usr, /usr/local and /opt (another Python's copy of a module
    is as good as this one's to a learner who puts its folder on sys.path)."""
    found = [*sys.path, *(sysconfig.get_paths().get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib"))]
    for top in ("/usr/lib", "/usr/local/lib", "/usr/lib64", "/opt"):
        for pattern in ("python3*", "python3*/lib-dynload", "python3*/site-packages", "python3*/dist-packages",
                        "python3/dist-packages", "*/lib/python3*/site-packages"):  # fmt: skip
            found += glob(os.path.join(top, pattern))
    out: list[Path] = []
    for folder in found:
        path = Path(os.path.realpath(folder)) if folder else None
        if path is not None and path.is_dir() and path not in out:
            out.append(path)
    return out


@cache
def _copies(top: str) -> list[Path]:
    """Every file or package of a top-level module `top` in the search folders."""
    copies = []
    spec = importlib.util.find_spec(top) if top.isidentifier() else None
    if spec is not None and spec.origin and spec.origin not in ("built-in", "frozen"):
        origin = Path(os.path.realpath(spec.origin))
        copies.append(origin.parent if origin.name == "__init__.py" else origin)
    for folder in _search_folders():
        for candidate in [folder / top, folder / f"{top}.py", *folder.glob(f"{top}.*.so"), folder / f"{top}.so"]:
            real = Path(os.path.realpath(candidate))
            if candidate.exists() and real not in copies:
                copies.append(real)
    return copies


def _inside_library(prefix: str, library: Path) -> list[Path]:
    """The files and folders of the learner library's course_lib that make up module `prefix`,
    leaving out the task process's own (TASK_MACHINERY), which it imports before the learner's code."""
    package = Path(library) / "course_lib"
    parts = prefix.split(".")[1:]
    target = package.joinpath(*parts) if parts else package
    target = target if target.is_dir() else target.with_suffix(".py")
    keep = [package / k for k in TASK_MACHINERY]
    out, todo = [], [target] if target.exists() else []
    while todo:
        path = todo.pop()
        if any(path == k for k in keep):
            continue
        if any(_inside(k, path) for k in keep):  # holds something the task process needs: go inside
            todo += [c for c in path.iterdir() if c.name != "__pycache__"]
        else:
            out.append(path)
    return out


def absent_modules(prefixes: tuple[str, ...], library: Path, stand_ins: Path, why: str) -> list[tuple[str, str]]:
    """(what to hide, the stand-in mounted over it) for each module a task forbids: every copy a
    Python here could import (`_copies`), and in the learner library the module itself. A dotted
    module outside course_lib (`torch.amp`) cannot be hidden without its package: it is left to the
    task process's import hook."""
    from ..task import ABSENT

    masks: list[tuple[str, str]] = []
    for prefix in prefixes:
        top = prefix.split(".")[0]
        if top == "course_lib":
            paths = _inside_library(prefix, library)
        elif "." in prefix:
            continue
        else:
            paths = _copies(top)
        message = f"raise ImportError({f'{prefix} {ABSENT}: {why}'!r})\n"
        for path in paths:
            stand_in = _stand_in(stand_ins, message, package=path.is_dir())
            masks.append((str(path), str(stand_in)))
    return masks


def _stand_in(folder: Path, message: str, package: bool) -> Path:
    """A module, or a package, whose import raises `message` (one per text, shared by a run's tasks)."""
    name = hashlib.sha256(message.encode()).hexdigest()[:16]
    path = Path(folder) / (f"pkg-{name}" if package else f"mod-{name}.py")
    if not path.exists():
        Path(folder).mkdir(parents=True, exist_ok=True)
        if package:
            path.mkdir()
            (path / "__init__.py").write_text(message)
        else:
            path.write_text(message)
    return path


def environment(sandbox: Path, token: str, extra: dict[str, str], library: Path) -> dict[str, str]:
    """The whole environment of the sandbox: its own HOME and TMPDIR, the learner library first on
    the path (instead of the checkout), and nothing secret passed on."""
    home = sandbox / "home"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": str(home),
        "TMPDIR": str(sandbox / "tmp"),
        "IPYTHONDIR": str(home / ".ipython"),
        "MPLCONFIGDIR": str(home / ".config/matplotlib"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "MPLBACKEND": "Agg",
        "COURSE_OFFLINE": "1",
        "AMP_COURSE_GRADING": "1",
        "AMP_SANDBOX": token,
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    for key in ("CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "OMP_WAIT_POLICY"):
        if os.environ.get(key) is not None:
            env[key] = os.environ[key]
    root = ROOT.resolve()
    kept = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and not (Path(p).resolve() == root or (root / "course_lib").resolve() == Path(p).resolve())
    ]
    env["PYTHONPATH"] = os.pathsep.join([str(library), *kept])
    env["COURSE_DATA_DIR"] = str(Path(library) / "data")
    probes = []
    for file in _extra_probes():  # an instructor's probes, copied into the learner library: their checks stay outside
        copy = Path(library) / "extra_probes" / file.name
        if not copy.exists():  # $COURSE_EXTRA_PROBES named it after the library was made (the inline check's)
            copy.parent.mkdir(exist_ok=True)
            shutil.copy(file, copy)
        probes.append(str(copy))
    if probes:
        env["COURSE_EXTRA_PROBES"] = os.pathsep.join(probes)
    env.update(extra)
    for d in ("home", "tmp", "work"):
        (sandbox / d).mkdir(parents=True, exist_ok=True)
    return env


def command(level: str, argv: list[str], limits: dict[str, int] | None = None) -> list[str]:
    """The argv that runs `argv` at this isolation level (with namespace_env's variables set), under
    resource limits where prlimit exists: address space `as` per process (a backstop: memory is
    capped by `MemoryWatch`) and CPU seconds `cpu` (0: none), files of at most 512 MiB, no core dumps."""
    out = [*_UNSHARE, "/bin/sh", "-c", _NS_SCRIPT, "sh", *argv] if level == "namespaces" else list(argv)
    if limits is not None and shutil.which("prlimit"):
        caps = [f"--{k}={v}" for k, v in limits.items() if v] + [f"--fsize={512 * 2**20}", "--core=0"]
        out = ["prlimit", *caps, "--", *out]
    return out


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the grader dies, the kernel (Linux's) kills this child
    # (at the namespaces level that ends the whole namespace). Linux only; elsewhere a no-op.
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


try:  # loaded here, not in the child: nothing but the prctl call may run between fork and exec
    import ctypes

    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _PRCTL = None


def start(argv: list[str], env: dict[str, str], cwd: Path, log, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start a sandbox in a session of its own that dies with the grader; `pass_fds` are inherited."""
    return subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent,
        pass_fds=pass_fds,
    )


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


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent, session) of a live process; None for one that is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name, in parentheses, may hold anything
        return None if fields[0] in (b"Z", b"X") else (int(fields[1]), int(fields[3]))
    except (OSError, IndexError, ValueError):
        return None


def _resident(pid: int) -> int:
    """Bytes of memory the process has resident (RSS: pages it shares are counted in full)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _proportional(pid: int) -> int:
    """Bytes of memory the process holds, each page shared with n processes counted 1/n (PSS): what
    a fork's copy-on-write pages and the shared libraries really cost. RSS where PSS is unknown."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return _resident(pid)


class MemoryWatch:
    """Caps the memory a sandbox really takes from the machine: a thread of the grader that sums,
    every `interval` seconds, the resident memory of the sandbox's processes (its first process,
    every descendant, its session, and anything carrying its token), and kills all of them the
    moment the sum is over `cap` bytes. `killed` then holds the bytes it saw.

    Address space is not memory: `import torch` alone reserves about 3 GB of it, and CUDA far more,
    so an address-space limit fails fair answers. Resident memory counts shared pages once per
    process, so a sum over `cap` is checked again in proportional memory (PSS, slower to read)
    before anything is killed: forked DataLoader workers share their parent's pages. Linux only (it
    reads /proc); elsewhere it caps nothing."""

    def __init__(self, proc: subprocess.Popen, token: str, cap: int, interval: float = 0.05) -> None:
        self.proc, self.token, self.cap, self.interval = proc, token, cap, interval
        self.killed: int | None = None  # bytes in use when it killed the sandbox
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"memory-watch-{proc.pid}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (the sandbox is about to end); returns once the thread has."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _members(self, marked: set[int]) -> set[int]:
        table = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (info := _stat(int(entry.name))) is not None:
                table[int(entry.name)] = info
        root = self.proc.pid
        found = {pid for pid, (_, session) in table.items() if session == root} | (marked & table.keys())
        if root in table:
            found.add(root)
        children: dict[int, list[int]] = {}
        for pid, (parent, _) in table.items():
            children.setdefault(parent, []).append(pid)
        todo = list(found)
        while todo:  # and every descendant of those
            for child in children.get(todo.pop(), []):
                if child not in found:
                    found.add(child)
                    todo.append(child)
        return found

    def _watch(self) -> None:
        members: set[int] = set()
        marked: set[int] = set()  # carriers of the token, looked for once a second
        next_scan = next_marks = next_exact = 0.0
        exact_at = (0, 0)  # (the resident sum, the proportional sum) at the last exact reading
        while not self._stop.is_set() and os.path.isdir("/proc"):  # Linux; elsewhere no cap
            now = time.monotonic()
            if now >= next_marks:
                marked = set(_pids_with_token(self.token))
                next_marks = now + 1.0
            if now >= next_scan:  # a full look at /proc: at most a tenth of a core's time
                members = self._members(marked)
                scan_cost = time.monotonic() - now
                next_scan = now + max(self.interval, 10 * scan_cost)
                if not members:
                    return  # everything it started has ended
            resident = sum(_resident(pid) for pid in members)
            if resident > self.cap and (
                now >= next_exact or resident - exact_at[0] > self.cap - exact_at[1]  # grew past its margin
            ):
                began = time.monotonic()
                members = self._members(marked)  # fresh: no process it did not start is measured or killed
                used = sum(_proportional(pid) for pid in members)
                exact_at, next_exact = (resident, used), began + max(0.25, 5 * (time.monotonic() - began))
                if used > self.cap:
                    self.killed = used  # said before the kill: the grader reads it once the process is dead
                    self._kill(members)
                    return
            self._stop.wait(self.interval)

    def _kill(self, pids: set[int]) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
