"""The training steps chapter 06 measures, and what it measures of them besides the profile: time and memory.

Chapter 06. `make_trainer` builds one training step of the course model, sized for the device,
and `bottleneck_steps` three steps with one bottleneck each built in; course_lib.chapters.ch06.profiling
profiles them. Without the profiler: a step timed naively and properly (`naive_vs_proper`), the
cost of reading the loss back every step (`sync_cost`), and on a GPU the memory of each phase of
a step (`cuda_phase_memory`) and the allocator's history (`memory_snapshot_summary`, read by
`summarise_snapshot`):

    trainer, batch = make_trainer()              # one step is trainer.train_step(batch)
    print(format_timings(sync_cost()))           # the loss read back every step, and every 10 steps
    phases = cuda_phase_memory(trainer, batch)   # peak MiB of forward, backward, optimizer (CUDA)
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import textwrap
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from course_lib.data import load_dataset
from course_lib.device import pick_device
from course_lib.models import MLP, SimpleCNN
from course_lib.timing import Timing, synchronize, time_fn
from course_lib.train import TrainConfig, Trainer

__all__ = [
    "make_trainer",
    "bottleneck_steps",
    "naive_vs_proper",
    "read_timing_ways",
    "sync_cost",
    "format_timings",
    "cuda_phase_memory",
    "memory_snapshot_summary",
    "summarise_snapshot",
]


# --------------------------------------------------------------------------- the steps this chapter profiles


def make_trainer(
    precision: str = "fp32",
    device: str = "auto",
    width: int | None = None,
    batch: int | None = None,
    log_every: int = 10,
) -> tuple[Trainer, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Chapter 06: the course's SimpleCNN, a Trainer and one Fashion-MNIST batch, sized for the device
    (CPU: width 16, batch 64; GPU: width 64, batch 512). `trainer.train_step(batch)` is one step."""
    dev = pick_device(device)
    gpu = dev.type == "cuda"
    width = width or (64 if gpu else 16)
    batch = batch or (512 if gpu else 64)
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
        return Trainer(
            model,
            torch.optim.AdamW(model.parameters(), **opt),
            TrainConfig(precision="fp32", device=str(dev), progress=False),
        )

    torch.manual_seed(0)
    small = trainer(MLP(hidden=256, depth=1))
    tiny = trainer(MLP(hidden=32, depth=16), foreach=False)  # many tiny kernels: launch-bound
    heavy, heavy_batch = make_trainer("fp32", str(dev), width=256 if gpu else 32, batch=1024 if gpu else 64)
    loader = torch.utils.data.DataLoader(_SlowImages(*_images()), batch_size=64)
    stream = (b for _ in iter(int, 1) for b in loader)  # endless
    x, y = _images()[0][:8].to(dev), _images()[1][:8].to(dev)
    return {
        "data": lambda: small.train_step([next(stream)]),
        "overhead": lambda: tiny.train_step([(x, y)]),
        "compute": lambda: heavy.train_step(heavy_batch),
    }


# --------------------------------------------------------------------------- timing, right and wrong


def naive_vs_proper(
    make_step: Callable[[], Callable[[], object]], device: str = "auto", repeats: int = 5, iters: int = 10
) -> dict[str, Timing]:
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


def read_timing_ways(ways: dict[str, Timing]) -> str:
    """Chapter 06: naive_vs_proper's three timings read against each other, in numbers and words.

    naive - no sync: what a fresh model's first call costs above a warm call (both unsynchronised);
    proper - no sync: the work still queued when a clock stops without a synchronize. The naive
    number is off from the proper one by the first minus the second: they can cancel.
    """
    naive, nosync, proper = ways["naive"], ways["no sync"], ways["proper"]
    first, missed = naive.median_ms - nosync.median_ms, proper.median_ms - nosync.median_ms
    noise = max(hi - lo for lo, hi in (proper.quartiles_ms, nosync.quartiles_ms))  # the wider middle half
    lines = [
        f"naive - no sync  = {first:+.2f} ms: a fresh model's first call, above a warm call",
        f"proper - no sync = {missed:+.2f} ms: still running when a clock stops without a synchronize",
        f"naive - proper   = {first - missed:+.2f} ms (the middle halves of these runs are up to {noise:.2f} ms wide)",
    ]
    if abs(missed) <= noise:
        words = (
            "No sync and proper agree within the spread: nothing was left queued (on a CPU each op has run "
            "when its call returns), so the naive error is the first call's cost alone"
            + (f", {first:+.2f} ms." if abs(first) > noise else ", and this run cannot tell it from the spread.")
        )
    elif abs(first) <= noise:
        words = (
            "The first call cost no more than the spread (whatever it sets up was already set up in this "
            f"process), so the naive number is short by what the missing synchronize drops, {missed:.2f} ms."
        )
    elif abs(first - missed) <= noise:
        words = (
            f"Both errors are real, {first:.2f} ms of first-call cost and {missed:.2f} ms that the clock "
            "missed, and here they cancel: a naive number this close to the proper one is luck, not a "
            "measurement."
        )
    else:
        words = (
            f"The naive number is {'long' if first > missed else 'short'} by {abs(first - missed):.2f} ms: "
            f"{first:.2f} ms of first-call cost against {missed:.2f} ms that the missing synchronize dropped."
        )
    return "\n".join(lines + [textwrap.fill(words, 100)])


