"""One training loop for fp32, bf16 and fp16: the `enabled=` pattern, not three copies.

Chapter 00 uses it as a black box; chapter 03 (GradScaler) and 04 (accumulation) open it up.

    cfg = TrainConfig(precision="auto", epochs=1, accum_steps=4, clip_grad_norm=1.0)
    history = Trainer(model, torch.optim.AdamW(model.parameters()), cfg).fit(loader)

`amp_step` is its step, written once: the Trainer, chapter 04's accumulation, the DDP worker, the
ladders and the speed-up script all call it. Per optimizer step it does, in this order (the
order matters, see chapter 03):
  for each micro-batch:  autocast(forward + loss) -> scaler.scale(loss / accum).backward()
                         (DDP: no_sync() around forward AND backward of all but the last one)
  scaler.unscale_(opt) -> clip_grad_norm_   (only when clipping: clip true, unscaled gradients)
  scaler.step(opt)     -> scaler.update()   (once per optimizer step, never per micro-batch)
  scheduler.step()     only if the optimizer really stepped (fp16 skips steps on inf/NaN; Trainer)
With precision="fp32" or "bf16" the scaler is built with enabled=False and every scaler call
passes straight through, so the same code runs all three precisions.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from .device import AMP_DTYPES, check_precision, pick_device, recommend_precision

__all__ = ["AMP_DTYPES", "StepResult", "amp_step", "TrainConfig", "History", "Trainer"]


@dataclass
class StepResult:
    """Chapter 04: what one amp_step leaves on the device; nothing here has been read back yet."""

    loss: torch.Tensor  # the step's mean loss (fp32, detached)
    grad_norm: torch.Tensor | None  # pre-clip norm of the unscaled gradients, when clipping
    scale: torch.Tensor | float  # the scale after update(); 1.0 without a scaler
    skipped: torch.Tensor | bool  # the optimizer step was skipped (inf/NaN); False without a scaler


def _scale_on_device(scaler: torch.amp.GradScaler) -> torch.Tensor | float:
    """The loss scale now: a copy of the tensor GradScaler keeps on the device (1.0 when disabled). Not
    `scaler.get_scale()`: that returns a float through `.item()`, a device-to-host copy that waits for
    the GPU, a sync in every step (chapter 06). `_get_scale_async()` is the read GradScaler's own step()
    makes; the copy keeps the value when update() changes that tensor in place."""
    return scaler._get_scale_async().clone() if scaler.is_enabled() else 1.0


def amp_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype | None,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    clip_grad_norm: float | None = None,
) -> StepResult:
    """Chapter 04: the course's AMP step, one optimizer step over `micro_batches` (on the device).

    `dtype` None runs fp32 (autocast off); a disabled scaler passes every call through. `forward(x, y)`
    returns the loss (default: loss_fn(model(x), y)). Each micro-batch's mean loss is weighted by its
    share of the samples, len(y) / total (loss / n when all n have the same size), so that the summed
    gradient is the big batch's even when a short last batch is one of them (chapter 04).
    """
    device = next(model.parameters()).device
    forward = forward or (lambda x, y: loss_fn(model(x), y))
    optimizer.zero_grad(set_to_none=True)  # nothing from before counts
    samples = sum(len(y) for _, y in micro_batches)
    total = torch.zeros((), device=device)  # the step's mean loss, summed on the device: no sync
    is_ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    for i, (x, y) in enumerate(micro_batches):
        share = len(y) / samples
        # DDP all-reduces gradients during backward; skip that on all but the last micro-batch.
        with model.no_sync() if is_ddp and i < len(micro_batches) - 1 else contextlib.nullcontext():
            with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = forward(x, y)  # forward and loss only ...
            scaler.scale(loss * share).backward()  # ... backward outside autocast
        total += loss.detach().float() * share
    grad_norm = None
    if clip_grad_norm is not None:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones; once, at the boundary
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    before = _scale_on_device(scaler)  # compared on the device, read back later: no sync in the step
    scaler.step(optimizer)  # skips optimizer.step() if any gradient is inf/NaN
    scaler.update()  # once per optimizer step: back off or (maybe) grow
    after = _scale_on_device(scaler)
    # update() only lowers the scale after an overflow, and an overflow is exactly a skipped step.
    return StepResult(total, grad_norm, after, after < before)


@dataclass
class TrainConfig:
    """Chapter 00: everything the loop can be told, in one visible place."""

    precision: str = "auto"  # "fp32" | "bf16" | "fp16" | "auto" (course_lib.device.recommend_precision)
    device: str = "auto"  # "auto" | "cuda" | "cpu" | "mps" | "cuda:1" ...
    epochs: int = 1
    max_steps: int | None = None  # stop after this many optimizer steps (skipped ones count)
    accum_steps: int = 1  # micro-batches per optimizer step (chapter 04)
    clip_grad_norm: float | None = None
    init_scale: float = 2.0**16  # GradScaler defaults, exposed for chapter 03
    growth_interval: int = 2000
    channels_last: bool = False  # NHWC memory format for conv nets (chapter 09)
    log_every: int = 10  # read losses back from the device every N steps, not every step
    progress: bool = True  # tqdm progress bar
    checkpoint_path: str | None = None
    checkpoint_every: int | None = None  # optimizer steps between checkpoints (and one at the end)


@dataclass
class History:
    """Chapter 00: what happened at each optimizer step, ready to plot."""

    precision: str = ""
    device: str = ""
    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    scale: list[float] = field(default_factory=list)  # loss scale after update (1.0 without a scaler)
    skipped: list[bool] = field(default_factory=list)  # optimizer step skipped because of inf/NaN
    lr: list[float] = field(default_factory=list)  # learning rate used by this step
    grad_norm: list[float] = field(default_factory=list)  # pre-clip norm of unscaled grads (when clipping)
    eval: list[dict] = field(default_factory=list)  # {"epoch", "step", "loss", "accuracy"}
    seconds: float = 0.0

    @property
    def skipped_steps(self) -> int:
        return sum(self.skipped)

    def summary(self) -> str:
        last = f"{self.loss[-1]:.4f}" if self.loss else "n/a"
        acc = f", eval accuracy {self.eval[-1]['accuracy']:.3f}" if self.eval else ""
        return (
            f"{self.precision} on {self.device}: {len(self.step)} steps in {self.seconds:.1f} s, "
            f"last loss {last}{acc}, skipped {self.skipped_steps}, "
            f"scale {f'{self.scale[-1]:g}' if self.scale else 'n/a'}"
        )  # under 100 characters


def resolve_precision(precision: str, device: torch.device) -> str:
    """Turn 'auto' into recommend_precision's choice (the one policy) and refuse what the device cannot do."""
    if precision == "auto":
        precision = recommend_precision(device).precision
    check_precision(precision, device)
    return precision


