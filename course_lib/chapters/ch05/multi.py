"""Several models, losses and optimizers under one GradScaler: the loops of chapter 05.

The rules, from PyTorch's AMP examples page ("Working with Multiple Models, Losses, and
Optimizers", "Gradient penalty"), each followed by a loop below or, for the article's two models,
in article_two_models.py:
  - one GradScaler serves every model, loss and optimizer of the iteration;
  - `scaler.scale(loss)` for every loss you call backward on;
  - `scaler.unscale_(opt)` only for the optimizers whose gradients you read or change
    (clipping), once per iteration;
  - `scaler.step(opt)` for every optimizer: each one skips on its own if *its* gradients
    hold inf/NaN;
  - `scaler.update()` once per iteration, after the last `scaler.step`;
  - gradients taken with `torch.autograd.grad` belong to no optimizer: unscale them by hand.

    mode = amp_mode("cpu")   # fp16 + GradScaler("cpu") where this torch can, else bf16 alone
    python -m course_lib.chapters.ch05.multi --json data/reference/multi_<gpu>.json
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from course_lib.reference import record
from course_lib.tables import table
from course_lib.timing import Timing, time_fn

__all__ = [
    "AmpMode",
    "amp_mode",
    "skipped",
    "Generator",
    "Discriminator",
    "gan_images",
    "gan_step",
    "GanHistory",
    "train_gan",
    "gan_iterations",
    "image_grid",
    "penalty_backward",
    "penalty_reference",
    "format_gan_reference",
]


# --------------------------------------------------------------------------- which precision


@dataclass(frozen=True)
class AmpMode:
    """Chapter 05: the autocast dtype of a device and whether the GradScaler is on."""

    device_type: str
    dtype: torch.dtype
    scaler: bool
    why: str

    def autocast(self) -> torch.autocast:
        """The forward's region: autocast to `dtype`, or switched off when `dtype` is fp32."""
        low = self.dtype in (torch.float16, torch.bfloat16)
        return torch.autocast(self.device_type, dtype=self.dtype if low else None, enabled=low)

    def make_scaler(self, **kwargs) -> torch.amp.GradScaler:
        """A GradScaler for this device, switched off (every call passes through) without fp16."""
        return torch.amp.GradScaler(self.device_type, enabled=self.scaler, **kwargs)

    @property
    def name(self) -> str:
        names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
        return names[self.dtype] + (" + GradScaler" if self.scaler else "")


@functools.cache
def cpu_fp16_scaler_works() -> bool:
    """Does this torch run fp16 autocast on the CPU, with torch.amp.GradScaler("cpu")? (Tried, not assumed.)"""
    try:
        layer = nn.Linear(4, 4)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.float16):
            out = layer(torch.ones(2, 4))
        scaler.scale(out.float().sum()).backward()
        scaler.step(opt)
        scaler.update()
        return out.dtype == torch.float16 and scaler.is_enabled()
    except Exception:  # an older torch or platform without CPU fp16 kernels
        return False


def amp_mode(device: str | torch.device = "cpu") -> AmpMode:
    """Chapter 05: fp16 + GradScaler wherever this torch supports it, so the scaler's rules can be seen.

    CUDA: always (every CUDA GPU runs fp16). CPU: if `cpu_fp16_scaler_works()`; otherwise bf16,
    which needs no scaler (chapter 01), and the scaler calls pass straight through.
    """
    dev = torch.device(device).type
    if dev == "cuda" or (dev == "cpu" and cpu_fp16_scaler_works()):
        return AmpMode(dev, torch.float16, True, f"fp16 autocast and torch.amp.GradScaler({dev!r}) work here")
    return AmpMode(
        dev,
        torch.bfloat16,
        False,
        f"this torch has no fp16 autocast + GradScaler on {dev}: bf16, which needs no scaler",
    )


# --------------------------------------------------------------------------- did an optimizer skip?


