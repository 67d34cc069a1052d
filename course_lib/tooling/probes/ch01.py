"""Task side of exercise 01's checks (see course_lib.tooling.probes). decode_fp16 and round_to_bf16
have no probe: the learner's function is called on the bit pattern itself. Their tasks forbid torch,
which is absent from their task process: so torch is imported only by the probe that needs it."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["fp_fate", "bf16_dot_errors"]


def fp_fate(case: list, fp_fate_fn: Callable) -> Any:
    return fp_fate_fn(case[0], case[1])  # (x, format name)


def bf16_dot_errors(case: dict, bf16_dot_errors_fn: Callable) -> Any:
    import torch

    # the case's values are float32 values written as Python floats: exact again as float32
    x, y = torch.tensor(case["x"], dtype=torch.float32), torch.tensor(case["y"], dtype=torch.float32)
    return bf16_dot_errors_fn(x, y)
