"""Task side of exercise 02's checks (see course_lib.tooling.probes): the inputs and models built
from a case, and the learner's functions run on them. The references stay in the grader."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["dtype_of", "predict_dtype", "make_sqdist", "build", "find_fp32_islands"]


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


# --------------------------------------------------------------------------- task 1


def predict_dtype(case: list, predict_dtype_fn: Callable) -> Any:
    op, device, low, ins = case
    return predict_dtype_fn(op, device, dtype_of(low), tuple(dtype_of(i) for i in ins))


# --------------------------------------------------------------------------- task 2


def make_sqdist(case: dict, make_sqdist_fn: Callable) -> dict:
    device = case["device"]
    fn_cls = make_sqdist_fn(device)
    if not (isinstance(fn_cls, type) and issubclass(fn_cls, torch.autograd.Function)):
        return {"not_function": repr(fn_cls)[:100]}
    dtype = dtype_of(case["dtype"])
    a = torch.tensor(case["a"], dtype=torch.float64).to(device, dtype).requires_grad_()
    b = torch.tensor(case["b"], dtype=torch.float64).to(device, dtype).requires_grad_()
    if case["autocast"] is None:
        out = fn_cls.apply(a, b)
        out.backward(torch.tensor(case["g"], dtype=torch.float64, device=device).to(out.dtype))
    else:
        with torch.autocast(device, dtype=dtype_of(case["autocast"])):
            out = fn_cls.apply(a, b)
            # backward() inside the region on purpose: not the pattern to copy, but custom_bwd must survive it
            out.backward(torch.tensor(case["g"], dtype=torch.float64, device=device).to(out.dtype))
    return {
        "out": out.detach().double().cpu(),
        "out_dtype": out.dtype,
        "grad_a": None if a.grad is None else a.grad.double().cpu(),
        "grad_b": None if b.grad is None else b.grad.double().cpu(),
    }


# --------------------------------------------------------------------------- task 3

CHANNELS, LENGTH = 4, 6


def _up(x: torch.Tensor) -> torch.Tensor:
    return x.float()


def _l1(x: torch.Tensor) -> torch.Tensor:
    return F.l1_loss(x, torch.zeros_like(x), reduction="none")


def _prod(x: torch.Tensor) -> torch.Tensor:
    return torch.prod(x.unsqueeze(-1), dim=-1)


def _exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.clamp(max=4))


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return F.softmax(x, dim=1)


def _reflect(x: torch.Tensor) -> torch.Tensor:
    return F.pad(x, (1, 1), mode="reflect")[..., 1:-1]


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _down(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16) if x.dtype == torch.float32 else x


# Forwards of "mystery" modules: classes with random names whose behaviour only running them reveals.
MYSTERY = {"f0": _up, "f1": _l1, "f2": _prod, "f3": _exp, "f4": _softmax, "f5": _reflect, "f6": _double, "f7": _down}
STANDARD = {
    "conv": lambda: nn.Conv1d(CHANNELS, CHANNELS, 1),
    "conv3": lambda: nn.Conv1d(CHANNELS, CHANNELS, 3, padding=1),
    "reflectpad": lambda: nn.ReflectionPad1d(1),
    "replicatepad": lambda: nn.ReplicationPad1d(1),
    "groupnorm": lambda: nn.GroupNorm(1, CHANNELS),
    "softmax": lambda: nn.Softmax(dim=1),
    "upsample": lambda: nn.Upsample(scale_factor=2),
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
    "identity": nn.Identity,
    "constpad": lambda: nn.ConstantPad1d(1, 0.0),
    "maxpool": lambda: nn.MaxPool1d(1),
}


def _mystery(key: str, class_name: str) -> nn.Module:
    forward = MYSTERY[key]
    cls = type(class_name, (nn.Module,), {"forward": lambda self, x: forward(x)})
    return cls()


def build(spec: dict) -> tuple[nn.Module, torch.Tensor]:
    """The model and input a case describes (the grader builds the same ones for its reference)."""

    def make(item: list) -> nn.Module:
        return _mystery(item[1], item[2]) if item[0] == "mystery" else STANDARD[item[0]]()

    torch.manual_seed(spec["seed"])
    parts = OrderedDict(
        (name, make(items[0]) if name in ("stem", "head") else nn.Sequential(*map(make, items)))
        for name, items in spec["parts"]
    )
    model = nn.Sequential(parts).to(spec["device"])
    x = torch.randn(2, CHANNELS, LENGTH, generator=torch.Generator().manual_seed(spec["seed"])).to(spec["device"])
    return model, x


def find_fp32_islands(case: dict, find_fp32_islands_fn: Callable) -> Any:
    model, x = build(case)
    return find_fp32_islands_fn(model, x, case["device"], dtype_of(case["dtype"]))
