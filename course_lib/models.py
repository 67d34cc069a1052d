"""Models used across the course: small enough for a CPU, real enough for a GPU.

Chapter 00 introduces SimpleCNN and MLP; the ResNets and the small GPT appear in chapter 09.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["SimpleCNN", "MLP", "small_resnet", "resnet50", "GPTConfig", "GPT"]


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C, H, W)
        x = torch.relu(self.conv1(x))  # (B, width, H-2, W-2): a 3x3 convolution without padding
        x = torch.relu(self.conv2(x))  # (B, 2*width, H-4, W-4)
        x = torch.flatten(self.pool(x), 1)  # (B, 2*width): the mean of each channel
        return self.fc(x)  # (B, num_classes)


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
        raise RuntimeError(
            f"this model needs a working torchvision ({type(e).__name__}: {e}). "
            "Install a torchvision that matches your torch (pip install -U torch torchvision), "
            "or use SimpleCNN / MLP."
        ) from e
    return tvm


def small_resnet(in_channels: int = 3, num_classes: int = 10) -> nn.Module:
    """Chapter 04: torchvision's ResNet-18 adapted to 28-32 px images.

    A 3x3 stride-1 stem without max-pool (the usual CIFAR change): the ImageNet stem would
    shrink a 32 px image to 8 px before the first residual block.
    """
    m = _torchvision_models().resnet18(num_classes=num_classes)
    m.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
    m.maxpool = nn.Identity()
    return m


def resnet50(num_classes: int = 1000) -> nn.Module:
    """Chapters 00, 09: torchvision's ResNet-50, the model of NVIDIA's published AMP figures (224 px)."""
    return _torchvision_models().resnet50(num_classes=num_classes)


# ----------------------------------------------------------------------------- a small GPT


@dataclass
class GPTConfig:
    """Chapter 09: the shape of a GPT. The defaults are GPT-2 small (124M parameters)."""

    vocab_size: int = 50304  # GPT-2's 50257 tokens padded to a multiple of 64: matmuls tile evenly
    block_size: int = 1024  # the longest sequence
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    sdpa: bool = True  # F.scaled_dot_product_attention (fused kernels) or the explicit softmax(QK^T)V


class _Attention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)  # query, key and value of every head, in one matmul
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.n_head = c.n_head
        self.sdpa = c.sdpa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # batch, sequence length, embedding width
        hs = C // self.n_head  # head size
        q, k, v = self.qkv(x).split(C, dim=2)  # each (B, T, C)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        if self.sdpa:  # one fused kernel (flash / memory-efficient attention where the GPU has them)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        else:  # the textbook way: a T x T score matrix per head, masked, softmaxed, all kept for backward
            scores = (q @ k.transpose(-2, -1)) / (hs**0.5)  # (B, nh, T, T)
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            y = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # the heads side by side again
        return self.proj(y)


class _Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.n_embd)
        self.attn = _Attention(c)
        self.ln2 = nn.LayerNorm(c.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(c.n_embd, 4 * c.n_embd),  # (B, T, 4C)
            nn.GELU(),
            nn.Linear(4 * c.n_embd, c.n_embd),  # (B, T, C)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C) in and out
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Chapter 09: a decoder-only transformer in the shape of GPT-2, for measuring MFU.

    Pre-LayerNorm blocks of causal self-attention and a 4x MLP; the output layer shares its
    weight with the token embedding, as GPT-2 does. forward(idx, targets) returns (logits, loss).
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        c = self.config = config or GPTConfig()
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)  # token embedding
        self.wpe = nn.Embedding(c.block_size, c.n_embd)  # position embedding
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one (vocab, C) matrix embeds and predicts
        for m in self.modules():  # GPT-2's initialisation; N(0, 1) embeddings would make tied logits huge
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):  # idx: (B, T) token ids
        pos = torch.arange(idx.size(1), device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab_size)
        if targets is None:
            return logits, None
        # .float(): the log-softmax over the whole vocabulary in fp32, on every device and autocast policy
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per parameter (forward 2, backward 4) plus attention's
        12 * layers * embedding * sequence (the PaLM paper's appendix B estimate)."""
        c = self.config
        n = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        return 6 * n + 12 * c.n_layer * c.n_embd * seq_len


def build_model(name: str, **kwargs) -> nn.Module:
    """Build a model by name: simplecnn, mlp, small_resnet, resnet50."""
    factories = {"simplecnn": SimpleCNN, "mlp": MLP, "small_resnet": small_resnet, "resnet50": resnet50}
    if name not in factories:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(factories)}")
    return factories[name](**kwargs)
