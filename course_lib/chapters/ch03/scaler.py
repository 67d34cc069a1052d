"""Dynamic loss scaling, written out: what torch.amp.GradScaler does to its scale, bit for bit.

Chapter 03. fp16 cannot hold the smallest gradients (below 2^-24 they become 0), so the loss is
multiplied by a scale S before backward and the gradients by 1/S before the optimizer uses
them. GradScaler picks S dynamically: after an overflow (an inf or NaN gradient) it skips the
optimizer step and multiplies S by `backoff_factor`; after `growth_interval` clean steps in a
row it multiplies S by `growth_factor`. `DynamicLossScaler` is that rule in plain Python,
with the arithmetic of torch's `_amp_update_scale_` kernel (aten/src/ATen/native/cpu/
AmpGradScalerKernels.cpp, cuda/AmpKernels.cu): the scale is a float32, each change is a
float32 times a double, rounded to float32, and growth fires on an *equality* test.

    ref = DynamicLossScaler(init_scale=2.0**16, growth_interval=2000)
    ref.update(found_inf=True)      # 'backoff': the step was skipped, the scale halved
    python -m course_lib.chapters.ch03.scaler --json data/reference/scaler_<gpu>.json   # fp16 run on a GPU
"""

from __future__ import annotations

import argparse
import math
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.data import load_dataset
from course_lib.device import pick_device
from course_lib.models import MLP, SimpleCNN
from course_lib.reference import record

__all__ = [
    "f32",
    "DynamicLossScaler",
    "torch_trajectory",
    "simulate",
    "plot_trajectory",
    "fp16_run",
    "fp16_dynamics",
    "describe_dynamics",
    "plot_dynamics",
]


def f32(x: float) -> float:
    """Chapter 03: `x` rounded to the nearest float32 (ties to even), as a Python float; too large gives ±inf."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]  # C's (float)x; raises only if that is inf
    except OverflowError:
        return math.copysign(math.inf, x)


@dataclass
class DynamicLossScaler:
    """Chapter 03: GradScaler's scale-update rule in plain Python, reproducing torch bit for bit.

    `scale` is always a float32 value (held in a Python float); `growth_tracker` counts the
    clean update() calls since the last backoff or growth.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0
    scale: float = field(init=False)

    def __post_init__(self) -> None:
        self.scale = f32(self.init_scale)  # torch.full((), init_scale, dtype=torch.float32)

    def update(self, found_inf: bool) -> str:
        """Chapter 03: the update() after one step: 'backoff', 'growth', 'capped' or 'count'."""
        if found_inf:  # the step was skipped: back off, restart the count
            self.scale = f32(self.scale * self.backoff_factor)  # float32 x double, rounded to float32
            self.growth_tracker = 0  # (no lower bound: it can reach 0)
            return "backoff"
        successful = self.growth_tracker + 1
        if successful == self.growth_interval:  # equality: a tracker past the interval never grows
            self.growth_tracker = 0
            grown = f32(self.scale * self.growth_factor)
            if math.isfinite(grown):
                self.scale = grown
                return "growth"
            return "capped"  # never grows to inf
        self.growth_tracker = successful
        return "count"

    def inv_scale(self) -> float:
        """Chapter 03: 1/scale as unscale_ uses it: divided in float64, then rounded to float32."""
        return f32(1.0 / self.scale) if self.scale != 0 else math.inf

    def unscale_(self, grads: Iterable[torch.Tensor]) -> bool:
        """Chapter 03: multiply float32 gradients by inv_scale() in place; True if any was inf or NaN *before*."""
        inv = self.inv_scale()
        found_inf = False
        with torch.no_grad():
            for g in grads:
                found_inf |= not bool(torch.isfinite(g).all())
                if inv != 1.0:
                    g.mul_(inv)
        return found_inf

    def state_dict(self) -> dict:
        """Chapter 03: the same five entries as torch.amp.GradScaler.state_dict()."""
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self.growth_tracker,
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> "DynamicLossScaler":
        """A scaler continuing from a GradScaler's (or our) state_dict()."""
        return cls(
            state["scale"],
            state["growth_factor"],
            state["backoff_factor"],
            state["growth_interval"],
            state["_growth_tracker"],
        )


