"""The article's two models, two losses and two optimizers under one GradScaler: chapter 05's first loops.

Chapter 05 introduces them (its sections 1 to 4): the popular article's two-model, two-loss example
done right (`two_model_step`), each optimizer skipping on its own (`independent_skips`), and two
backward passes with retain_graph against one backward of the sum (`retain_vs_sum`). The precision
(`amp_mode`) and the skip test (`skipped`) are multi.py's, as are the GAN and the gradient penalty.

    mode = amp_mode("cpu")   # course_lib.chapters.ch05.multi: fp16 + GradScaler("cpu") where this torch can
    model0, model1 = two_models(0)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.chapters.ch05.multi import AmpMode, skipped
from course_lib.timing import time_fn

__all__ = ["two_models", "two_model_step", "independent_skips", "retain_vs_sum"]


def two_models(
    seed: int = 0, features: int = 16, hidden: int = 32, out: int = 4, device: str | torch.device = "cpu"
) -> tuple[nn.Module, nn.Module]:
    """Chapter 05: model0 and model1 of the article's example: two small MLPs, initialised from `seed`
    (the global random state is left as it was)."""

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, out))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make().to(device), make().to(device)


def two_model_step(
    model0: nn.Module,
    model1: nn.Module,
    opt0: torch.optim.Optimizer,
    opt1: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
    mode: AmpMode,
    max_norm: float | None = None,
) -> dict:
    """Chapter 05: one iteration of the article's two-model, two-loss example, done right.

    Returns the two losses, the scale this iteration used and whether each optimizer skipped.
    """
    opt0.zero_grad(set_to_none=True)
    opt1.zero_grad(set_to_none=True)
    with mode.autocast():  # forward and losses only
        out0, out1 = model0(x), model1(x)
        loss0 = F.mse_loss(2 * out0 + 3 * out1, y)
        loss1 = F.mse_loss(3 * out0 - 5 * out1, y)
    # Both losses reach model0 and model1 through out0 and out1: the first backward must keep
    # that shared graph for the second (retain_graph has nothing to do with AMP).
    scaler.scale(loss0).backward(retain_graph=True)
    scaler.scale(loss1).backward()
    if max_norm is not None:  # we clip model0 only, so only opt0 needs its true gradients now
        scaler.unscale_(opt0)
        nn.utils.clip_grad_norm_(model0.parameters(), max_norm)
    scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    scaler.step(opt0)  # unscales opt0's gradients (unless done above), steps if they are finite
    scaler.step(opt1)  # the same for opt1, independently
    skips = [skipped(scaler, opt0), skipped(scaler, opt1)]
    scaler.update()  # once per iteration, after every optimizer has stepped
    return {"loss0": loss0.item(), "loss1": loss1.item(), "scale": scale, "skipped": skips}


def independent_skips(mode: AmpMode, iterations: int = 8, target_scale: float = 300.0, seed: int = 0) -> list[dict]:
    """Chapter 05: two models with their own losses and one scaler; model1's targets are `target_scale`
    times larger, so its fp16 gradients overflow at a scale where model0's do not.

    One row per iteration: the scale used, whether opt0 / opt1 skipped, the scale after update().
    """
    model0, model1 = two_models(seed)
    opt0, opt1 = (torch.optim.SGD(m.parameters(), lr=1e-3) for m in (model0, model1))
    scaler = mode.make_scaler()
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
    rows = []
    for i in range(iterations):
        opt0.zero_grad(set_to_none=True)
        opt1.zero_grad(set_to_none=True)
        with mode.autocast():
            loss0, loss1 = F.mse_loss(model0(x), y), F.mse_loss(model1(x), target_scale * y)
        used = scaler.get_scale() if scaler.is_enabled() else 1.0
        scaler.scale(loss0).backward()
        scaler.scale(loss1).backward()
        scaler.step(opt0)
        scaler.step(opt1)
        skips = skipped(scaler, opt0), skipped(scaler, opt1)
        scaler.update()
        rows.append(
            {
                "iteration": i + 1,
                "scale": used,
                "opt0_skipped": skips[0],
                "opt1_skipped": skips[1],
                "scale_after": scaler.get_scale() if scaler.is_enabled() else 1.0,
            }
        )
    return rows


def retain_vs_sum(
    mode: AmpMode, batch: int = 128, seed: int = 0, iters: int = 15, device: str | torch.device = "cpu"
) -> dict:
    """Chapter 05: two backward passes with retain_graph=True against one backward of loss0 + loss1.

    Returns the largest relative difference of the gradients (they are the same sum, rounded
    in a different order) and the timing of one iteration each way.
    """
    model0, model1 = two_models(seed, features=128, hidden=256, out=32, device=device)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(batch, 128, generator=g).to(device), torch.randn(batch, 32, generator=g).to(device)
    params = [*model0.parameters(), *model1.parameters()]

    def iteration(summed: bool) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        with mode.autocast():
            out0, out1 = model0(x), model1(x)
            loss0 = F.mse_loss(2 * out0 + 3 * out1, y)
            loss1 = F.mse_loss(3 * out0 - 5 * out1, y)
        if summed:
            (loss0 + loss1).backward()
        else:
            loss0.backward(retain_graph=True)
            loss1.backward()
        return [p.grad.clone() for p in params]

    two, one = iteration(False), iteration(True)
    diff = max(((a - b).norm() / b.norm()).item() for a, b in zip(two, one))
    timings = {
        "two backward (retain_graph)": time_fn(lambda: iteration(False), warmup=3, iters=iters, device=device),
        "one backward of the sum": time_fn(lambda: iteration(True), warmup=3, iters=iters, device=device),
    }
    return {"max_rel_diff": diff, "timings": timings}
