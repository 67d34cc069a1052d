"""A training step's memory, walked through backward and measured: SimpleCNN (chapters 04 and 10).

Chapter 04 says that accumulation's memory follows the micro-batch, not the effective batch; this
module predicts the whole step's bytes for any micro-batch from what each layer of the course's
SimpleCNN saves (`cnn_moments`, built like chapter 02's `mlp_moments`), and measures the same step
with PyTorch's own tracker (`measured_cnn`, chapter 02's `tracked_peak`). Chapter 10 puts it in its
table beside the MLP, GPT-2 small and ResNet-50.
"""

from __future__ import annotations

import torch

from course_lib.chapters.ch02.step_memory import tracked_peak
from course_lib.models import SimpleCNN

__all__ = ["cnn_moments", "measured_cnn"]


def cnn_moments(
    width: int = 64, batch: int = 64, size: int = 28, precision: str = "fp32", channels: int = 1, classes: int = 10
) -> dict[str, int]:
    """Chapters 04, 10: the bytes the course's SimpleCNN step (SGD) holds at each moment of backward. Its
    activations dominate, so the peak is the second ReLU's backward: every saved activation plus
    two gradients the size of that ReLU's output."""
    p = 2 if precision in ("bf16", "fp16") else 4
    amp = p == 2
    c1, c2 = width, 2 * width
    h1, h2 = size - 2, size - 4  # 3x3 convolutions without padding
    w1, w2, wf = c1 * channels * 9, c2 * c1 * 9, classes * c2
    params = 4 * (w1 + c1 + w2 + c2 + wf + classes)
    x16 = batch * channels * size * size * p if amp else 0  # conv1's input: under autocast a 16-bit copy
    a1 = batch * c1 * h1 * h1 * p  # relu1's output, saved by relu1 and by conv2
    a2 = batch * c2 * h2 * h2 * p  # relu2's output, saved by relu2 and by the pooling
    pooled = batch * c2 * p  # fc's input
    # under autocast each layer saves its 16-bit weight copy (a convolution saves it even for conv1)
    copy1, copy2, copyf = (w1 * 2, w2 * 2, wf * 2) if amp else (0, 0, 0)
    cast = 4 if amp else 0  # a 16-bit weight gradient is cast to the fp32 .grad
    moments = {}
    saved = x16 + a1 + a2 + copy1 + copy2
    moments["fc backward"] = params + saved + pooled + copyf + batch * classes * 4 + pooled + wf * p
    grads = 4 * (wf + classes)
    moments["pool backward"] = params + grads + saved + pooled + a2
    moments["relu2 backward"] = params + grads + saved + 2 * a2
    moments["conv2 backward"] = params + grads + x16 + a1 + copy1 + copy2 + a2 + a1 + w2 * (p + cast)
    grads += 4 * (w2 + c2)
    moments["relu1 backward"] = params + grads + x16 + a1 + copy1 + 2 * a1
    moments["conv1 backward"] = params + grads + x16 + copy1 + a1 + w1 * (p + cast)
    grads += 4 * (w1 + c1)
    moments["optimizer step"] = params + grads
    return moments


def measured_cnn(width: int, batch: int, size: int = 28, precision: str = "fp32") -> dict[str, int]:
    """Chapters 04, 10: tracked_peak of the course's SimpleCNN on one-channel images, plain SGD."""
    return tracked_peak(
        lambda: SimpleCNN(in_channels=1, width=width),
        lambda: (torch.randn(batch, 1, size, size), torch.randint(0, 10, (batch,))),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        precision,
    )
