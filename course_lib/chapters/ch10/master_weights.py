"""Pure bf16 weights with fp32 master copies: the fix for `w + Δw == w`, and what it costs (chapter 10).

A model stored in bf16 loses every update smaller than half the gap between neighbouring bf16
numbers. Keeping an fp32 master copy of each weight and stepping that copy keeps the small updates:
the bf16 weights the forward uses are re-rounded from the masters after each step. The price is
memory, per parameter, as this class holds it: the bf16 weight (2 bytes), its fp32 master (4) and
AdamW's two fp32 moments (8) from step to step; its bf16 gradient (2) while backward runs; and at
the step, where each bf16 gradient is copied to an fp32 `.grad` and released, the fp32 gradients
(4): 18 bytes a parameter, against autocast's 16 (fp32 weight 4, fp32 gradient 4, AdamW 8) plus its
16-bit weight copies while forward and backward run (chapter 10, section 8).
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["MasterWeightsAdamW"]


class MasterWeightsAdamW(torch.optim.AdamW):
    """Chapter 10: AdamW that steps fp32 master copies of a bf16 model's parameters. Each `step()`
    copies every bf16 gradient to its master's fp32 `.grad` (releasing the bf16 one), steps the
    masters, and rounds them back into the bf16 parameters."""

    def __init__(self, params: Iterable[torch.Tensor], **adamw: float | bool) -> None:
        self.model_params = [p for p in params if p.requires_grad]
        masters = [p.detach().float() for p in self.model_params]  # fp32 leaves, owned by the optimizer
        super().__init__(masters, **adamw)
        self.masters = masters

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for master, p in zip(self.masters, self.model_params):
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None  # one gradient at a time: the bf16 copy goes as its fp32 copy comes
        super().step()
        for master, p in zip(self.masters, self.model_params):
            p.copy_(master)  # rounded to bf16 here, kept exact in the master
            master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None
        super().zero_grad(set_to_none)