def torch_trajectory(
    found_infs: Sequence[bool],
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    growth_tracker: int = 0,
) -> list[tuple[float, int]]:
    """Chapter 03: (scale, growth tracker) after each update() of a real torch.amp.GradScaler("cpu").

    A one-parameter model gets an inf gradient where `found_infs` says so and 1.0 elsewhere;
    the scaler runs its public loop: scale, step, update. `growth_tracker` starts the tracker
    where a loaded state_dict would.
    """
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )
    if growth_tracker:
        scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": growth_tracker})
    out = []
    for inf in found_infs:
        scaler.scale(p.sum())  # creates the scale tensor on the first call, as in a training loop
        p.grad = torch.full((1,), math.inf if inf else 1.0)
        scaler.step(opt)
        scaler.update()
        state = scaler.state_dict()
        out.append((state["scale"], state["_growth_tracker"]))
    return out


@dataclass
class Trajectory:
    """What a dynamic loss scaler did at each step of a run (returned by simulate)."""

    scale: list[float]  # the scale the step used (before its update)
    skipped: list[bool]  # the step found inf/NaN and was skipped
    event: list[str]  # what update() did: backoff, growth, capped, count
    after: list[float]  # the scale after update()
    tracker: list[int]  # the growth tracker after update()

    def summary(self) -> str:
        grown, every = self.event.count("growth"), self.scale + self.after
        return (
            f"{len(self.scale)} steps: {sum(self.skipped)} skipped, {grown} growths; scale from "
            f"{self.scale[0]:g} to {self.after[-1]:g} (range {min(every):g} .. {max(every):g})"
        )


def simulate(
    overflow: Sequence[bool] | Callable[[int, float], bool], steps: int | None = None, **scaler_args
) -> Trajectory:
    """Chapter 03: run DynamicLossScaler over `steps` steps.

    `overflow` is a list of booleans (step i found inf/NaN) or a function (step, scale) -> bool,
    e.g. `lambda i, s: s * 2**-6 > 65504` for gradients whose largest value is 2^-6.
    """
    steps = len(overflow) if steps is None else steps  # type: ignore[arg-type]
    ref = DynamicLossScaler(**scaler_args)
    t = Trajectory([], [], [], [], [])
    for i in range(steps):
        inf = bool(overflow(i, ref.scale) if callable(overflow) else overflow[i])
        t.scale.append(ref.scale)
        t.skipped.append(inf)
        t.event.append(ref.update(inf))
        t.after.append(ref.scale)
        t.tracker.append(ref.growth_tracker)
    return t


def plot_trajectory(
    ax,
    scale: Sequence[float],
    skipped: Sequence[bool],
    label: str = "loss scale",
    color: str = "C0",
    steps: Sequence[int] | None = None,
) -> None:
    """Chapter 03: the scale each step used (a step line, log2 axis), its skipped steps marked × in its colour."""
    steps = list(range(1, len(scale) + 1)) if steps is None else list(steps)
    ax.step(steps, scale, where="post", color=color, label=label)
    bad = [(s, v) for s, v, k in zip(steps, scale, skipped) if k]
    if bad:
        ax.plot(*zip(*bad), "x", color=color, ms=6, mew=1.5, label=f"{label}: skipped steps ({len(bad)})")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale (log2 axis)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)


# --------------------------------------------------------------------------- a real fp16 run (GPU reference)


def fp16_run(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]] | Callable[[int], tuple],
    steps: int,
    loss_factor: float = 1.0,
    init_scale: float = 2.0**16,
    growth_interval: int = 2000,
    clip: float | None = None,
) -> dict[str, list]:
    """Chapter 03: `steps` plain fp16 steps (autocast, GradScaler, unscale_, optional clip, step, update).

    `batches`: a list (cycled) or a function step -> (x, y); the loss is `loss_factor` x cross
    entropy. Per step: the scale used, skipped or not, the norm of the unscaled gradient before
    clipping, how far the parameters moved (L2 norm), and the loss.
    """
    dev = next(model.parameters()).device
    scaler = torch.amp.GradScaler(dev.type, init_scale=init_scale, growth_interval=growth_interval)
    out: dict[str, list] = {"scale": [], "skipped": [], "grad_norm": [], "moved": [], "loss": []}
    params = [p for p in model.parameters() if p.requires_grad]
    for i in range(steps):
        x, y = batches(i) if callable(batches) else batches[i % len(batches)]
        with torch.autocast(dev.type, dtype=torch.float16):
            loss = loss_factor * F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        before = [p.detach().clone() for p in params]
        used = scaler.get_scale()  # a host sync per step: fine for a demonstration
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else math.inf)
        scaler.step(optimizer)
        scaler.update()
        moved = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.detach() - b) for p, b in zip(params, before)])
        )
        out["scale"].append(used)
        out["skipped"].append(scaler.get_scale() < used)  # update() lowers the scale exactly after an overflow
        out["grad_norm"].append(norm.item())
        out["moved"].append(moved.item())
        out["loss"].append(loss.item())
    return out