class Trainer:
    """Chapter 00: model + optimizer + scaler + scheduler, stepped by one loop for every precision."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: TrainConfig | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    ):
        self.cfg = cfg or TrainConfig()
        self.device = pick_device(self.cfg.device)
        self.precision = resolve_precision(self.cfg.precision, self.device)
        self.amp_dtype = AMP_DTYPES[self.precision]
        fmt = torch.channels_last if self.cfg.channels_last else torch.preserve_format
        self.model = model.to(self.device, memory_format=fmt)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_fn = loss_fn
        # Only fp16 needs loss scaling: bf16 has fp32's exponent range (chapter 01).
        self.scaler = torch.amp.GradScaler(
            self.device.type,
            init_scale=self.cfg.init_scale,
            growth_interval=self.cfg.growth_interval,
            enabled=self.precision == "fp16",
        )
        self.step_count = 0  # optimizer steps attempted so far (skipped ones included)
        self.epoch = 0  # current epoch
        self.batch_in_epoch = 0  # micro-batches of the current epoch already consumed (for resume)
        self._history = History(precision=self.precision, device=str(self.device))
        # (loss, grad_norm, scale, skipped) of steps not yet read back: tensors on the device
        # (scale and skipped: 1.0 and False without a scaler), copied to the host together.
        self._pending: list[tuple] = []

    @property
    def history(self) -> History:
        """Chapter 00: what training recorded so far; reading it copies back what is still on the device."""
        self._flush()
        return self._history

    def autocast(self) -> torch.autocast:
        """Chapter 02: the forward-pass context: autocast on for bf16/fp16, off for fp32."""
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.to(self.device, non_blocking=True)
        if self.cfg.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y.to(self.device, non_blocking=True)

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool | torch.Tensor:
        """One optimizer step over `micro_batches` (amp_step); returns whether it was skipped (False
        without a scaler; with fp16, a one-element tensor on the device: reading it waits for the GPU).
        """
        self.model.train()
        lr = self.optimizer.param_groups[0]["lr"]
        batches = [self._to_device(x, y) for x, y in micro_batches]
        r = amp_step(
            self.model,
            self.optimizer,
            self.scaler,
            batches,
            self.amp_dtype,
            loss_fn=self.loss_fn,
            clip_grad_norm=self.cfg.clip_grad_norm,
        )
        skipped = r.skipped
        if self.scheduler is not None and not bool(skipped):  # with fp16, the one sync this step adds
            self.scheduler.step()  # a skipped step must not advance the schedule (pytorch#44511)
        self.step_count += 1
        self._history.step.append(self.step_count)
        self._history.lr.append(lr)
        self._pending.append((r.loss, r.grad_norm, r.scale, r.skipped))
        if self.step_count % max(1, self.cfg.log_every) == 0:
            self._flush()
        return skipped

    def _flush(self) -> None:
        # One device->host copy per kind of value for many steps, instead of syncs in every step.
        if not self._pending:
            return
        h = self._history
        losses, norms, scales, skipped = zip(*self._pending)
        h.loss += torch.stack(losses).tolist()
        if norms[0] is not None:
            h.grad_norm += torch.stack(norms).float().tolist()
        fp16 = isinstance(scales[0], torch.Tensor)
        h.scale += torch.stack(scales).tolist() if fp16 else list(scales)
        h.skipped += torch.stack(skipped).tolist() if fp16 else list(skipped)
        self._pending.clear()

    @torch.no_grad()
    def evaluate(self, loader: Iterable) -> dict:
        """Mean loss and accuracy over `loader`, under the same autocast as training."""
        self.model.eval()
        loss_sum = torch.zeros((), device=self.device)  # summed on the device, read once at the end
        correct = torch.zeros((), device=self.device)
        count = 0
        for x, y in loader:
            x, y = self._to_device(x, y)
            with self.autocast():
                out = self.model(x)
                loss_sum += self.loss_fn(out, y).float() * len(y)
            correct += (out.argmax(1) == y).sum()
            count += len(y)
        loss = (loss_sum / count).item()
        accuracy = (correct / count).item()
        return {"epoch": self.epoch, "step": self.step_count, "loss": loss, "accuracy": accuracy}

    def fit(self, loader: torch.utils.data.DataLoader, eval_loader: Iterable | None = None) -> History:
        """Chapter 00: train for cfg.epochs (or cfg.max_steps) and return the History.

        With an `eval_loader`, evaluates after each epoch and once more where cfg.max_steps ends
        the run mid-epoch (History.eval records the epoch and step of each evaluation).

        Resumable: after load_checkpoint() it continues at the exact micro-batch it stopped,
        because the sampler's order depends only on (seed, epoch) (see loaders.SeededSampler).
        A last partial accumulation group of an epoch is dropped, like drop_last.
        """
        cfg = self.cfg
        accum = max(1, cfg.accum_steps)
        per_epoch = len(loader) // accum
        total = min(cfg.max_steps or 10**12, cfg.epochs * per_epoch)
        bar = tqdm(
            total=total, initial=self.step_count, disable=not cfg.progress, desc=f"train {self.precision}", unit="step"
        )
        t0 = time.perf_counter()
        while self.epoch < cfg.epochs and self.step_count < total:
            if hasattr(loader.sampler, "set_epoch"):
                loader.sampler.set_epoch(self.epoch)
            batches = itertools.islice(iter(loader), self.batch_in_epoch, None)
            while self.step_count < total:
                group = list(itertools.islice(batches, accum))
                if len(group) < accum:
                    break
                self.train_step(group)
                self.batch_in_epoch += accum
                bar.update(1)
                if self.step_count % max(1, cfg.log_every) == 0 and self.history.loss:
                    bar.set_postfix(loss=f"{self.history.loss[-1]:.3f}", scale=self.history.scale[-1])
                if cfg.checkpoint_path and cfg.checkpoint_every and self.step_count % cfg.checkpoint_every == 0:
                    self.save_checkpoint(cfg.checkpoint_path)
            if eval_loader is not None:  # at the end of each epoch, and where a step budget stops the run
                self.history.eval.append(self.evaluate(eval_loader))
            if len(loader) - self.batch_in_epoch >= accum:
                break  # step budget reached mid-epoch: stay at this micro-batch, resumable
            self.epoch += 1
            self.batch_in_epoch = 0
        self._flush()
        bar.close()
        self.history.seconds += time.perf_counter() - t0
        if cfg.checkpoint_path:
            self.save_checkpoint(cfg.checkpoint_path)
        return self.history

    # -- checkpoints: the scaler's state is part of the training state ------------------------
    def state_dict(self) -> dict:
        self._flush()
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),  # {} when disabled (fp32/bf16)
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "step_count": self.step_count,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "history": asdict(self.history),
            "precision": self.precision,
            "rng": {
                "cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            },
        }

    def load_state_dict(self, state: dict) -> None:
        if state["precision"] != self.precision:
            print(f"note: checkpoint was trained in {state['precision']}, continuing in {self.precision}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state["scaler"] and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])  # an fp32/bf16 checkpoint leaves a fresh scaler
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = state["step_count"]
        self.epoch = state["epoch"]
        self.batch_in_epoch = state["batch_in_epoch"]  # resume at this micro-batch of the epoch
        self._pending.clear()
        self._history = History(**state["history"])
        torch.set_rng_state(state["rng"]["cpu"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Save everything needed to continue bit-identically (written atomically)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)  # a crash mid-write never leaves a truncated checkpoint behind

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by save_checkpoint."""
        self.load_state_dict(torch.load(path, map_location=self.device, weights_only=False))
