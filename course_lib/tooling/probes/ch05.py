"""Task side of exercise 05's check (two models, two losses, two optimizers, one GradScaler).

`fix_two_models` builds the case's two models, optimizers, scaler and batches from its seed, runs
the learner's loop with its calls recorded (course_lib.chapters.ch05.doctor_recorder.Recorder, which notes the
autocast state at each backward, clip, optimizer step, scaler.step and update; the scaler below
adds unscale_), and returns as plain data:

    params0, params1  the final parameters of each model
    scale             the scaler's scale at the end
    steps             how often each optimizer really stepped (a skipped scaler.step does not count)
    calls             [kind, optimizer index, details, autocast on?] for each call of KINDS, in order

The grader (course_lib/tooling/checks/ch05.py) runs a correct loop on `build(case)` and compares;
nothing here knows the right answer.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from ...chapters.ch05.doctor_recorder import Recorder

__all__ = ["fix_two_models", "record_loop", "build", "flat", "KINDS"]

KINDS = ("backward", "zero_grad", "unscale_", "clip", "scaler.step", "step", "update")


def _model(g: torch.Generator) -> nn.Module:
    # chapter 05's two_models architecture, initialised from `g` alone: the grader judges in
    # threads, so nothing here may touch the global RNG (a meta model draws nothing)
    meta = nn.Sequential(nn.Linear(16, 32, device="meta"), nn.ReLU(), nn.Linear(32, 4, device="meta"))
    model = meta.to_empty(device="cpu")
    with torch.no_grad():
        for layer in (model[0], model[2]):
            bound = layer.in_features**-0.5  # the bounds of nn.Linear's default initialisation
            layer.weight.uniform_(-bound, bound, generator=g)
            layer.bias.uniform_(-bound, bound, generator=g)
    return model


class CountingSGD(torch.optim.SGD):
    """SGD that counts the steps it really takes (GradScaler.step skips the call on inf/NaN gradients)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.taken = 0

    def step(self, closure: Callable | None = None) -> Any:
        self.taken += 1
        return super().step(closure)


class _UnscaleAutocast(torch.amp.GradScaler):
    """A GradScaler that writes the autocast state into the Recorder's unscale_ event (the Recorder notes
    it for every other call): the Recorder's wrapper records the event, then calls this method."""

    recorder: Recorder | None = None

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        rec = self.recorder
        if rec is not None and rec.events and rec.events[-1].kind == "unscale_":
            rec.events[-1].autocast = rec.autocast_on()
        return super().unscale_(optimizer)


def build(case: dict, scaler_class: type = torch.amp.GradScaler) -> tuple:
    """The case's two models, SGD optimizers (with momentum), scaler and batches, all from the case's seed."""
    g = torch.Generator().manual_seed(case["seed"])
    model0, model1 = _model(g), _model(g)
    opts = [CountingSGD(m.parameters(), lr=case["lr"], momentum=0.9) for m in (model0, model1)]
    scaler = scaler_class("cpu", init_scale=case["init_scale"], growth_interval=case["growth_interval"])
    batches = [
        (torch.randn(case["batch"], 16, generator=g), torch.randn(case["batch"], 4, generator=g))
        for _ in range(case["iterations"])
    ]
    return model0, model1, *opts, scaler, batches


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def record_loop(case: dict, loop: Callable, dtype: torch.dtype) -> dict[str, Any]:
    """Run `loop` on the case with its calls recorded (this patches torch while it runs: in a task process only)."""
    model0, model1, opt0, opt1, scaler, batches = build(case, _UnscaleAutocast)
    with Recorder((model0, model1), (opt0, opt1), scaler, loop) as rec:
        scaler.recorder = rec
        loop(model0, model1, opt0, opt1, scaler, batches, case["max_norm"], dtype)
    calls = [
        [e.kind, e.index, e.info.get("owners", e.info.get("via_scaler")), bool(e.autocast)]
        for e in rec.events
        if e.kind in KINDS
    ]
    return {
        "params0": flat(model0),
        "params1": flat(model1),
        "scale": scaler.get_scale(),
        "steps": [opt0.taken, opt1.taken],
        "calls": calls,
    }


def fix_two_models(case: dict, learner: Callable) -> dict[str, Any]:
    """Task 05.fix_two_models: the learner's train_two_models on one case."""
    return record_loop(case, learner, getattr(torch, case["dtype"]))