def fp16_dynamics(
    device: str | None = None,
    model: str = "simplecnn",
    steps: int = 2000,
    batch_size: int = 128,
    init_scale: float = 2.0**16,
    growth_interval: int = 50,
    lr: float = 1e-3,
    seed: int = 0,
) -> dict:
    """Chapter 03: fp16_run on Fashion-MNIST (AdamW, random batches) with a short growth interval, then the
    skip pattern replayed through DynamicLossScaler: does it reproduce every scale bit for bit? Sized for a GPU."""
    dev = pick_device(device or "auto")
    torch.manual_seed(seed)
    data = load_dataset(verbose=False).train
    xs, ys = data.tensors[0].to(dev), data.tensors[1].to(dev)
    net = (SimpleCNN() if model == "simplecnn" else MLP()).to(dev)
    g = torch.Generator().manual_seed(seed)
    order = [torch.randint(0, len(ys), (batch_size,), generator=g).to(dev) for _ in range(steps)]
    t0 = time.perf_counter()
    run = fp16_run(
        net,
        torch.optim.AdamW(net.parameters(), lr=lr),
        lambda i: (xs[order[i]], ys[order[i]]),
        steps,
        init_scale=init_scale,
        growth_interval=growth_interval,
    )
    seconds = time.perf_counter() - t0
    replay = simulate(run["skipped"], init_scale=init_scale, growth_interval=growth_interval)
    return {
        "model": model,
        "device": str(dev),
        "steps": steps,
        "batch_size": batch_size,
        "init_scale": init_scale,
        "growth_interval": growth_interval,
        "scale": run["scale"],
        "skipped": run["skipped"],
        "loss": run["loss"],
        "seconds": seconds,
        "replay_identical": replay.scale == run["scale"],
    }


def describe_dynamics(run: dict) -> str:
    """Chapter 03: a recorded fp16_dynamics() run in a few lines."""
    n, skipped, scale = run["steps"], run["skipped"], run["scale"]
    first = [i + 1 for i, k in enumerate(skipped) if k][:8]
    loss = run["loss"]
    head, tail = np.mean(loss[: max(1, n // 20)]), np.mean(loss[-max(1, n // 20) :])
    return "\n".join(
        [
            f"{run['model']} on {run['device']}, fp16 autocast + GradScaler(init_scale={run['init_scale']:g}, "
            f"growth_interval={run['growth_interval']}), batch {run['batch_size']}",
            f"{n} steps in {run['seconds']:.1f} s: {sum(skipped)} skipped ({100 * sum(skipped) / n:.1f}%), "
            f"first at steps {first}",
            f"scale: first {scale[0]:g}, largest {max(scale):g} (2^{math.log2(max(scale)):.0f}), last {scale[-1]:g}",
            f"loss: mean of the first 5% of steps {head:.3f}, of the last 5% {tail:.3f}",
            "DynamicLossScaler replaying the skip pattern reproduces every scale bit for bit: "
            f"{run['replay_identical']}",
        ]
    )


def plot_dynamics(run: dict, ax=None):
    """Chapter 03: the scale trajectory of an fp16_dynamics() run, skipped steps marked."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.5))
    plot_trajectory(ax, run["scale"], run["skipped"], label=f"GradScaler scale, {run['model']} on {run['device']}")
    ax.set_title(
        f"fp16 training: the scale climbs every {run['growth_interval']} clean steps and backs off at each overflow"
    )
    return ax


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m course_lib.chapters.ch03.scaler",
        description="fp16 training with GradScaler: the scale and skipped steps at every step",
    )
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--model", default="simplecnn", choices=["simplecnn", "mlp"])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--growth-interval", type=int, default=50)
    p.add_argument("--json", help="also write the run with provenance (data/reference/scaler_<gpu>.json)")
    args = p.parse_args(argv)
    run = fp16_dynamics(args.device, args.model, args.steps, args.batch, growth_interval=args.growth_interval)
    command = "python -m course_lib.chapters.ch03.scaler " + " ".join(argv if argv is not None else sys.argv[1:])
    record(command, describe_dynamics(run), args.json, **run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
