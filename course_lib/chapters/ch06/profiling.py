"""Profiling a training step: torch.profiler with a schedule, its tables, and what chapter 06 measures with it.

Chapter 06. The profiler records every op (and, on a GPU, every kernel) of the steps its
schedule marks active, and writes a Chrome trace that Perfetto (https://ui.perfetto.dev)
opens; course_lib.chapters.ch06.traces reads it. Here: the profiling loop, key_averages as a
table, where the traces go, and the CLI that records the GPU results. The steps the chapter
profiles (the course model, three built-in bottlenecks), timing done naively and properly, the
cost of a read-back per step, CUDA memory per phase and a memory snapshot are in
course_lib.chapters.ch06.measured_steps:

    run = profile_steps(step, trace_dir=trace_folder(), wait=1, warmup=1, active=3)  # runs/06_profiling/
    print(format_key_averages(key_average_rows(run)))      # what torch.profiler's table says
    summary = trace_summary(load_trace(run.traces[-1]))    # course_lib.chapters.ch06.traces
    python -m course_lib.chapters.ch06.profiling --json data/reference/profiling_<gpu>.json
"""

from __future__ import annotations

import argparse
import contextlib
import html
import os
import shutil
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity

from course_lib.chapters.ch06.measured_steps import (
    BACKWARD,
    bottleneck_steps,
    cuda_phase_memory,
    format_timings,
    make_trainer,
    memory_snapshot_summary,
    naive_vs_proper,
    read_timing_ways,
    sync_cost,
)
from course_lib.chapters.ch06.traces import DIAGNOSES, FIXES, diagnose_trace, format_summary, load_trace, trace_summary
from course_lib.device import pick_device
from course_lib.reference import record
from course_lib.tables import table
from course_lib.timing import Timing, compare, synchronize, time_fn

__all__ = [
    "trace_folder",
    "show_traces",
    "profile_steps",
    "quiet_profiler",
    "format_schedule",
    "key_average_rows",
    "format_key_averages",
    "format_profiling_reference",
]

# Kineto and c10 write start/stop banners (and, on a machine without a GPU, a CUDA error) straight
# to the process's stderr, below Python: a notebook shows them as red text. These are dropped.
_NOISE = ("USDT:", "STAGE:", "gpuGetDeviceCount failed", "Memory block of unknown size", "CUPTI")


