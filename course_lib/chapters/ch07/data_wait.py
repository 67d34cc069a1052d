"""The data wait measured: a training step timed around `next()`, a sweep over a loader knob, its table and plot.

Chapter 07. The time a step spends in `next(iterator)` is the data wait; measure_loader times it
step by step against a real or simulated model, sweep repeats that over a knob (num_workers,
say), format_runs and plot_sweep show throughput and the wait fraction, and workers_needed
sizes the worker count from one core's rate. The pipeline being measured (datasets, seeding,
the on-device loader, pinned copies) is in course_lib.chapters.ch07.loading.

    run = measure_loader(DataLoader(AugmentedImages(images, labels), batch_size=64, num_workers=2),
                         simulated_step(40), steps=16)
    print(run)                                   # images/s, step time with spread, data-wait fraction
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from tqdm.auto import tqdm

from course_lib.tables import table
from course_lib.timing import Timing

__all__ = [
    "simulated_step",
    "LoaderRun",
    "measure_loader",
    "sweep",
    "format_runs",
    "plot_sweep",
    "cpus",
    "workers_needed",
    "caught_loader_warnings",
]


def simulated_step(ms: float) -> Callable[[object], None]:
    """Chapter 07: a training step that takes `ms` milliseconds and leaves the CPU free (a GPU's step)."""
    return lambda batch: time.sleep(ms / 1000)


@dataclass
class LoaderRun:
    """Chapter 07: what measure_loader returns: per-step data waits and step times (ms) after warm-up."""

    label: str
    batch_size: int
    wait_ms: list[float]
    step_ms: list[float]
    first_batch_ms: float  # iter() until the first batch: starting the workers and filling the pipe

    @property
    def wait_fraction(self) -> float:
        """Time spent waiting for data / total time of the measured steps."""
        return sum(self.wait_ms) / sum(self.step_ms)

    @property
    def images_per_s(self) -> float:
        return 1000 * self.batch_size * len(self.step_ms) / sum(self.step_ms)

    @property
    def step(self) -> Timing:
        return Timing(self.step_ms)

    def windows(self, k: int = 4) -> tuple[list[float], list[float]]:
        """images/s and wait fraction over consecutive windows of `k` steps: their spread."""
        rates, fractions = [], []
        for i in range(0, len(self.step_ms) - k + 1, k):
            s, w = sum(self.step_ms[i : i + k]), sum(self.wait_ms[i : i + k])
            rates.append(1000 * self.batch_size * k / s)
            fractions.append(w / s)
        return rates, fractions

    def __str__(self) -> str:
        return (
            f"{self.label}: {self.images_per_s:,.0f} images/s, step {self.step}, "
            f"waiting for data {self.wait_fraction:.0%} of the time"
        )


def measure_loader(
    loader: Iterable,
    step: Callable[[object], None],
    steps: int = 16,
    warmup: int | None = None,
    label: str = "",
    batch_size: int | None = None,
) -> LoaderRun:
    """Chapter 07: run `warmup` + `steps` training steps on `loader`, timing the wait in `next()`.

    warmup=None: 2 + num_workers, because the workers all finish a first batch at about the same
    time: a stock that the timed steps must not merely drain. When the loader runs out, a new
    epoch starts (iter() again) inside the timed wait, so the cost of restarting workers between
    epochs is counted where a training loop pays it.
    """
    if warmup is None:
        warmup = 2 + getattr(loader, "num_workers", 0)
    it: Iterator = iter(loader)
    t0 = time.perf_counter()
    batch = next(it)
    first = (time.perf_counter() - t0) * 1000
    waits, times = [], []
    for i in range(warmup + steps):
        if i:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                it = iter(loader)
                batch = next(it)
        t1 = time.perf_counter()
        step(batch)
        t2 = time.perf_counter()
        if i >= warmup:
            waits.append((t1 - t0) * 1000)
            times.append((t2 - t0) * 1000)
    del it  # shut non-persistent workers down now, not whenever the garbage collector runs
    bs = batch_size or getattr(loader, "batch_size", None) or len(batch[0])
    return LoaderRun(label, bs, waits, times, first)


@contextlib.contextmanager
def quiet_loader_warnings() -> Iterator[None]:
    """DataLoader's warnings about more workers than cores and pinning without a GPU, silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        warnings.filterwarnings("ignore", message=".*pin_memory.* no accelerator")
        yield


@contextlib.contextmanager
def caught_loader_warnings() -> Iterator[list[str]]:
    """Chapter 07: DataLoader's warnings caught and said in a line each, without torch's file paths.

        with caught_loader_warnings() as said:
            run = measure_loader(DataLoader(dataset, **settings), step)
        for line in said:
            print(line)

    The list fills as the block runs; each warning is said once.
    """
    said: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield said
        finally:
            for w in caught:
                line = _loader_warning(str(w.message), w.category.__name__)
                if line not in said:
                    said.append(line)


def _loader_warning(message: str, category: str) -> str:
    if "pin_memory" in message and "no accelerator" in message:
        return "pin_memory=True: there is no GPU here, so DataLoader pins nothing (it said so in a warning)"
    m = re.search(r"create (\d+) worker processes in total.*?max number of worker in current system is (\d+)", message)
    if m:
        workers, cores = m.groups()
        return f"num_workers={workers}: more workers than the {cores} cores here (DataLoader warns: slow, or frozen)"
    first = message.strip().splitlines()[0] if message.strip() else category
    return f"DataLoader warned ({category}): {first[:64]}"


def sweep(
    make: Callable[[object], Iterable],
    values: Sequence,
    step: Callable[[object], None],
    *,
    label: Callable[[object], str] = str,
    desc: str = "sweep",
    **kw,
) -> list[LoaderRun]:
    """Chapter 07: measure_loader on make(v) for every v in `values`, with a progress bar."""
    with quiet_loader_warnings():
        return [measure_loader(make(v), step, label=label(v), **kw) for v in tqdm(values, desc=desc, leave=False)]


def format_runs(runs: Sequence[LoaderRun]) -> str:
    """Chapter 07: one line per run (at most 100 characters): images/s, step time, wait fraction."""

    def step(r: LoaderRun) -> str:
        lo, hi = r.step.quartiles_ms
        return f"{r.step.median_ms:.1f} ({lo:.1f}-{hi:.1f})"

    columns = [
        ("loader", "label", ""),
        ("images/s", "images_per_s", ",.0f"),
        ("step ms (middle half)", step, ""),
        ("waiting", "wait_fraction", ".0%"),
        ("first batch ms", "first_batch_ms", ".0f"),
    ]
    return table(runs, columns)


def plot_sweep(
    series: dict[str, Sequence[LoaderRun]],
    xs: Sequence[float],
    xlabel: str,
    demand: dict[str, float] | None = None,
    supply: float | None = None,
    cores: int | None = None,
    window: int = 4,
):
    """Chapter 07: throughput and data-wait fraction against a knob, one line per series.

    Points are whole-run values; error bars span the windows of `window` steps (min to max).
    `demand`: each series' consumption rate (images/s its model could take), drawn dashed;
    `supply`, `cores`: one core's pipeline rate, drawn as min(workers, cores) x supply.
    """
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, runs) in enumerate(series.items()):
        for ax, which, scale in ((ax1, 0, 1), (ax2, 1, 100)):
            ys = [(r.images_per_s, r.wait_fraction)[which] * scale for r in runs]
            win = [[v * scale for v in r.windows(window)[which]] or [y] for r, y in zip(runs, ys)]
            err = [[y - min(w) for y, w in zip(ys, win)], [max(w) - y for y, w in zip(ys, win)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=f"C{i}", label=name)
        if demand and name in demand:
            ax1.axhline(demand[name], color=f"C{i}", ls="--", lw=1, label=f"{name}: compute alone")
    if supply:
        ideal = [x for x in xs if x >= 1]
        ax1.plot(
            ideal,
            [min(x, cores or x) * supply for x in ideal],
            color="grey",
            ls=":",
            label=f"workers x one core's rate{f' (at most {cores} cores)' if cores else ''}",
        )
    top = max(
        [
            *(demand or {}).values(),
            *(r.images_per_s for runs in series.values() for r in runs),
            min(max(xs), cores or max(xs)) * (supply or 0),
        ]
    )
    ax1.set(xlabel=xlabel, ylabel="training throughput (images/s)", ylim=(0, 1.7 * top))
    ax2.set(xlabel=xlabel, ylabel="time waiting for data (% of step time)", ylim=(0, 115))
    ax1.legend(fontsize=8, loc="upper left")
    ax2.legend(fontsize=8, loc="upper right")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.set_xticks(list(xs))
    fig.tight_layout()
    return fig


def cpus() -> int:
    """Chapter 07: CPU cores this process may run on (the affinity mask, not the machine's total)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def workers_needed(load_ms: float, step_ms: float, headroom: float = 1.25) -> int:
    """Chapter 07: workers that keep up: each makes one batch per load_ms, the model takes one per step_ms."""
    return max(1, math.ceil(headroom * load_ms / step_ms))
