"""Profiling a training step: torch.profiler with a schedule, its tables, and what chapter 06 measures with it.

Chapter 06. The profiler records every op (and, on a GPU, every kernel) of the steps its
schedule marks active, and writes a Chrome trace that Perfetto (https://ui.perfetto.dev)
opens; course_lib.chapters.traces reads it. Here: the profiling loop, key_averages as a
table, the steps the chapter profiles (the course model, three built-in bottlenecks), timing
done naively and properly, the cost of a read-back per step, CUDA memory per phase and a
memory snapshot, and the CLI that records the GPU results:

    run = profile_steps(step, trace_dir=trace_folder(), wait=1, warmup=1, active=3)  # runs/06_profiling/
    print(format_key_averages(key_average_rows(run)))      # what torch.profiler's table says
    summary = trace_summary(load_trace(run.traces[-1]))    # course_lib.chapters.traces
    python -m course_lib.chapters.profiling --json data/reference/profiling_<gpu>.json
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import html
import os
import pickle
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity

from ..data import load_dataset
from ..device import pick_device
from ..models import MLP, SimpleCNN
from ..reference import record
from ..timing import Timing, compare, synchronize, time_fn
from ..train import TrainConfig, Trainer
from .traces import FIXES, diagnose, format_summary, load_trace, trace_summary

__all__ = ["trace_folder", "show_traces", "profile_steps", "format_schedule", "key_average_rows", "format_key_averages",
           "make_trainer", "bottleneck_steps", "naive_vs_proper", "sync_cost", "format_timings",
           "cuda_phase_memory", "memory_snapshot_summary", "format_reference"]

# Kineto and c10 write start/stop banners (and, on a machine without a GPU, a CUDA error) straight
# to the process's stderr, below Python: a notebook shows them as red text. These are dropped.
_NOISE = ("USDT:", "STAGE:", "gpuGetDeviceCount failed", "Memory block of unknown size", "CUPTI")


@contextlib.contextmanager
def _quiet_profiler():
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
COURSE_ROOT = Path(__file__).resolve().parents[2]


def trace_folder(name: str = "06_profiling", root: str | os.PathLike | None = None) -> Path:
    """Chapter 06: the folder for a chapter's profiler traces, runs/<name>/ in the course (made if
    missing). /runs/ is git-ignored; JupyterLab's file browser shows it, whatever the kernel's cwd."""
    folder = Path(root or COURSE_ROOT) / "runs" / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def show_traces(folder: str | os.PathLike, pattern: str = "*.json") -> list[Path]:
    """Chapter 06: list the traces in `folder`, with their sizes. In a notebook each name is also a
    link that downloads the file (to drag into https://ui.perfetto.dev); elsewhere, the full paths."""
    paths = sorted(Path(folder).glob(pattern))
    plain = "\n".join(f"{p}  ({p.stat().st_size / 1024:.0f} KiB)" for p in paths) or f"no {pattern} in {folder}"
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        print(plain)
        return paths
    notebooks = COURSE_ROOT / "notebooks"  # links in a chapter's output resolve against the notebook's folder
    items = "".join(f'<li><a href="{html.escape(os.path.relpath(p, notebooks))}" download>{html.escape(p.name)}</a>'
                    f" ({p.stat().st_size / 1024:.0f} KiB)</li>" for p in paths)
    where = html.escape(os.path.relpath(folder, COURSE_ROOT) if Path(folder).is_relative_to(COURSE_ROOT) else folder)
    display({"text/plain": plain, "text/html": f"<p>In <code>{where}/</code> (click to download):</p><ul>{items}</ul>"
             f"<p>On this computer: <code>{html.escape(str(Path(folder).resolve()))}</code></p>"}, raw=True)
    return paths


# --------------------------------------------------------------------------- recording

@dataclass
class Profiled:
    """What profile_steps recorded: the profiler, the Chrome traces it wrote, every step's wall time."""
    prof: torch.profiler.profile
    traces: list[str]
    step_ms: list[float]
    active: int


def profile_steps(step: Callable[[], object], *, wait: int = 1, warmup: int = 1, active: int = 3, repeat: int = 1,
                  trace_dir: str | os.PathLike | None = None, name: str = "step", record_shapes: bool = False,
                  profile_memory: bool = False, with_stack: bool = False,
                  device: torch.device | str | None = None) -> Profiled:
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
    with _quiet_profiler(), torch.profiler.profile(activities=activities, schedule=sched, on_trace_ready=on_trace_ready,
                                                   record_shapes=record_shapes, profile_memory=profile_memory,
                                                   with_stack=with_stack) as prof:
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
    return (" step " + "".join(f"{i:>3}" for i in range(steps)) + "\n  did " + "".join(f"{code[a]:>3}" for a in actions)
            + f"\n({actions.count('RECORD_AND_SAVE')} traces written; - skipped, w warm-up, r recorded, "
            "S recorded and trace written)")


def key_average_rows(run: Profiled) -> list[dict]:
    """Chapter 06: torch.profiler's key_averages() as plain rows, per profiled step (times in ms)."""
    n = 1e3 * max(1, run.active)
    return [{"name": e.key, "calls": e.count * 1e3 / n, "self_cpu_ms": e.self_cpu_time_total / n,
             "cpu_ms": e.cpu_time_total / n, "self_device_ms": (getattr(e, "self_device_time_total", 0) or 0) / n,
             "device_ms": (getattr(e, "device_time_total", 0) or 0) / n} for e in run.prof.key_averages()]


def format_key_averages(rows: list[dict], sort_by: str = "self_cpu_ms", limit: int = 10, width: int = 100) -> str:
    """Chapter 06: the heaviest `limit` rows by `sort_by` as a table at most `width` characters wide."""
    heads = {"calls": "calls", "self_cpu_ms": "self CPU", "cpu_ms": "CPU total", "self_device_ms": "self dev",
             "device_ms": "dev total"}
    keys = list(heads)[:3] + (list(heads)[3:] if any(r["device_ms"] for r in rows) else [])
    total, w = sum(r[sort_by] for r in rows) or 1.0, width - 10 * len(keys) - 7
    out = [f"{'name':<{w}}" + "".join(f"{heads[k]:>10}" for k in keys) + f"{'share':>7}",
           f"{'(ms per step)':>{w + 10 * len(keys)}}"]
    for r in sorted(rows, key=lambda r: -r[sort_by])[:limit]:
        name = r["name"] if len(r["name"]) < w else r["name"][: w - 2] + "…"
        cells = "".join(f"{r[k]:>10.0f}" if k == "calls" else f"{r[k]:>10.3f}" for k in keys)
        out.append(f"{name:<{w}}{cells}{r[sort_by] / total:>7.1%}")
    return "\n".join(out)


# --------------------------------------------------------------------------- the steps this chapter profiles

def make_trainer(precision: str = "fp32", device: str = "auto", width: int | None = None, batch: int | None = None,
                 log_every: int = 10) -> tuple[Trainer, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Chapter 06: the course's SimpleCNN, a Trainer and one Fashion-MNIST batch, sized for the device
    (CPU: width 16, batch 64; GPU: width 64, batch 512). `trainer.train_step(batch)` is one step."""
    dev = pick_device(device)
    gpu = dev.type == "cuda"
    width, batch = width or (64 if gpu else 16), batch or (512 if gpu else 64)
    torch.manual_seed(0)
    x, y = _images()[0][:batch], _images()[1][:batch]
    model = SimpleCNN(in_channels=1, width=width)
    cfg = TrainConfig(precision=precision, device=str(dev), progress=False, log_every=log_every)
    return Trainer(model, torch.optim.AdamW(model.parameters()), cfg), [(x.to(dev), y.to(dev))]


@functools.cache
def _images() -> tuple[torch.Tensor, torch.Tensor]:
    return load_dataset(verbose=False).train.tensors


class _SlowImages(torch.utils.data.TensorDataset):
    """Images that take 1 ms each to load: a sleep stands in for reading and decoding a JPEG."""
    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        time.sleep(1e-3)
        return super().__getitem__(i)


def bottleneck_steps(device: str = "auto") -> dict[str, Callable[[], object]]:
    """Chapter 06: three training steps (Trainer.train_step, fp32), each with one bottleneck built in.

    "data": a small MLP fed by a DataLoader (num_workers=0) whose images take 1 ms each to load;
    "overhead": a 16-layer MLP 32 wide on 8 examples, AdamW as a for-loop over its 34 tensors;
    "compute": SimpleCNN 32 wide on 64 images (GPU: 256 wide on 1,024).
    """
    dev = pick_device(device)
    gpu = dev.type == "cuda"

    def trainer(model: nn.Module, **opt) -> Trainer:
        return Trainer(model, torch.optim.AdamW(model.parameters(), **opt),
                       TrainConfig(precision="fp32", device=str(dev), progress=False))
    torch.manual_seed(0)
    small, tiny = trainer(MLP(hidden=256, depth=1)), trainer(MLP(hidden=32, depth=16), foreach=False)
    heavy, heavy_batch = make_trainer("fp32", str(dev), width=256 if gpu else 32, batch=1024 if gpu else 64)
    loader = torch.utils.data.DataLoader(_SlowImages(*_images()), batch_size=64)
    stream = (b for _ in iter(int, 1) for b in loader)  # endless
    x, y = _images()[0][:8].to(dev), _images()[1][:8].to(dev)
    return {"data": lambda: small.train_step([next(stream)]), "overhead": lambda: tiny.train_step([(x, y)]),
            "compute": lambda: heavy.train_step(heavy_batch)}


# --------------------------------------------------------------------------- timing, right and wrong

def naive_vs_proper(make_step: Callable[[], Callable[[], object]], device: str = "auto", repeats: int = 5,
                    iters: int = 10) -> dict[str, Timing]:
    """Chapter 06: one step timed three ways. `make_step()` builds a fresh model and returns its step.

    "naive": the first call of a fresh step, no warm-up, no synchronize (repeated `repeats` times,
    fresh each time, to show its spread); "no sync": warm, each call timed without synchronize;
    "proper": course_lib.timing.time_fn (warm-up, synchronize or CUDA events, `iters` samples).
    """
    dev = pick_device(device)
    naive, nosync = [], []
    for _ in range(repeats):
        step = make_step()
        t0 = time.perf_counter()
        step()
        naive.append((time.perf_counter() - t0) * 1e3)
        synchronize(dev)
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        nosync.append((time.perf_counter() - t0) * 1e3)
    synchronize(dev)
    proper = time_fn(step, warmup=3, iters=iters, device=dev)
    return {"naive": Timing(naive), "no sync": Timing(nosync), "proper": proper}


def sync_cost(device: str = "auto", steps: int = 10, iters: int = 7, **trainer_kw) -> dict[str, Timing]:
    """Chapter 06: ms per training step when the loss is read back every step (log_every=1: a
    `.tolist()`, i.e. a device-to-host copy and a synchronize, per step) and every `steps` steps."""
    out = {}
    for label, every in (("read every step", 1), (f"read every {steps} steps", steps)):
        trainer, batch = make_trainer(device=device, log_every=every, **trainer_kw)
        t = time_fn(lambda: [trainer.train_step(batch) for _ in range(steps)], warmup=1, iters=iters,
                    device=trainer.device)
        out[label] = Timing([ms / steps for ms in t.times_ms])
    return out


def format_timings(timings: dict[str, Timing]) -> str:
    """Chapter 06: one line per timing: median, middle half and number of samples."""
    return "\n".join(f"{label:<24}{t}" for label, t in timings.items())


# --------------------------------------------------------------------------- CUDA memory

def cuda_phase_memory(trainer: Trainer, batch: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Chapter 06: peak CUDA memory (MiB) during forward, backward and the optimizer step of one
    training step done as Trainer.train_step does it, after two warm steps (Adam's state exists)."""
    for _ in range(2):
        trainer.train_step(batch)
    (x, y), mib, out = batch[0], 2.0 ** 20, {}
    torch.cuda.synchronize()
    out["start"] = torch.cuda.memory_allocated() / mib
    torch.cuda.reset_peak_memory_stats()
    trainer.optimizer.zero_grad(set_to_none=True)
    with trainer.autocast():
        loss = trainer.loss_fn(trainer.model(x), y)
    phases = {"forward": lambda: None, "backward": lambda: trainer.scaler.scale(loss).backward(),
              "optimizer": lambda: (trainer.scaler.step(trainer.optimizer), trainer.scaler.update())}
    for name, fn in phases.items():
        fn()
        torch.cuda.synchronize()
        out[name] = torch.cuda.max_memory_allocated() / mib
        torch.cuda.reset_peak_memory_stats()
    out["end"] = torch.cuda.memory_allocated() / mib
    return out


def memory_snapshot_summary(step: Callable[[], object], path: str | os.PathLike, steps: int = 2) -> dict:
    """Chapter 06: record the CUDA allocator's history over `steps` steps, dump the snapshot to `path`
    (drag it into https://pytorch.org/memory_viz) and summarise it: allocations, the peak allocated
    since recording began, and the five largest allocations with the line of code that made them."""
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    trace, cur, peak, mib = [e for dev in snap["device_traces"] for e in dev], 0, 0, 2.0 ** 20
    for e in trace:  # replay the allocator's history: bytes allocated since recording began
        cur += {"alloc": e["size"], "free_completed": -e["size"]}.get(e["action"], 0)
        peak = max(peak, cur)

    def where(e: dict) -> str:  # the first frame outside torch: the line of code that asked for the memory
        frames = [f for f in e.get("frames", []) if "/torch/" not in f["filename"] and f["line"] > 0]
        f = (frames or e.get("frames") or [{"filename": "?", "line": 0, "name": "?"}])[0]
        return f"{Path(f['filename']).name}:{f['line']} {f['name']}"
    allocs = sorted((e for e in trace if e["action"] == "alloc"), key=lambda e: -e["size"])
    return {"allocs": len(allocs), "peak_mib": peak / mib,
            "reserved_mib": sum(s["total_size"] for s in snap["segments"]) / mib,
            "largest": [{"mib": e["size"] / mib, "where": where(e)} for e in allocs[:5]]}


def format_reference(ref: dict, part: str) -> str:
    """Chapter 06: one part of a recorded data/reference/profiling_<gpu>.json as text:
    "steps", "bottlenecks", "sync", "timing" or "memory"."""
    out = []
    if part in ("steps", "bottlenecks"):
        out.append(format_summary({k: v["summary"] for k, v in ref[part].items()}))
        out += [textwrap.fill(f"{k}: diagnosed {v['diagnosis'][0]}; fix: {FIXES[v['diagnosis'][1]]}", 100,
                              subsequent_indent="    ") for k, v in ref[part].items() if "diagnosis" in v]
    for size, rows in (ref["sync"] if part == "sync" else {"": ref["timing"]} if part == "timing" else {
            "": {k: v["timing"] for k, v in ref["steps"].items()}} if part == "steps" else {}).items():
        t = {k: Timing(v) for k, v in rows.items()}
        base = "fp32" if part == "steps" else list(t)[-1]
        out += [f"{size} model, ms per step:"] * bool(size) + [format_timings(t), compare(t, base)]
    if part == "memory":
        cols = ("start", "forward", "backward", "optimizer", "end")
        out.append(f"{'MiB':<6}" + "".join(f"{k:>11}" for k in cols))
        out += [f"{p:<6}" + "".join(f"{m[k]:>11.1f}" for k in cols) for p, m in ref.get("memory", {}).items()]
        if snap := ref.get("snapshot"):
            out.append(f"snapshot: {snap['allocs']} allocations, peak {snap['peak_mib']:.1f} MiB above the start, "
                       f"{snap['reserved_mib']:.1f} MiB reserved; largest:")
            out += [f"  {a['mib']:8.1f} MiB  {a['where']}" for a in snap["largest"]]
    return "\n".join(out)


# --------------------------------------------------------------------------- recording a reference

def _record_all(device: str) -> dict:
    dev = pick_device(device)
    amp = "auto" if dev.type == "cuda" else "bf16"
    out: dict = {"steps": {}, "bottlenecks": {}}
    with tempfile.TemporaryDirectory() as tmp:
        def summary(step: Callable[[], object], name: str) -> dict:
            s = trace_summary(load_trace(profile_steps(step, trace_dir=tmp, name=name, device=dev,
                                                       record_shapes=True).traces[-1]))
            rest = s["ops"][8:]  # summaries, not traces: the 8 heaviest ops, and the rest summed up
            s["ops"] = s["ops"][:8] + [{"name": f"({len(rest)} other ops)", "input_types": [], **{
                k: sum(r[k] for r in rest) for k in ("calls", "cpu_ms", "device_ms", "kernels")}}] * bool(rest)
            return s
        for prec in ("fp32", amp):
            tr, b = make_trainer(prec, str(dev))
            out["steps"][tr.precision] = {"summary": summary(lambda: tr.train_step(b), prec),
                                          "timing": time_fn(lambda: tr.train_step(b), iters=20, device=dev).times_ms}
        for name, step in bottleneck_steps(str(dev)).items():
            s = summary(step, name)
            out["bottlenecks"][name] = {"summary": s, "diagnosis": list(diagnose(s))}
        def fresh_step() -> Callable[[], object]:
            t, b = make_trainer("fp32", str(dev))
            return lambda: t.train_step(b)
        out["timing"] = {k: t.times_ms for k, t in naive_vs_proper(fresh_step, str(dev)).items()}
        out["sync"] = {size: {k: t.times_ms for k, t in sync_cost(str(dev), **kw).items()}
                       for size, kw in (("small", {"width": 16, "batch": 64}), ("GPU-sized", {}))}
        if dev.type == "cuda":
            out["memory"] = {}
            for prec in ("fp32", amp):
                tr, b = make_trainer(prec, str(dev), batch=2048)
                out["memory"][tr.precision] = cuda_phase_memory(tr, b)
            out["snapshot"] = memory_snapshot_summary(lambda: tr.train_step(b), Path(tmp) / "snapshot.pickle")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.chapters.profiling",
                                description="chapter 06's profiles, timings and memory, recorded as summaries")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", help="also write them with provenance (data/reference/profiling_<gpu>.json)")
    args = p.parse_args(argv)
    res = _record_all(args.device)
    text = format_summary({**{k: v["summary"] for k, v in res["steps"].items()},
                           **{k: v["summary"] for k, v in res["bottlenecks"].items()}})
    command = "python -m course_lib.chapters.profiling " + " ".join(argv if argv is not None else sys.argv[1:])
    record(command, text, args.json, **res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
