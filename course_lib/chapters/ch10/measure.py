"""A training step's memory measured by PyTorch's own tracker, for chapter 10's predictions.

`torch.distributed._tools.mem_tracker.MemTracker` counts every tensor a step holds, by category
(parameters, gradients, optimizer state, activations, temporaries). Run under `FakeTensorMode`, the
tensors have shapes and dtypes but no data: nothing is computed or allocated, so GPT-2 small's
12 GiB step is measured on a laptop CPU in seconds. The second step is measured (the first has no
optimizer state yet), with the loop holding what a training loop holds (the GPT's logits).

What fake tensors cannot run: a GradScaler's step (it reads found_inf with .item()), and anything
else that needs a value. CPU autocast's op lists are CPU's, not CUDA's.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.models import GPT, MLP, GPTConfig, SimpleCNN, resnet50

__all__ = ["tracked_peak", "measured_gpt", "measured_mlp", "measured_cnn", "measured_resnet50"]

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def tracked_peak(
    build: Callable[[], nn.Module],
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    step_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[object, torch.Tensor]],
    optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    precision: str = "fp32",
    steps: int = 2,
) -> dict[str, int]:
    """Chapter 10: MemTracker's peak, in bytes by category ("Total" too), of a training step on a CPU
    under FakeTensorMode. `step_loss(model, x, y)` returns (what the loop holds, the loss)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    dtype = _DTYPES[precision]
    with FakeTensorMode():
        model = build()
        opt = optimizer(model)
        x, y = batch()
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            for i in range(steps):
                with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    held, loss = step_loss(model, x, y)  # noqa: F841  (held as a training loop holds it)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i == 0:
                    tracker.reset_mod_stats()
        peak = tracker.get_tracker_snapshot("peak")
    by_kind = next(iter(peak.values()))
    return {getattr(kind, "value", kind): n for kind, n in by_kind.items()}


def _cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[None, torch.Tensor]:
    return None, F.cross_entropy(model(x), y)


def _gpt_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return model(x, y)  # (logits, loss): the loop keeps the logits until the next step


def measured_gpt(
    config: GPTConfig, batch: int, seq: int, precision: str = "fp32", checkpointing: bool = False
) -> dict[str, int]:
    """Chapter 10: the course's GPT, AdamW (foreach), optionally a checkpoint around every block."""

    def build() -> nn.Module:
        model = GPT(config)
        if checkpointing:
            for block in model.blocks:
                block.forward = _checkpointed(block.forward)
        return model

    def data() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, config.vocab_size, (batch, seq)), torch.randint(0, config.vocab_size, (batch, seq))

    def adamw(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    return tracked_peak(build, data, _gpt_loss, adamw, precision)


def measured_mlp(width: int, depth: int, batch: int, precision: str = "fp32") -> dict[str, int]:
    """Chapter 10: the course's MLP (width x depth, 10 classes), plain SGD."""
    return tracked_peak(
        lambda: MLP(in_features=width, hidden=width, depth=depth),
        lambda: (torch.randn(batch, width), torch.randint(0, 10, (batch,))),
        _cross_entropy,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        precision,
    )


def measured_cnn(width: int, batch: int, size: int = 28, precision: str = "fp32") -> dict[str, int]:
    """Chapter 10: the course's SimpleCNN on one-channel images, plain SGD."""
    return tracked_peak(
        lambda: SimpleCNN(in_channels=1, width=width),
        lambda: (torch.randn(batch, 1, size, size), torch.randint(0, 10, (batch,))),
        _cross_entropy,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        precision,
    )


def measured_resnet50(batch: int, size: int = 224, precision: str = "fp32") -> dict[str, int]:
    """Chapter 10: torchvision's ResNet-50 (1,000 classes), SGD with momentum."""
    return tracked_peak(
        lambda: resnet50(num_classes=1000),
        lambda: (torch.randn(batch, 3, size, size), torch.randint(0, 1000, (batch,))),
        _cross_entropy,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        precision,
    )


def _checkpointed(forward: Callable) -> Callable:
    from torch.utils.checkpoint import checkpoint

    def run(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(forward, x, use_reentrant=False)  # keep only the block's input; recompute the rest

    return run