@contextlib.contextmanager
def quiet_profiler() -> Iterator[None]:
    """Chapter 06: the profiler's C++ banners and, without a GPU, Kineto's CUDA error
    (`gpuGetDeviceCount failed`) dropped from the process's stderr; every other line still shows."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode(errors="replace").splitlines()
            print("\n".join(s for s in lines if s and not any(n in s for n in _NOISE)), file=sys.stderr, end="")


# --------------------------------------------------------------------------- where the traces go

# The course's root: course_lib/ sits in it (an editable install, as `make` and Colab's setup cell
# do it), and JupyterLab (`make lab`) shows it in its file browser.
COURSE_ROOT = Path(__file__).resolve().parents[3]


def trace_folder(name: str = "06_profiling", root: str | os.PathLike | None = None, fresh: bool = False) -> Path:
    """Chapter 06: the folder for a chapter's profiler traces, runs/<name>/ in the course (made if
    missing; with fresh=True emptied first, so that it holds this run's files only). /runs/ is
    git-ignored; JupyterLab's file browser shows it, whatever the kernel's cwd."""
    folder = Path(root or COURSE_ROOT) / "runs" / name
    if fresh and folder.is_dir():
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def show_traces(folder: str | os.PathLike, pattern: str = "*.json") -> None:
    """Chapter 06: list the traces in `folder`, with their sizes. In a notebook each name is also a
    link that downloads the file (to drag into https://ui.perfetto.dev); elsewhere, the full paths.
    Returns None, so that a cell ending in it shows the list and not the paths again as its result."""
    paths = sorted(Path(folder).glob(pattern))
    plain = "\n".join(f"{p}  ({p.stat().st_size / 1024:.0f} KiB)" for p in paths) or f"no {pattern} in {folder}"
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        print(plain)
        return None
    notebooks = COURSE_ROOT / "notebooks"  # links in a chapter's output resolve against the notebook's folder
    items = "".join(
        f'<li><a href="{html.escape(os.path.relpath(p, notebooks))}" download>{html.escape(p.name)}</a>'
        f" ({p.stat().st_size / 1024:.0f} KiB)</li>"
        for p in paths
    )
    where = html.escape(
        os.path.relpath(folder, COURSE_ROOT) if Path(folder).is_relative_to(COURSE_ROOT) else str(folder)
    )
    display(
        {
            "text/plain": plain,
            "text/html": f"<p>In <code>{where}/</code> (click to download):</p><ul>{items}</ul>"
            f"<p>On this computer: <code>{html.escape(str(Path(folder).resolve()))}</code></p>",
        },
        raw=True,
    )
    return None


# --------------------------------------------------------------------------- recording


@dataclass
class Profiled:
    """What profile_steps recorded: the profiler, the Chrome traces it wrote, every step's wall time."""

    prof: torch.profiler.profile
    traces: list[str]
    step_ms: list[float]
    active: int


def profile_steps(
    step: Callable[[], object],
    *,
    wait: int = 1,
    warmup: int = 1,
    active: int = 3,
    repeat: int = 1,
    trace_dir: str | os.PathLike | None = None,
    name: str = "step",
    record_shapes: bool = False,
    profile_memory: bool = False,
    with_stack: bool = False,
    device: torch.device | str | None = None,
) -> Profiled:
    """Chapter 06: run `step` (wait + warmup + active) x repeat times under torch.profiler.

    The schedule skips `wait` steps, records `warmup` steps and throws them away (the profiler's
    own start-up), keeps `active` steps. At the end of each cycle a Chrome trace is written to
    trace_dir/<name>_<step>.pt.trace.json (Perfetto, chrome://tracing and TensorBoard read it).
    Each step's wall time is measured too (synchronised), profiled or not.
    """
    dev = torch.device(device) if device is not None else pick_device()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    traces: list[str] = []

    def on_trace_ready(p: torch.profiler.profile) -> None:
        if trace_dir is not None:
            path = Path(trace_dir) / f"{name}_{p.step_num}.pt.trace.json"
            p.export_chrome_trace(str(path))
            traces.append(str(path))

    times = []
    sched = torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat)
    with (
        quiet_profiler(),
        torch.profiler.profile(
            activities=activities,
            schedule=sched,
            on_trace_ready=on_trace_ready,
            record_shapes=record_shapes,
            profile_memory=profile_memory,
            with_stack=with_stack,
        ) as prof,
    ):
        for _ in range((wait + warmup + active) * repeat):
            t0 = time.perf_counter()
            step()
            synchronize(dev)
            times.append((time.perf_counter() - t0) * 1e3)
            prof.step()
    return Profiled(prof, traces, times, active)


def format_schedule(steps: int, **schedule: int) -> str:
    """Chapter 06: what torch.profiler.schedule(**schedule) does at each of `steps` steps, on two lines."""
    sched = torch.profiler.schedule(**schedule)
    code = {"NONE": "-", "WARMUP": "w", "RECORD": "r", "RECORD_AND_SAVE": "S"}
    actions = [sched(i).name for i in range(steps)]
    return (
        " step "
        + "".join(f"{i:>3}" for i in range(steps))
        + "\n  did "
        + "".join(f"{code[a]:>3}" for a in actions)
        + f"\n({actions.count('RECORD_AND_SAVE')} traces written; - skipped, w warm-up, r recorded, "
        "S recorded and trace written)"
    )


