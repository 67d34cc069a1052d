"""GPT-2 small's and ResNet-50's training steps measured by PyTorch's own tracker, for chapter 10.

Built on chapter 02's `tracked_peak` (`MemTracker` under `FakeTensorMode`, on a CPU: GPT-2 small's
12 GiB step is measured in seconds, nothing allocated). The loop holds what a training loop holds
(the GPT's logits). The fp16 recipe with a GradScaler needs real values (the scaler reads found_inf
with .item()), so it is measured on real tensors: small configurations only.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from course_lib.chapters.ch02.step_memory import tracked_peak
from course_lib.chapters.ch10.master_weights import MasterWeightsAdamW
from course_lib.models import GPT, GPTConfig, resnet50

__all__ = ["measured_gpt", "measured_resnet50"]


def _gpt_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return model(x, y)  # (logits, loss): the loop keeps the logits until the next step


def measured_gpt(
    config: GPTConfig,
    batch: int,
    seq: int,
    precision: str = "fp32",
    checkpointing: bool = False,
    scaler: bool = False,
) -> dict[str, int]:
    """Chapter 10: the course's GPT, AdamW (foreach), optionally a checkpoint around every block.
    `precision` as in memory_model.gpt_step_tensors ("bf16-pure": the model in bf16 and AdamW on it;
    "bf16-master": MasterWeightsAdamW). `scaler`: the fp16 recipe's GradScaler, run on real tensors
    (keep the configuration small)."""
    pure = precision.startswith("bf16-")

    def build() -> nn.Module:
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16 if pure else default)  # fake tensors refuse .to(bfloat16)
        try:
            model = GPT(config)
        finally:
            torch.set_default_dtype(default)
        if checkpointing:
            for block in model.blocks:
                block.forward = _checkpointed(block.forward)
        return model

    def data() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, config.vocab_size, (batch, seq)), torch.randint(0, config.vocab_size, (batch, seq))

    def adamw(model: nn.Module) -> torch.optim.Optimizer:
        kind = MasterWeightsAdamW if precision == "bf16-master" else torch.optim.AdamW
        return kind(model.parameters(), lr=1e-4, foreach=True)

    autocast = "fp32" if pure else precision  # a bf16 model runs without autocast
    return tracked_peak(build, data, adamw, autocast, step_loss=_gpt_loss, scaler=scaler, fake=not scaler)


def measured_resnet50(batch: int, size: int = 224, precision: str = "fp32") -> dict[str, int]:
    """Chapter 10: torchvision's ResNet-50 (1,000 classes), SGD with momentum."""
    return tracked_peak(
        lambda: resnet50(num_classes=1000),
        lambda: (torch.randn(batch, 3, size, size), torch.randint(0, 1000, (batch,))),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        precision,
    )


def _checkpointed(forward: Callable) -> Callable:
    from torch.utils.checkpoint import checkpoint

    def run(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(forward, x, use_reentrant=False)  # keep only the block's input; recompute the rest

    return run
