"""Task side of exercise 11's checks (see course_lib.tooling.probes): the learner's fp8_matmul, called on
one case's operands (fp32 matrices), and the learner's mx_quantize, called on one case's tensor; the
reference products and bytes stay in the grader."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["fp8_matmul", "mx_quantize"]


def fp8_matmul(case: dict, fp8_matmul_fn: Callable) -> Any:
    return fp8_matmul_fn(torch.tensor(case["a"]), torch.tensor(case["b"]), case["granularity"])


def _plain(value: Any) -> Any:
    """A returned tensor as plain data: a 1-byte tensor (uint8, int8, an 8- or 4-bit float) as its bytes,
    the bit patterns the check compares; any other tensor as its values; anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    t = value.detach().cpu().contiguous()
    out = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if t.element_size() == 1 and t.dtype != torch.bool:
        return {**out, "bytes": t.view(torch.uint8).tolist()}
    return {**out, "values": t.double().tolist()}


def mx_quantize(case: dict, mx_quantize_fn: Callable) -> Any:
    answer = mx_quantize_fn(torch.tensor(case["x"]), case["fmt"], case["rule"])
    if isinstance(answer, (tuple, list)):
        return [_plain(v) for v in answer]
    return _plain(answer)
