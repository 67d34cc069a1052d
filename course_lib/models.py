"""Models used across the course: small enough for a CPU, real enough for a GPU.

Chapter 00 introduces SimpleCNN and MLP; the ResNets appear in chapters 06 and 09.
"""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["SimpleCNN", "MLP"]


class SimpleCNN(nn.Module):
    """Chapter 00: the CNN of a popular article (Betty796, 2025-12-24), corrected.

    What the article got wrong, and what we changed:
    - it built `nn.AdaptiveAvgPool2d` inside `forward`, a new module object on every call;
      here the pooling layer is created once and registered;
    - it hard-coded 3 input channels; Fashion-MNIST has 1, so `in_channels` is a parameter;
    - `x.view(x.size(0), -1)` fails on non-contiguous inputs (e.g. channels_last);
      `torch.flatten(x, 1)` works on both.
    The layer sizes are the article's: conv 3x3 -> 64, conv 3x3 -> 128, global average pool, linear.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3)
        self.conv2 = nn.Conv2d(width, 2 * width, 3)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = torch.flatten(self.pool(x), 1)
        return self.fc(x)


class MLP(nn.Module):
    """Chapter 02: a stack of Linear+ReLU layers like the PyTorch AMP recipe's network.

    Widths that are multiples of 8 let fp16/bf16 matmuls use Tensor Cores efficiently.
    """

    def __init__(self, in_features: int = 784, hidden: int = 512, depth: int = 2, num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        for i in range(depth):
            layers += [nn.Linear(in_features if i == 0 else hidden, hidden), nn.ReLU()]
        layers.append(nn.Linear(hidden, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _torchvision_models():
    # Imported lazily: a broken torchvision (e.g. next to a CPU-only torch wheel) raises
    # RuntimeError at import and must not stop the chapters that do not need it.
    try:
        import torchvision.models as tvm
    except (ImportError, RuntimeError, OSError) as e:
        raise RuntimeError(f"this model needs a working torchvision ({type(e).__name__}: {e}). "
                           "Install a torchvision that matches your torch (pip install -U torch torchvision), "
                           "or use SimpleCNN / MLP.") from e
    return tvm


def small_resnet(in_channels: int = 3, num_classes: int = 10) -> nn.Module:
    """Torchvision's ResNet-18 adapted to 28-32 px images.

    A 3x3 stride-1 stem without max-pool (the usual CIFAR change): the ImageNet stem would
    shrink a 32 px image to 8 px before the first residual block.
    """
    m = _torchvision_models().resnet18(num_classes=num_classes)
    m.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
    m.maxpool = nn.Identity()
    return m


def resnet50(num_classes: int = 1000) -> nn.Module:
    """Torchvision's ResNet-50, the model of NVIDIA's published AMP figures (224 px)."""
    return _torchvision_models().resnet50(num_classes=num_classes)


def build_model(name: str, **kwargs) -> nn.Module:
    """Build a model by name: simplecnn, mlp, small_resnet, resnet50."""
    factories = {"simplecnn": SimpleCNN, "mlp": MLP, "small_resnet": small_resnet, "resnet50": resnet50}
    if name not in factories:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(factories)}")
    return factories[name](**kwargs)
