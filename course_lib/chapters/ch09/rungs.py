"""The ladder's rungs, chapter 09: what a rung is, the first ladder (the course's own model), how rows are read.

A `Rung` is a label and everything switched on by then; `climb` builds a ladder from its first
rung, each next rung the one before with one change. The course's own ladder (SimpleCNN on the
shipped Fashion-MNIST, trained by the course's Trainer) is measured here; the full-size workloads
(ResNet-50, GPT-2 small), the optimizer and checkpointing tables and the CLI that records them are
in course_lib.chapters.ch09.ladder. Every ladder's rows are read the same way: the speed-up over the
first rung, a table (`format_rows`) and, in words, each rung against the one before (`read_rungs`):

    rows = course_ladder()
    print(format_rows(rows))
    print(read_rungs(rows))
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from course_lib.data import load_dataset
from course_lib.device import mixed_precision_for, pick_device
from course_lib.loaders import make_loader
from course_lib.models import SimpleCNN
from course_lib.tables import table
from course_lib.timing import Timing, compare, time_fn
from course_lib.train import TrainConfig, Trainer

__all__ = ["Rung", "climb", "COURSE_RUNGS", "compiles_quickly", "course_ladder", "format_rows", "read_rungs"]
# with_speedup is public for ladder's full-size ladders; no chapter calls it (not in __all__)


def with_speedup(rows: list[dict]) -> list[dict]:
    """`rows` with each timed row's "speedup" against the first timed one (its ms_per_step over theirs).

    Every ladder's rows end here (course_ladder and ladder's full-size ladders); no chapter calls it.
    """
    base = next(r["ms_per_step"] for r in rows if "ms_per_step" in r)
    for r in rows:
        if "ms_per_step" in r:
            r["speedup"] = base / r["ms_per_step"]
    return rows


# --------------------------------------------------------------------------- the course's model


@dataclass(frozen=True)
class Rung:
    """Chapter 09: one rung of a ladder: its label and everything switched on by then."""

    label: str
    amp: bool = False  # autocast in the device's 16-bit type (a GradScaler with fp16)
    channels_last: bool = False  # course ladder: NHWC weights and inputs
    fused: bool = False  # AdamW(fused=True)
    compiled: bool = False  # torch.compile(model)
    feed: str = "loader"  # course ladder: "loader" (no workers), "workers" (up to 4, pinned), "device"
    tf32: bool = False  # GPT ladder: TF32 for fp32 matmuls
    sdpa: bool = False  # GPT ladder: F.scaled_dot_product_attention


def climb(first: Rung, *changes: tuple[str, dict]) -> list[Rung]:
    """Chapter 09: a ladder from its first rung, each next rung the one before with one change."""
    rungs = [first]
    for label, change in changes:
        rungs.append(replace(rungs[-1], label=label, **change))
    return rungs


COURSE_RUNGS = climb(
    Rung("fp32, DataLoader"),
    ("+ AMP", {"amp": True}),
    ("+ channels_last", {"channels_last": True}),
    ("+ fused AdamW", {"fused": True}),
    ("+ torch.compile", {"compiled": True}),
    ("+ workers, pinned", {"feed": "workers"}),
    ("+ data on the device", {"feed": "device"}),
)


class _Waits:
    """An endless stream of batches that records how long each `next()` kept the step waiting."""

    def __init__(self, batches) -> None:
        self.batches, self.wait_ms = batches, []

    def __next__(self):
        t0 = time.perf_counter()
        batch = next(self.batches)
        self.wait_ms.append((time.perf_counter() - t0) * 1e3)
        return batch


def _cycle(batches):
    while True:
        yield from batches


def _resident(x: torch.Tensor, y: torch.Tensor, batch: int):
    """Batches sliced from tensors already on the device, reshuffled every pass: no DataLoader."""
    while True:
        perm = torch.randperm(len(y), device=x.device)
        for i in range(0, len(y) - batch + 1, batch):
            idx = perm[i : i + batch]
            yield x[idx], y[idx]


def compiles_quickly(device: torch.device, compile_on_cpu: bool = False) -> bool:
    """Chapter 09: is torch.compile's first call quick enough to measure live here? On a CUDA GPU with
    at least 8 CPU cores, yes: Inductor compiles its kernels in parallel worker processes, one per core.
    On Colab's 2 vCPUs a cold compile takes minutes per model, and on a CPU minutes as well, so the
    ladders skip their compiled rungs there (unless `compile_on_cpu`) and the recorded run shows them."""
    return compile_on_cpu or (device.type == "cuda" and (os.cpu_count() or 1) >= 8)


def course_ladder(
    device: str = "auto", batch: int | None = None, steps: int | None = None, compile_on_cpu: bool = False
) -> list[dict]:
    """Chapter 09: the course's SimpleCNN on the shipped Fashion-MNIST, trained by the course's Trainer,
    one change per rung: fp32 fed by a DataLoader -> AMP -> channels_last -> fused AdamW -> torch.compile
    -> loader workers (4, or one per CPU core where there are fewer: chapter 07) and pinned memory -> the
    data kept on the device. Each rung: ms per step,
    loading included, with spread; images/s; `data_wait`, the share of that time spent waiting in next().

    fp32 is PyTorch's default (on Ampere or newer, cuDNN convolutions then use TF32); AMP is the
    device's mixed precision (`mixed_precision_for`). Defaults: batch 256 and 30 timed
    steps on a GPU; batch 32 and 5 steps on a CPU. Where compiling is slow (`compiles_quickly`: a CPU,
    or a GPU with few CPU cores) the compiled rungs are skipped and the last one runs eager.
    """
    dev = pick_device(device)
    cuda = dev.type == "cuda"
    batch = batch or (256 if cuda else 32)
    steps = steps or (30 if cuda else 5)
    amp = mixed_precision_for(dev)
    ds = load_dataset(train_size=None if cuda else 2048, verbose=False)
    rows = []
    for rung in tqdm(COURSE_RUNGS, desc="rungs", leave=False):  # a bar while it runs, gone with it (as chapter 07's)
        label = rung.label.replace("AMP", f"AMP {amp}")
        compiled = rung.compiled
        if compiled and not compiles_quickly(dev, compile_on_cpu):  # not measured; the last rung runs eager
            if rung.feed != "device":
                where = "a CPU" if not cuda else f"{os.cpu_count()} CPU cores"
                rows.append({"mode": label, "note": f"skipped: compiling takes minutes on {where} (see the GPU run)"})
                continue
            compiled = False
            label += " (eager)"
        torch.manual_seed(0)
        model = SimpleCNN(in_channels=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if rung.fused else {}))
        cfg = TrainConfig(
            precision=amp if rung.amp else "fp32",
            device=str(dev),
            channels_last=rung.channels_last,
            progress=False,
            log_every=10**9,
        )
        trainer = Trainer(torch.compile(model) if compiled else model, opt, cfg)
        # at most one worker per core (chapter 07): Colab's 2 vCPUs get 2, not an oversubscribed 4
        workers = {"num_workers": min(4, os.cpu_count() or 1), "pin_memory": cuda, "persistent_workers": True}
        workers = workers if rung.feed == "workers" else {}
        batches = _Waits(
            _resident(*(t.to(dev) for t in ds.train.tensors), batch)
            if rung.feed == "device"
            else _cycle(make_loader(ds.train, batch, seed=0, drop_last=True, **workers))
        )
        timing = time_fn(
            lambda t=trainer, b=batches: t.train_step([next(b)]), warmup=3 if compiled else 2, iters=steps, device=dev
        )
        q1, q3 = timing.quartiles_ms
        # The timed steps' share of time spent in next(): the step waited for its batch (chapter 07).
        waited = sum(batches.wait_ms[-steps:]) / sum(timing.times_ms)
        rows.append(
            {
                "mode": label,
                "precision": trainer.precision,
                "batch": batch,
                "ms_per_step": timing.median_ms,
                "ms_q1": q1,
                "ms_q3": q3,
                "times_ms": timing.times_ms,
                "samples_per_s": batch / timing.median_ms * 1e3,
                "feed": rung.feed,
                "num_workers": workers.get("num_workers", 0),
                "data_wait": min(waited, 1.0),
            }
        )
        del trainer, model, opt
    return with_speedup(rows)


# --------------------------------------------------------------------------- tables


def _rate(r: dict) -> str:
    """The throughput column: images or tokens per second, whichever the rung measured."""
    if "samples_per_s" in r:
        return f"{r['samples_per_s']:.0f} img/s"
    if "tokens_per_s" in r:
        return f"{r['tokens_per_s']:.0f} tok/s"
    return ""


def _extra(r: dict) -> str:
    """The last column: the one extra measurement the ladder took (MFU, peak memory, saved bytes, data wait)."""
    if r.get("mfu") is not None:
        return f"{r['mfu']:.0%} MFU"
    if r.get("peak_memory_gib") is not None:
        return f"{r['peak_memory_gib']:.2f} GiB"
    if "saved_mib" in r:
        return f"{r['saved_mib']:.1f} MiB"
    if r.get("data_wait") is not None:
        return f"{r['data_wait']:.0%} wait"
    return ""


def format_rows(rows: list[dict]) -> str:
    """Chapter 09: ladder rows as a table of at most 100 columns (MFU, memory or data wait where measured)."""
    columns = [
        ("rung", "mode", ""),
        ("ms/step", "ms_per_step", ".1f"),
        ("middle half", lambda r: f"{r['ms_q1']:.1f}-{r['ms_q3']:.1f}", ""),
        ("speed-up", lambda r: f"{r['speedup']:.2f}x", ""),
        ("throughput", _rate, ""),
        ("mem/MFU/wait", _extra, ""),
    ]
    return table(rows, columns, skipped=lambda r: None if "ms_per_step" in r else f"skipped: {r['note']}")


def read_rungs(rows: list[dict]) -> str:
    """Chapter 09: each timed rung against the one before it, in words (course_lib.timing.compare):
    faster or slower, by what factor, and whether the difference is larger than the spread."""
    timed = [r for r in rows if "times_ms" in r]
    return "\n".join(
        compare({a["mode"]: Timing(a["times_ms"]), b["mode"]: Timing(b["times_ms"])}, a["mode"])
        for a, b in zip(timed, timed[1:])
    )
