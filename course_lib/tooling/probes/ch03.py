"""Task side of exercise 03's checks (GradScaler): run the learner's functions, return plain data.

Nothing here knows a right answer. `update_scale` feeds the learner's rule the overflow pattern
of a case step by step, with torch's own scaler kernels switched off; `clipped_step` trains the
case's small network with the learner's step and records what each step left behind. The grader
(course_lib/tooling/checks/ch03.py) runs `train_steps` with its own, correct step to compare.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["update_scale", "clipped_step", "train_steps", "case_model", "IN", "HIDDEN", "OUT", "BATCH"]

_KERNELS = ("_amp_update_scale_", "_amp_foreach_non_finite_check_and_unscale_")


@contextlib.contextmanager
def _kernels_off() -> Iterator[None]:
    """While the learner's function runs, GradScaler's own kernels raise, however they are reached
    (torch._amp_update_scale_, torch.ops.aten..., a GradScaler's update): they are replaced where
    every call of an operator arrives, in PyTorch's dispatcher, for the CPU and CUDA. The task's
    other forbidden names (torch.amp, course_lib) are kept out by the task process itself."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "GradScaler's own kernels (torch._amp_update_scale_ ...) are switched off while your "
            "function is checked: write the rule yourself"
        )

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        for name in _KERNELS:
            for key in ("CPU", "CUDA"):
                lib.impl(name, refuse, key)
    try:
        yield
    finally:
        lib._destroy()  # the real kernels again (a task process ends here anyway; run_check goes on)


def update_scale(case: dict, learner: Callable) -> object:
    """Task 03.update_scale: [[scale, tracker], ...] after each step, or {"bad_return": ..., "at": i}."""
    scale, tracker, out = case["init_scale"], case["growth_tracker"], []
    with _kernels_off():
        for found_inf in case["found_inf"]:
            result = learner(
                scale, tracker, found_inf, case["growth_factor"], case["backoff_factor"], case["growth_interval"]
            )
            if not (isinstance(result, (tuple, list)) and len(result) == 2):
                return {"bad_return": repr(result)[:80], "at": len(out)}
            scale, tracker = result
            out.append([scale, tracker])
    return out


# --------------------------------------------------------------------------- task 2

IN, HIDDEN, OUT, BATCH = 6, 12, 4, 16


def case_model(case: dict) -> nn.Module:
    """The case's network with its drawn weights (a meta model draws nothing from the global RNG, which
    the grader's judging threads share)."""
    meta = nn.Sequential(nn.Linear(IN, HIDDEN, device="meta"), nn.ReLU(), nn.Linear(HIDDEN, OUT, device="meta"))
    model = meta.to_empty(device="cpu")
    with torch.no_grad():
        for p, w in zip(model.parameters(), case["weights"], strict=True):
            p.copy_(torch.tensor(w, dtype=torch.float32))
    return model


def train_steps(case: dict, step_fn: Callable) -> list[dict[str, Any]]:
    """Train a fresh copy of the case's model with `step_fn` doing everything after the forward; after
    each step record the returned norm, the scale, the parameters and the .grad tensors."""
    model = case_model(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=case["lr"], momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=case["init_scale"], growth_interval=case["growth_interval"])
    out = []
    for x, y in zip(case["x"], case["y"], strict=True):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(torch.tensor(x)), torch.tensor(y))
        norm = step_fn(model, optimizer, scaler, loss, case["max_norm"])
        out.append(
            {
                "norm": float(norm) if isinstance(norm, (int, float, torch.Tensor)) else repr(norm)[:60],
                "scale": scaler.get_scale(),
                "params": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
                "grads": [None if p.grad is None else p.grad.flatten().tolist() for p in model.parameters()],
            }
        )
    return out


def clipped_step(case: dict, learner: Callable) -> list[dict[str, Any]]:
    """Task 03.clipped_step: what each of the learner's steps left behind."""
    return train_steps(case, learner)