def skipped(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Chapter 05: did `scaler.step(optimizer)` just skip this optimizer's step?

    Call it after scaler.step: step unscales the gradients in place, and it skips exactly when
    they hold an inf or a NaN. (A disabled scaler never skips.)
    """
    return scaler.is_enabled() and any(
        p.grad is not None and not torch.isfinite(p.grad).all() for g in optimizer.param_groups for p in g["params"]
    )


# --------------------------------------------------------------------------- a GAN: alternating updates


class Generator(nn.Module):
    """Chapter 05: noise (z_dim) -> a 28x28 image in [-1, 1]; a two-layer MLP."""

    def __init__(self, z_dim: int = 32, hidden: int = 128):
        super().__init__()
        self.z_dim = z_dim
        self.net = nn.Sequential(nn.Linear(z_dim, hidden), nn.ReLU(), nn.Linear(hidden, 784), nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z).view(-1, 1, 28, 28)


class Discriminator(nn.Module):
    """Chapter 05: a 28x28 image -> one logit ("real" when positive); no sigmoid: BCEWithLogits (ch. 02)."""

    def __init__(self, hidden: int = 128):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)


def gan_images(train: torch.utils.data.TensorDataset, mean: float, std: float) -> torch.Tensor:
    """Chapter 05: the training images un-normalised and mapped to [-1, 1], the range of the generator's tanh."""
    return (train.tensors[0] * std + mean) * 2 - 1


def gan_step(
    gen: Generator,
    disc: Discriminator,
    opt_g: torch.optim.Optimizer,
    opt_d: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    real: torch.Tensor,
    z: torch.Tensor,
    mode: AmpMode,
) -> dict:
    """Chapter 05: one GAN iteration: a discriminator step, then a generator step, one scaler.

    Each loss is scaled and each optimizer stepped through the scaler; update() comes once,
    at the end. Returns both losses and whether each optimizer skipped.
    """
    ones = torch.ones(len(real), device=real.device)
    zeros = torch.zeros(len(real), device=real.device)
    # 1. discriminator: real images -> 1, generated ones -> 0 (detached: G is not trained here)
    opt_d.zero_grad(set_to_none=True)
    with mode.autocast():
        fake = gen(z)
        d_loss = (
            F.binary_cross_entropy_with_logits(disc(real), ones)  # real images -> 1
            + F.binary_cross_entropy_with_logits(disc(fake.detach()), zeros)  # generated -> 0
        )
    scaler.scale(d_loss).backward()
    scaler.step(opt_d)
    d_skipped = skipped(scaler, opt_d)
    # 2. generator: make the (just updated) discriminator say 1. This backward also fills the
    # discriminator's .grad; opt_d.zero_grad() clears that at the start of the next iteration.
    opt_g.zero_grad(set_to_none=True)
    with mode.autocast():
        g_loss = F.binary_cross_entropy_with_logits(disc(fake), ones)
    scaler.scale(g_loss).backward()
    scaler.step(opt_g)
    g_skipped = skipped(scaler, opt_g)
    scaler.update()  # once: both optimizers of this iteration used the same scale
    return {
        "d_loss": d_loss.item(),
        "g_loss": g_loss.item(),
        "d_skipped": d_skipped,
        "g_skipped": g_skipped,
    }


@dataclass
class GanHistory:
    """Chapter 05: what happened at each GAN iteration, ready to plot."""

    mode: str = ""
    d_loss: list[float] = field(default_factory=list)
    g_loss: list[float] = field(default_factory=list)
    scale: list[float] = field(default_factory=list)  # the scale each iteration used
    d_skipped: list[bool] = field(default_factory=list)
    g_skipped: list[bool] = field(default_factory=list)
    seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)  # each iteration's wall time