def key_average_rows(run: Profiled) -> list[dict]:
    """Chapter 06: torch.profiler's key_averages() as plain rows, per profiled step (times in ms)."""
    n = 1e3 * max(1, run.active)
    return [
        {
            "name": e.key,
            "calls": e.count * 1e3 / n,
            "self_cpu_ms": e.self_cpu_time_total / n,
            "cpu_ms": e.cpu_time_total / n,
            "self_device_ms": (getattr(e, "self_device_time_total", 0) or 0) / n,
            "device_ms": (getattr(e, "device_time_total", 0) or 0) / n,
        }
        for e in run.prof.key_averages()
    ]


def format_key_averages(rows: list[dict], sort_by: str = "self_cpu_ms", limit: int = 10, width: int = 100) -> str:
    """Chapter 06: the heaviest `limit` rows by `sort_by` as a table at most `width` characters wide."""
    heads = {
        "calls": "calls",
        "self_cpu_ms": "self CPU",
        "cpu_ms": "CPU total",
        "self_device_ms": "self dev",
        "device_ms": "dev total",
    }
    keys = list(heads)[:3] + (list(heads)[3:] if any(r["device_ms"] for r in rows) else [])
    total = sum(r[sort_by] for r in rows) or 1.0
    room = width - 12 * len(keys) - 9  # what the name may take, so that no line is wider than `width`
    columns = [("name", lambda r: r["name"] if len(r["name"]) < room else r["name"][: room - 2] + "…", "")]
    columns += [(heads[k] + ("" if k == "calls" else " ms"), k, ".0f" if k == "calls" else ".3f") for k in keys]
    columns.append(("share", lambda r: r[sort_by] / total, ".1%"))
    return table(sorted(rows, key=lambda r: -r[sort_by])[:limit], columns)


def format_profiling_reference(ref: dict, part: str) -> str:
    """Chapter 06: one part of a recorded data/reference/profiling_<gpu>.json as text:
    "steps", "bottlenecks", "sync", "timing" or "memory"."""
    out = []
    if part in ("steps", "bottlenecks"):
        out.append(format_summary({k: v["summary"] for k, v in ref[part].items()}))
        out += [
            textwrap.fill(
                f"{k}: diagnosed {DIAGNOSES[v['diagnosis'][0]]}; fix: {FIXES[v['diagnosis'][1]]}",
                100,
                subsequent_indent="    ",
            )
            for k, v in ref[part].items()
            if "diagnosis" in v
        ]
    timings: dict[str, dict] = {}  # model size ("" for one model) -> {label: the timed ms}
    if part == "sync":
        timings = ref["sync"]
    elif part == "timing":
        timings = {"": ref["timing"]}
    elif part == "steps":
        timings = {"": {k: v["timing"] for k, v in ref["steps"].items()}}
    for size, rows in timings.items():
        t = {k: Timing(v) for k, v in rows.items()}
        base = "fp32" if part == "steps" else list(t)[-1]
        if size:
            out.append(f"{size} model, ms per step:")
        out += [format_timings(t), compare(t, base)]
    if part == "timing":
        out.append(read_timing_ways({k: Timing(v) for k, v in ref["timing"].items()}))
        on_gpu = any(v["summary"].get("device") == "cuda" for v in ref.get("steps", {}).values())
        if on_gpu:
            out.append(
                textwrap.fill(
                    "(The recording times this after profiling the steps of sections 4 and 5 on the same GPU, in "
                    "the same process: CUDA, cuBLAS, cuDNN and the allocator's cache were already set up.)",
                    100,
                )
            )
    if part == "memory":
        phases = [{"MiB": name, **mib} for name, mib in ref.get("memory", {}).items()]
        columns = [("MiB", "MiB", "")]
        columns += [(k, k, ".1f") for k in ("start", "forward", "backward", "optimizer", "end")]
        out.append(table(phases, columns))
        if snap := ref.get("snapshot"):
            out.append(
                f"snapshot: {snap['allocs']} allocations, peak {snap['peak_mib']:.1f} MiB above the start, "
                f"{snap['reserved_mib']:.1f} MiB reserved; largest:"
            )
            sites = [_site(a["where"]) for a in snap["largest"]]
            out += [f"  {a['mib']:8.1f} MiB  {site}" for a, site in zip(snap["largest"], sites)]
            if phases:  # the recording snapshots the last precision's trainer, after all the runs above
                last = phases[-1]
                out.append(
                    textwrap.fill(
                        f"the snapshot's step ({last['MiB']}): start + peak = {last['start'] + snap['peak_mib']:,.1f} "
                        f"MiB, its backward column {last['backward']:,.1f} MiB; reserved "
                        f"{snap['reserved_mib'] / max(p['backward'] for p in phases):.1f}x the table's largest peak",
                        100,
                    )
                )
            old = [a["where"] for a, site in zip(snap["largest"], sites) if site != a["where"]]
            if old:
                out.append(
                    textwrap.fill(
                        f"(This file names an allocation without a Python frame by its first C++ frame, {old[0]}; "
                        "in a training step such allocations are made on autograd's backward thread.)",
                        100,
                    )
                )
    return "\n".join(out)


