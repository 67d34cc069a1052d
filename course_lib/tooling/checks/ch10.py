"""Checks for exercise 10 (where the memory goes). The reference is a measurement: the grader runs
a real GPT block on each case and counts, with chapter 02's saved_bytes_by_kind, the bytes it saves
for backward; a formula that is right predicts it to the byte, and the usual mistakes are named."""

from __future__ import annotations

import random

import torch

from ...chapters.ch02.saved_tensors import saved_bytes_by_kind
from ...device import AMP_DTYPES
from ...models import GPT, GPTConfig
from ..checkbase import Check, CheckFailure, describe_value, expect_list, register

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name


def measured_block_bytes(batch: int, seq: int, n_embd: int, n_head: int, precision: str) -> int:
    """What one pre-LayerNorm GPT block (the course's, SDPA attention) saves for backward while its
    forward runs, its input included (in a model it is the previous block's output), parameters
    excluded: activations plus, under autocast, the 16-bit weight copies."""
    torch.manual_seed(0)
    block = GPT(GPTConfig(n_embd=n_embd, n_head=n_head, block_size=seq, vocab_size=8, n_layer=1)).blocks[0]
    x = torch.randn(batch, seq, n_embd, requires_grad=True)
    dtype = AMP_DTYPES[precision]
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        kinds = saved_bytes_by_kind(lambda: block(x.clone()))  # clone: the input is made inside, as in a model
    return sum(kinds["activations"].values()) + sum(kinds["weight copies"].values())


def _mistakes(batch: int, seq: int, n_embd: int, n_head: int, precision: str, right: int) -> dict[str, int]:
    """The usual wrong predictions, each as far from the right one as that mistake puts it."""
    p = 2 if precision != "fp32" else 4
    btc = batch * seq * n_embd
    weights = 12 * n_embd * n_embd
    out = {}
    if p == 2:
        out["the 16-bit weight copies autocast saves (each Linear saves its cast weight) are missing"] = (
            right - 2 * weights
        )
        out["the LayerNorm inputs (the residual stream) stay fp32 under autocast: 4 bytes, not 2"] = right - 2 * 2 * btc
        out["the fp32 weights are counted as if they were new memory (they exist before the step)"] = (
            right - 2 * weights + 4 * weights
        )
    else:
        out["the fp32 weights are counted as if they were new memory (they exist before the step)"] = (
            right + 4 * weights
        )
    out["q, k and v are one storage (views of the qkv Linear's output), counted here as new copies"] = (
        right + 3 * p * btc
    )
    out["LayerNorm's saved mean and rstd (2 fp32 numbers per token, for each of the two LayerNorms) are missing"] = (
        right - 2 * 2 * batch * seq * 4
    )
    out["SDPA's logsumexp (one fp32 number per head and token) is missing"] = right - batch * n_head * seq * 4
    out["the gradients were counted too: they are made in backward, not saved by the forward"] = right + 4 * weights
    return out


@register
class BlockSavedBytes(Check):
    name, args, points = "10.block_saved_bytes", ("block_saved_bytes",), 3
    hint = (
        "Chapter 10, section 2: walk the block op by op and write down what each saves for backward, with its "
        "dtype: LayerNorm (its input, the fp32 residual stream, and its mean and rstd), each Linear (its input "
        "in the compute dtype and, under autocast, a 16-bit copy of its weight), SDPA (q, k, v: one storage; "
        "its output; a logsumexp), GELU (its input). The residual adds save nothing."
    )
    forbidden = ("course_lib",)
    forbidden_why = "predict it from what each layer saves, as chapter 10 does, instead of calling the course's model"

    def cases(self, rng: random.Random) -> list:
        cases = []
        for precision in ("fp32", "bf16"):
            for _ in range(3):
                n_head = rng.choice([2, 4])
                cases.append(
                    {
                        "batch": rng.randint(1, 4),
                        "seq": rng.choice([8, 16, 24, 32]),
                        "n_embd": n_head * rng.choice([8, 16, 24]),
                        "n_head": n_head,
                        "precision": precision,
                    }
                )
        rng.shuffle(cases)
        return cases

    def describe(self, case: dict) -> str:
        return (
            f"block_saved_bytes(batch={case['batch']}, seq={case['seq']}, n_embd={case['n_embd']}, "
            f"n_head={case['n_head']}, precision={case['precision']!r})"
        )

    def judge(self, cases: list, results: list) -> None:
        for case, got in zip(cases, expect_list(results, "block_saved_bytes's answers", len(cases))):
            if isinstance(got, bool) or not isinstance(got, (int, float)):
                raise CheckFailure(f"{self.describe(case)} returned {describe_value(got)}, not a number of bytes")
            want = measured_block_bytes(**case)
            if round(got) == want:
                continue
            # Two mistakes can land on the same number for some sizes: name every one that fits.
            named = [why for why, value in _mistakes(**case, right=want).items() if round(got) == value]
            because = f": {'; or '.join(named)}" if named else ""
            raise CheckFailure(f"{self.describe(case)} returned {got:,}, the block saved {want:,} bytes{because}")
