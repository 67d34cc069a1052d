"""Task side of exercise 11's checks (see course_lib.tooling.probes): the learner's fp8_matmul,
called on one case's operands (fp32 matrices). The reference product stays in the grader."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["fp8_matmul"]


def fp8_matmul(case: dict, fp8_matmul_fn: Callable) -> Any:
    return fp8_matmul_fn(torch.tensor(case["a"]), torch.tensor(case["b"]), case["granularity"])
