"""Task side of exercise 04's check (gradient accumulation): run the learner's loop, return what it did.

From the (plain) case, `build` makes the model and the micro-batches, `.grad` is filled with junk
that must not count, and the learner's `accumulate` runs with an optimizer and a GradScaler that
record what they are asked to do. What comes back, as plain data:

    grads            the gradients the optimizer's first step was handed (None if it never stepped)
    steps, updates   optimizer.step() and scaler.update() calls
    forward_sizes    the batch size of each forward of the model, in order
    forward_dtypes   the dtypes the first layer computed in (was autocast on?)
    backward_autocast  per backward pass (one per gradient of the first weight): was autocast on?
    step_autocast, update_autocast  the same at each optimizer.step(), scaler.step() and scaler.update()
    scale            the scaler's scale when the loop returned

The grader (course_lib/tooling/checks/ch04.py) runs `run_loop` with its own correct loop on the
same case and compares; nothing here knows the right answer.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...device import AMP_DTYPES

__all__ = ["accumulate", "run_loop", "build", "junk", "DTYPES", "LOSSES"]

DTYPES = AMP_DTYPES  # course_lib.device's map: the one place a precision becomes a dtype
LOSSES = {"cross_entropy": F.cross_entropy, "mse_loss": F.mse_loss}


def _linear(n_in: int, n_out: int, g: torch.Generator) -> nn.Linear:
    # nn.Linear's default initialisation drawn from `g` alone: the grader judges in threads, and the
    # global RNG is shared by them all (a meta layer draws nothing)
    layer = nn.Linear(n_in, n_out, device="meta").to_empty(device="cpu")
    bound = n_in**-0.5
    with torch.no_grad():
        layer.weight.uniform_(-bound, bound, generator=g)
        layer.bias.uniform_(-bound, bound, generator=g)
    return layer


def build(case: dict) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The case's model and its micro-batches, from the case's seed alone."""
    g = torch.Generator().manual_seed(case["seed"])
    model = nn.Sequential(
        _linear(case["features"], case["hidden"], g), nn.Tanh(), _linear(case["hidden"], case["classes"], g)
    )
    g = torch.Generator().manual_seed(case["seed"] + 1)
    n = sum(case["sizes"])
    x = torch.randn(n, case["features"], generator=g)
    y = (
        torch.randint(0, case["classes"], (n,), generator=g)
        if case["loss"] == "cross_entropy"
        else torch.randn(n, case["classes"], generator=g)
    )
    return model, list(zip(x.split(case["sizes"]), y.split(case["sizes"])))


def junk(case: dict) -> torch.Tensor:
    """What .grad holds before the learner's function runs: it must not count."""
    model, _ = build(case)
    g = torch.Generator().manual_seed(case["seed"] + 2)
    return torch.cat([torch.randn(p.numel(), generator=g) for p in model.parameters()])


# Taken when the task process imports this probe, before any learner code runs: a notebook that
# rebinds torch.is_autocast_enabled (however it names torch) changes nothing recorded here.
_is_autocast_enabled = torch.is_autocast_enabled


def _autocast_on() -> bool:
    return _is_autocast_enabled("cpu")  # the check's models live on the CPU


class _RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps the gradients of its first step, counts its steps and notes autocast at each."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls, self.first, self.autocast = 0, None, []

    def step(self, closure: Callable | None = None) -> Any:
        self.calls += 1
        self.autocast.append(_autocast_on())
        if self.first is None:
            self.first = [
                p.grad.detach().flatten().tolist() if p.grad is not None else None
                for g in self.param_groups
                for p in g["params"]
            ]
        return super().step(closure)


class _RecordingScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler that counts update() calls and notes autocast at step() and update()."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.updates, self.autocast = 0, {"step": [], "update": []}

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self.autocast["step"].append(_autocast_on())
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        self.updates += 1
        self.autocast["update"].append(_autocast_on())
        return super().update(new_scale)


def run_loop(case: dict, loop: Callable) -> dict[str, Any]:
    """Run `loop` (the learner's accumulate, or the grader's) on the case; what it did, as plain data."""
    model, micro = build(case)
    with torch.no_grad():
        for p, j in zip(model.parameters(), junk(case).split([p.numel() for p in model.parameters()])):
            p.grad = j.view_as(p).clone()
    dtypes: list[str] = []  # the dtype the first layer computes in: tells whether autocast was on
    sizes: list[int] = []  # one entry per forward of the whole model: its batch size
    backward: list[bool] = []  # autocast at each backward pass that reaches the first layer's weight
    model[0].register_forward_hook(lambda module, args, out: dtypes.append(str(out.dtype)))
    model.register_forward_pre_hook(
        lambda module, args: sizes.append(
            int(args[0].shape[0]) if args and isinstance(args[0], torch.Tensor) and args[0].dim() else -1
        )
    )
    # A tensor hook runs inside the backward pass and sees the autocast state of the thread that called
    # backward(): on the CPU, the caller's own thread.
    model[0].weight.register_hook(lambda grad: backward.append(_autocast_on()))
    optimizer = _RecordingSGD(model.parameters(), lr=0.1)
    scaler = _RecordingScaler("cpu", init_scale=case["init_scale"], enabled=case["precision"] == "fp16")
    loop(model, optimizer, scaler, micro, LOSSES[case["loss"]], DTYPES[case["precision"]])
    return {
        "grads": optimizer.first,
        "steps": optimizer.calls,
        "updates": scaler.updates,
        "forward_dtypes": sorted(set(dtypes)),
        "forward_sizes": sizes,
        "backward_autocast": backward,
        "step_autocast": optimizer.autocast + scaler.autocast["step"],
        "update_autocast": scaler.autocast["update"],
        "scale": scaler.get_scale(),
    }


def accumulate(case: dict, learner: Callable) -> dict[str, Any]:
    """Task 04.accumulate: the learner's loop on one case."""
    return run_loop(case, learner)