def train_gan(
    images: torch.Tensor,
    mode: AmpMode,
    steps: int = 300,
    batch_size: int = 64,
    seed: int = 0,
    lr: float = 1e-3,
    growth_interval: int = 2000,
    progress: bool = False,
) -> tuple[Generator, Discriminator, GanHistory]:
    """Chapter 05: train the MLP GAN for `steps` iterations on `images` (N, 1, 28, 28) in [-1, 1].

    Adam with beta1 = 0.5, as in the DCGAN paper; the models live on images.device. A short
    `growth_interval` lets a short run show the scaler growing the scale and backing off.
    `progress`: a bar while it trains (closed at the end, as chapter 07's sweeps are).
    """
    device = images.device
    with torch.random.fork_rng(devices=[]):  # seeded models, the global random state left alone
        torch.manual_seed(seed)
        gen, disc = Generator().to(device), Discriminator().to(device)
    opt_g = torch.optim.Adam(gen.parameters(), lr=lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=lr, betas=(0.5, 0.999))
    scaler = mode.make_scaler(growth_interval=growth_interval)
    hist = GanHistory(mode=mode.name)
    g = torch.Generator().manual_seed(seed)
    t0 = last = time.perf_counter()
    for _ in tqdm(range(steps), desc=f"GAN {mode.name}", leave=False, disable=not progress):
        idx = torch.randint(0, len(images), (batch_size,), generator=g).to(device)
        z = torch.randn(batch_size, gen.z_dim, generator=g).to(device)
        hist.scale.append(scaler.get_scale() if scaler.is_enabled() else 1.0)
        r = gan_step(gen, disc, opt_g, opt_d, scaler, images[idx], z, mode)
        for key in ("d_loss", "g_loss", "d_skipped", "g_skipped"):
            getattr(hist, key).append(r[key])
        now = time.perf_counter()
        hist.step_seconds.append(now - last)
        last = now
    hist.seconds = time.perf_counter() - t0
    return gen, disc, hist


def steps_within(budget_s: float, seconds_per_step: float, lo: int = 100, hi: int = 2000, multiple: int = 100) -> int:
    """How many steps of `seconds_per_step` fit in `budget_s`, rounded down to a multiple
    of `multiple` and kept within [lo, hi]: a live run sized by what this machine measured."""
    fit = int(budget_s / max(seconds_per_step, 1e-9)) // multiple * multiple
    return max(lo, min(hi, fit))