def _site(where: str) -> str:
    # Files recorded before allocation_site existed name an allocation without a Python frame by its first
    # C++ frame ("??:0 torch::unwind::unwind()"): in a training step, those are autograd's backward thread.
    return BACKWARD if where.startswith("??:") else where


# --------------------------------------------------------------------------- recording a reference


def _record_all(device: str) -> dict:
    dev = pick_device(device)
    amp = "auto" if dev.type == "cuda" else "bf16"
    out: dict = {"steps": {}, "bottlenecks": {}}
    with tempfile.TemporaryDirectory() as tmp:

        def summary(step: Callable[[], object], name: str) -> dict:
            s = trace_summary(
                load_trace(profile_steps(step, trace_dir=tmp, name=name, device=dev, record_shapes=True).traces[-1])
            )
            rest = s["ops"][8:]  # summaries, not traces: the 8 heaviest ops, and the rest summed up
            s["ops"] = s["ops"][:8] + [
                {
                    "name": f"({len(rest)} other ops)",
                    "input_types": [],
                    **{k: sum(r[k] for r in rest) for k in ("calls", "cpu_ms", "device_ms", "kernels")},
                }
            ] * bool(rest)
            return s

        for prec in ("fp32", amp):
            tr, b = make_trainer(prec, str(dev))
            out["steps"][tr.precision] = {
                "summary": summary(lambda: tr.train_step(b), prec),
                "timing": time_fn(lambda: tr.train_step(b), iters=20, device=dev).times_ms,
            }
        for name, step in bottleneck_steps(str(dev)).items():
            s = summary(step, name)
            out["bottlenecks"][name] = {"summary": s, "diagnosis": list(diagnose_trace(s))}

        def fresh_step() -> Callable[[], object]:
            t, b = make_trainer("fp32", str(dev))
            return lambda: t.train_step(b)

        out["timing"] = {k: t.times_ms for k, t in naive_vs_proper(fresh_step, str(dev)).items()}
        out["sync"] = {
            size: {k: t.times_ms for k, t in sync_cost(str(dev), **kw).items()}
            for size, kw in (("small", {"width": 16, "batch": 64}), ("GPU-sized", {}))
        }
        if dev.type == "cuda":
            out["memory"] = {}
            for prec in ("fp32", amp):
                tr, b = make_trainer(prec, str(dev), batch=2048)
                out["memory"][tr.precision] = cuda_phase_memory(tr, b)
            out["snapshot"] = memory_snapshot_summary(lambda: tr.train_step(b), Path(tmp) / "snapshot.pickle")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m course_lib.chapters.ch06.profiling",
        description="chapter 06's profiles, timings and memory, recorded as summaries",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--json", help="also write them with provenance (data/reference/profiling_<gpu>.json)")
    args = p.parse_args(argv)
    res = _record_all(args.device)
    text = format_summary(
        {
            **{k: v["summary"] for k, v in res["steps"].items()},
            **{k: v["summary"] for k, v in res["bottlenecks"].items()},
        }
    )
    command = "python -m course_lib.chapters.ch06.profiling " + " ".join(argv if argv is not None else sys.argv[1:])
    record(command, text, args.json, **res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
