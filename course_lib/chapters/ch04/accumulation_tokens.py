"""Gradient accumulation with a token-level loss: divide by the real tokens of the whole effective batch.

Chapter 04. A language model's loss is a mean over the real (non-padding) tokens of its batch.
Micro-batches of variable-length sequences hold different numbers of real tokens, so taking each
micro-batch's mean and dividing by the number of micro-batches gives a token of a sparse
micro-batch more weight than one of a full micro-batch: the mean of means of
course_lib.chapters.ch04.accumulation, per token. Sum each micro-batch's token losses and divide by the
real tokens of all the micro-batches together, counted before the first backward.

    micro = padded_micro_batches([[9, 2], [3, 1]])      # two micro-batches of two sequences each
    token_grad(token_model(), micro, NORMALISATIONS[1])  # the large batch's gradient, to rounding
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "IGNORE_INDEX",
    "NORMALISATIONS",
    "token_model",
    "padded_micro_batches",
    "token_loss",
    "token_grad",
    "token_rows",
]

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index: the targets at padding
PAD = 0  # the padding token of the inputs; real tokens are 1 .. vocab - 1
NORMALISATIONS = ("mean per micro-batch / N", "sum / all real tokens")
TokenBatches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def token_model(vocab: int = 32, dim: int = 16, seed: int = 0) -> nn.Module:
    """Chapter 04: a tiny token model: an embedding, then a linear layer to the vocabulary's logits."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(vocab, dim, padding_idx=PAD), nn.Tanh(), nn.Linear(dim, vocab))


def padded_micro_batches(lengths: Sequence[Sequence[int]], vocab: int = 32, seed: int = 0) -> list[tuple]:
    """Chapter 04: micro-batch i holds one random sequence per length in lengths[i], padded to the longest length of
    them all, as (tokens, targets), both int64 (sequences, longest): PAD and IGNORE_INDEX at the padding."""
    g = torch.Generator().manual_seed(seed)
    longest = max(n for micro in lengths for n in micro)
    out = []
    for micro in lengths:
        real = torch.arange(longest) < torch.tensor(list(micro))[:, None]
        tokens = torch.randint(1, vocab, (len(micro), longest), generator=g)
        targets = torch.randint(1, vocab, (len(micro), longest), generator=g)
        out.append((tokens.masked_fill(~real, PAD), targets.masked_fill(~real, IGNORE_INDEX)))
    return out


def real_tokens(targets: torch.Tensor) -> int:
    """How many targets are real tokens (not IGNORE_INDEX)."""
    return int((targets != IGNORE_INDEX).sum())


def token_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Chapter 04: cross-entropy over the real tokens only, their mean ("mean") or their sum ("sum")."""
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction)


def token_grad(model: nn.Module, micro_batches: TokenBatches, normalisation: str) -> torch.Tensor:
    """Chapter 04: the gradient one accumulated step hands the optimizer, flattened, in float64.

    NORMALISATIONS[0]: each micro-batch's mean over its real tokens, divided by the number of micro-batches
    (what a loop written for samples does with a token loss); NORMALISATIONS[1]: each micro-batch's sum of
    token losses, divided by the real tokens of all the micro-batches. One micro-batch: the large batch.
    """
    if normalisation not in NORMALISATIONS:
        raise ValueError(f"normalisation must be one of {NORMALISATIONS}")
    total = sum(real_tokens(targets) for _, targets in micro_batches)  # known before the first backward
    model.zero_grad(set_to_none=True)
    for tokens, targets in micro_batches:
        if normalisation == NORMALISATIONS[0]:
            loss = token_loss(model, tokens, targets) / len(micro_batches)
        else:
            loss = token_loss(model, tokens, targets, reduction="sum") / total
        loss.backward()
    return torch.cat([p.grad.flatten().double() for p in model.parameters()])


def token_rows(cases: dict[str, Sequence[Sequence[int]]], seed: int = 0) -> list[dict]:
    """Chapter 04: per case (a name -> each micro-batch's sequence lengths): the real tokens of each micro-batch,
    the largest gradient entry of the large batch (all the sequences in one batch, its mean over all their real
    tokens), and for each normalisation the largest absolute difference of the accumulated gradient from it."""
    rows = []
    for name, lengths in cases.items():
        micro = padded_micro_batches(lengths, seed=seed)
        large = token_grad(token_model(seed=seed), [tuple(torch.cat(t) for t in zip(*micro))], NORMALISATIONS[1])
        row = {"case": name, "tokens": [real_tokens(t) for _, t in micro], "largest": large.abs().max().item()}
        for n in NORMALISATIONS:
            row[n] = (token_grad(token_model(seed=seed), micro, n) - large).abs().max().item()
        rows.append(row)
    return rows