def gan_iterations(
    images: torch.Tensor,
    mode: AmpMode,
    budget_s: float,
    lo: int = 100,
    hi: int = 2000,
    batch_size: int = 64,
    warmup: int = 5,
    probe: int = 20,
) -> tuple[int, float]:
    """Chapter 05: (iterations, seconds per iteration): how many GAN iterations fit in `budget_s` here,
    rounded down to a multiple of 100 and kept within [lo, hi] (steps_within).

    Runs `warmup` + `probe` iterations and takes the median time of the last `probe`: the first ones
    pay for setting up kernels, libraries and the optimizers' state, and one iteration on a shared
    machine can catch a neighbour's burst, which the median ignores. The GAN's time per iteration
    depends on the host (it is launch- and sync-bound on a GPU, and CPU fp16 kernels are fast only on
    some CPUs), not on a rule.
    """
    times = sorted(train_gan(images, mode, steps=warmup + probe, batch_size=batch_size)[2].step_seconds[warmup:])
    per = times[len(times) // 2]
    return steps_within(budget_s, per, lo, hi), per


def image_grid(images: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Chapter 05: the first rows x cols images (N, 1, H, W) tiled into one (rows*H, cols*W) picture."""
    h, w = images.shape[-2:]
    tiles = images[: rows * cols, 0].detach().float().cpu()
    return tiles.view(rows, cols, h, w).permute(0, 2, 1, 3).reshape(rows * h, cols * w)


# --------------------------------------------------------------------------- gradient penalty


def penalty_backward(
    model: nn.Module,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
    mode: AmpMode,
    weight: float = 0.1,
    unscale: bool = True,
) -> dict:
    """Chapter 05: loss + weight * ||d loss / d parameters||, as the AMP examples page does it.

    Leaves the scaled gradient of the total in .grad, ready for unscale_ / step / update.
    `unscale=False` forgets the manual unscaling, to show what that costs.
    """
    with mode.autocast():
        loss = F.cross_entropy(model(x), y)
    params = [p for p in model.parameters() if p.requires_grad]
    # autograd.grad of the *scaled* loss (outside autocast, like backward): scaled gradients,
    # protected from underflow; create_graph=True so the penalty can be differentiated.
    scaled_grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
    # They belong to no optimizer, so scaler.unscale_ cannot reach them: unscale by hand.
    inv_scale = 1.0 / scaler.get_scale() if unscale else 1.0
    grads = [g * inv_scale for g in scaled_grads]
    with mode.autocast():  # as the examples page does; the gradients are fp32 either way
        penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        total = loss + weight * penalty
    scaler.scale(total).backward()
    return {"loss": loss.item(), "penalty": penalty.item(), "penalty_dtype": penalty.dtype}


def penalty_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, weight: float = 0.1) -> dict:
    """Chapter 05: the same loss + penalty in fp32, no autocast, no scaler: the gradients to compare with."""
    params = [p for p in model.parameters() if p.requires_grad]
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
    total_grads = torch.autograd.grad(loss + weight * penalty, params)
    return {"loss": loss.item(), "penalty": penalty.item(), "grads": [g.detach() for g in total_grads]}


# --------------------------------------------------------------------------- GPU reference (CLI)


def _gan_timing(images: torch.Tensor, mode: AmpMode, batch_size: int, iters: int) -> Timing:
    # One GAN iteration (after warm-up), timed.
    torch.manual_seed(0)
    dev = images.device
    gen, disc = Generator().to(dev), Discriminator().to(dev)
    opt_g, opt_d = (torch.optim.Adam(m.parameters(), lr=1e-3, betas=(0.5, 0.999)) for m in (gen, disc))
    scaler = mode.make_scaler()
    real, z = images[:batch_size], torch.randn(batch_size, gen.z_dim, device=dev)
    return time_fn(lambda: gan_step(gen, disc, opt_g, opt_d, scaler, real, z, mode), warmup=5, iters=iters, device=dev)


def format_gan_reference(ref: dict) -> str:
    """Chapter 05: the recorded GPU results (GAN per mode: skipped steps, final scale, time per iteration)."""

    def per_iteration(r: dict) -> str:
        t = Timing(r["times_ms"])
        lo, hi = t.quartiles_ms
        return f"{t.median_ms:.2f} ({lo:.2f}-{hi:.2f})"

    columns = [
        ("mode", "mode", ""),
        ("D skipped", "d_skipped", ""),
        ("G skipped", "g_skipped", ""),
        ("final scale", "final_scale", "g"),
        ("ms / iteration (middle half)", per_iteration, ""),
    ]
    return table(ref["rows"], columns)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m course_lib.chapters.ch05.multi",
        description="chapter 05's GAN in fp32, bf16 and fp16 + GradScaler: skips and speed",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=2000, help="GAN iterations per mode (skipped steps counted)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--json", help="also write the rows with provenance (data/reference/multi_<gpu>.json)")
    args = p.parse_args(argv)
    from course_lib.data import load_dataset

    bundle = load_dataset(verbose=False)
    images = gan_images(bundle.train, bundle.mean[0], bundle.std[0]).to(args.device)
    dev = torch.device(args.device).type
    modes = [
        AmpMode(dev, torch.float32, False, "autocast off"),
        AmpMode(dev, torch.bfloat16, False, "bf16"),
        amp_mode(args.device),
    ]
    rows = []
    for mode in modes:
        _, _, hist = train_gan(images, mode, steps=args.steps, batch_size=args.batch)
        timing = _gan_timing(images, mode, args.batch, iters=30)
        rows.append(
            {
                "mode": mode.name,
                "d_skipped": sum(hist.d_skipped),
                "g_skipped": sum(hist.g_skipped),
                "final_scale": hist.scale[-1],
                "d_loss_last": hist.d_loss[-1],
                "g_loss_last": hist.g_loss[-1],
                "d_skipped_at": [i + 1 for i, s in enumerate(hist.d_skipped) if s],
                "g_skipped_at": [i + 1 for i, s in enumerate(hist.g_skipped) if s],
                "scale_range": [min(hist.scale), max(hist.scale)],
                "times_ms": timing.times_ms,
            }
        )
    command = "python -m course_lib.chapters.ch05.multi " + " ".join(argv if argv is not None else sys.argv[1:])
    record(command, format_gan_reference({"rows": rows}), args.json, rows=rows, steps=args.steps, batch=args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
