"""Any step chapter 10 predicts, measured by PyTorch's own tracker on a CPU.

Built on chapter 02's `tracked_peak` (`MemTracker` under `FakeTensorMode`: GPT-2 small's 12 GiB
step is measured in seconds, nothing allocated). `measured_step` takes the same `Step` as
`predict_step` and builds what it describes: the model (in bf16 for the pure-bf16 recipes), the
batch, the optimizer and its implementation (`MasterWeightsAdamW` for fp32 master weights), a
checkpoint around every GPT block, and the loop (the GPT's logits held, or only its loss; fp16
with a GradScaler). Only CPU steps can be measured here: a GPU run is recorded
(course_lib.chapters.ch10.recorded).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from course_lib.chapters.ch02.step_memory import tracked_peak
from course_lib.chapters.ch10.master_weights import MasterWeightsAdamW
from course_lib.chapters.ch10.predict import Step
from course_lib.models import GPT, MLP, SimpleCNN, resnet50

__all__ = ["measured_step"]

_IMPLEMENTATIONS = {
    "adamw-forloop": {"foreach": False},
    "adamw-foreach": {"foreach": True},
    "adamw-fused": {"fused": True},
}


def _optimizer(step: Step) -> Callable[[nn.Module], torch.optim.Optimizer | None]:
    kind = step.optimizer_kind
    if kind == "none":
        return lambda m: None
    if kind == "sgd":
        return lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
    if kind == "sgd-momentum":
        return lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    adamw = MasterWeightsAdamW if step.precision == "bf16-master" else torch.optim.AdamW
    return lambda m: adamw(m.parameters(), lr=1e-4, **_IMPLEMENTATIONS[kind])


def _built_in(dtype: torch.dtype, make: Callable[[], nn.Module]) -> nn.Module:
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # fake tensors refuse .to(bfloat16): the model is made in it
    try:
        return make()
    finally:
        torch.set_default_dtype(default)


def _gpt_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return model(x, y)  # (logits, loss): the loop keeps the logits until the next step's forward


def _gpt_loss_only(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[None, torch.Tensor]:
    return None, model(x, y)[1]


def measured_step(step: Step) -> dict[str, int]:
    """Chapter 10: MemTracker's peak of `step` on this CPU, in bytes by category ("Total" too)."""
    if step.device != "cpu":
        raise ValueError("MemTracker measures CPU steps here; a GPU step is recorded (chapter 10, section 10)")
    dtype = torch.bfloat16 if step.precision.startswith("bf16-") else torch.float32
    autocast = "fp32" if step.precision.startswith("bf16-") else step.precision
    b = step.batch
    step_loss = None
    if step.model == "gpt":
        c = step.gpt

        def build() -> nn.Module:
            model = _built_in(dtype, lambda: GPT(c))
            if step.checkpointing:
                for block in model.blocks:
                    block.forward = _checkpointed(block.forward)
            return model

        def data() -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randint(0, c.vocab_size, (b, step.seq)), torch.randint(0, c.vocab_size, (b, step.seq))

        step_loss = _gpt_loss if step.logits_held else _gpt_loss_only
    elif step.model == "mlp":
        w = step.width
        build = lambda: _built_in(dtype, lambda: MLP(in_features=w, hidden=w, depth=step.depth))  # noqa: E731
        data = lambda: (torch.randn(b, w, dtype=dtype), torch.randint(0, 10, (b,)))  # noqa: E731
    elif step.model == "simplecnn":
        w, s = step.width or 64, step.size
        build = lambda: _built_in(dtype, lambda: SimpleCNN(in_channels=1, width=w))  # noqa: E731
        data = lambda: (torch.randn(b, 1, s, s, dtype=dtype), torch.randint(0, 10, (b,)))  # noqa: E731
    else:
        s = step.size
        build = lambda: _built_in(dtype, lambda: resnet50(num_classes=1000))  # noqa: E731
        data = lambda: (torch.randn(b, 3, s, s, dtype=dtype), torch.randint(0, 1000, (b,)))  # noqa: E731
    return tracked_peak(build, data, _optimizer(step), autocast, step_loss=step_loss, scaler=step.precision == "fp16")


def _checkpointed(forward: Callable) -> Callable:
    from torch.utils.checkpoint import checkpoint

    def run(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(forward, x, use_reentrant=False)  # keep only the block's input; recompute the rest

    return run