def sync_cost(device: str = "auto", steps: int = 10, iters: int = 7, **trainer_kw) -> dict[str, Timing]:
    """Chapter 06: ms per training step when the loss is read back every step (log_every=1: a
    `.tolist()`, i.e. a device-to-host copy and a synchronize, per step) and every `steps` steps."""
    out = {}
    for label, every in (("read every step", 1), (f"read every {steps} steps", steps)):
        trainer, batch = make_trainer(device=device, log_every=every, **trainer_kw)
        t = time_fn(
            lambda: [trainer.train_step(batch) for _ in range(steps)], warmup=1, iters=iters, device=trainer.device
        )
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
    x, y = batch[0]
    mib = 2.0**20
    out = {}  # phase -> MiB allocated at its end
    torch.cuda.synchronize()
    out["start"] = torch.cuda.memory_allocated() / mib
    torch.cuda.reset_peak_memory_stats()
    trainer.optimizer.zero_grad(set_to_none=True)
    with trainer.autocast():
        loss = trainer.loss_fn(trainer.model(x), y)
    phases = {
        "forward": lambda: None,
        "backward": lambda: trainer.scaler.scale(loss).backward(),
        "optimizer": lambda: (trainer.scaler.step(trainer.optimizer), trainer.scaler.update()),
    }
    for name, fn in phases.items():
        fn()
        torch.cuda.synchronize()
        out[name] = torch.cuda.max_memory_allocated() / mib
        torch.cuda.reset_peak_memory_stats()
    out["end"] = torch.cuda.memory_allocated() / mib
    return out


def memory_snapshot_summary(step: Callable[[], object], path: str | os.PathLike, steps: int = 2) -> dict:
    """Chapter 06: record the CUDA allocator's history over `steps` steps, dump the snapshot to `path`
    (drag it into https://pytorch.org/memory_viz) and summarise it with `summarise_snapshot`."""
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "rb") as f:
        return summarise_snapshot(pickle.load(f))


BACKWARD = "autograd backward (no Python frame)"


def _is_python(frame: dict) -> bool:
    # A Python frame names a source file (a notebook cell's too: ipykernel writes cells to *.py
    # files) or a pseudo-file such as <string>; a C++ frame names ?? or a .cpp/.h/.so file.
    return frame["filename"].endswith(".py") or frame["filename"].startswith("<")


def allocation_site(frames: list[dict]) -> str:
    """Where an allocation of a CUDA memory snapshot was made, from its stack (innermost frame first).

    The first Python frame outside torch: the line of the course's (or your) code that asked for the
    memory. An allocation made on autograd's backward thread has no Python frame at all: the engine
    runs CUDA backward functions on a C++ thread of its own, so only C++ frames were recorded. It is
    labelled as such, with the backward function's name where a C++ frame gives it.
    """
    python = [f for f in frames if _is_python(f)]
    if python:
        f = next((f for f in python if "/torch/" not in f["filename"].replace("\\", "/")), python[0])
        return f"{Path(f['filename']).name}:{f['line']} {f['name']}"
    names = [f.get("name", "") for f in frames]
    if any("autograd" in n for n in names):
        node = next((m[1] for n in names if (m := re.search(r"(\w+Backward\d*|AccumulateGrad)::apply", n))), "")
        return BACKWARD.replace(" (", f", {node} (") if node else BACKWARD
    return "no Python frame (C++ only)"


def summarise_snapshot(snap: dict) -> dict:
    """Chapter 06: a CUDA memory snapshot (torch.cuda.memory._snapshot() or its pickle) in numbers:
    allocations, the peak allocated since recording began, the memory reserved, and the five largest
    allocations with where they were made (`allocation_site`)."""
    trace = [e for dev in snap["device_traces"] for e in dev]
    cur = 0  # bytes allocated since recording began, replayed event by event
    peak = 0
    mib = 2.0**20
    for e in trace:  # replay the allocator's history: bytes allocated since recording began
        cur += {"alloc": e["size"], "free_completed": -e["size"]}.get(e["action"], 0)
        peak = max(peak, cur)
    allocs = sorted((e for e in trace if e["action"] == "alloc"), key=lambda e: -e["size"])
    return {
        "allocs": len(allocs),
        "peak_mib": peak / mib,
        "reserved_mib": sum(s["total_size"] for s in snap["segments"]) / mib,
        "largest": [{"mib": e["size"] / mib, "where": allocation_site(e.get("frames", []))} for e in allocs[:5]],
    }
