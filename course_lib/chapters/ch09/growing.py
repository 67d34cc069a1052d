"""A model whose activations grow past fp16's range: chapter 09's NaN/inf walkthrough.

Chapter 03's `trace_magnitudes` (course_lib.chapters.ch03.overflow) finds the first layer whose
output leaves fp16's range; this is the model chapter 09 runs it on, and the fixes it tries.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn as nn

__all__ = ["growing_mlp"]


def growing_mlp(depth: int = 8, width: int = 256, gain: float = 6.0, seed: int = 0) -> nn.Sequential:
    """Chapter 09: an MLP for 28x28 images whose activations grow layer by layer, then a LayerNorm and a
    classifier. In fp32 it is a working model (the LayerNorm brings the values back to order one).

    Each Linear starts with weights of std gain / sqrt(fan_in). A ReLU keeps half of the signal's
    second moment, so every layer multiplies the activations' size by about gain / sqrt(2): He's
    initialisation (gain sqrt(2)) keeps it; gain 6 makes it grow about fourfold per layer, like a
    model whose weights have drifted large in fp32 or bf16 training.
    """
    torch.manual_seed(seed)
    layers: list[tuple[str, nn.Module]] = [("flatten", nn.Flatten())]
    for i in range(1, depth + 1):
        fc = nn.Linear(784 if i == 1 else width, width)
        nn.init.normal_(fc.weight, std=gain / math.sqrt(fc.in_features))
        nn.init.zeros_(fc.bias)
        layers += [(f"fc{i}", fc), (f"relu{i}", nn.ReLU())]
    layers += [("norm", nn.LayerNorm(width)), ("head", nn.Linear(width, 10))]
    return nn.Sequential(OrderedDict(layers))
