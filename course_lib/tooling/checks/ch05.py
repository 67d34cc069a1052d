"""Checks for exercise 05 (several models, losses and optimizers under one GradScaler).

Graded by behaviour. The grader draws seeds, sizes and scaler settings; the learner's kernel
builds the two models, optimizers, scaler and batches from them, runs the learner's loop with
the optimizers' and scaler's methods recorded (course_lib.chapters.doctor.Recorder), and
returns the final parameters, the scale and the calls as plain data. The grader checks the
calls (one update per iteration, after both steps; every optimizer through the scaler;
clipping after unscale_), runs a correct loop on the same case and compares the parameters;
where they differ, it runs loops with one known mistake each to say which one it is.
"""
from __future__ import annotations

import random

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...chapters.doctor import Recorder
from ...chapters.multi import amp_mode
from ..grading import Check, CheckFailure, register

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

KINDS = ("backward", "zero_grad", "unscale_", "clip", "scaler.step", "step", "update")


def _model(g: torch.Generator) -> nn.Module:
    # chapter 05's two_models architecture, initialised from `g` alone: the grader judges in
    # threads, so nothing here may touch the global RNG (a meta model draws nothing)
    meta = nn.Sequential(nn.Linear(16, 32, device="meta"), nn.ReLU(), nn.Linear(32, 4, device="meta"))
    model = meta.to_empty(device="cpu")
    with torch.no_grad():
        for layer in (model[0], model[2]):
            bound = layer.in_features ** -0.5  # the bounds of nn.Linear's default initialisation
            layer.weight.uniform_(-bound, bound, generator=g)
            layer.bias.uniform_(-bound, bound, generator=g)
    return model


def _build(case: dict) -> tuple:
    """The case's two models, SGD optimizers (with momentum), scaler and batches, all from the case's seed."""
    g = torch.Generator().manual_seed(case["seed"])
    model0, model1 = _model(g), _model(g)
    opts = [torch.optim.SGD(m.parameters(), lr=case["lr"], momentum=0.9) for m in (model0, model1)]
    scaler = torch.amp.GradScaler("cpu", init_scale=case["init_scale"], growth_interval=case["growth_interval"])
    batches = [(torch.randn(case["batch"], 16, generator=g), torch.randn(case["batch"], 4, generator=g))
               for _ in range(case["iterations"])]
    return model0, model1, *opts, scaler, batches


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _record(case: dict, loop, dtype: torch.dtype) -> dict:
    """The kernel side: run the learner's `loop` on the case with its calls recorded; plain data."""
    model0, model1, opt0, opt1, scaler, batches = _build(case)
    with Recorder((model0, model1), (opt0, opt1), scaler, loop) as rec:
        loop(model0, model1, opt0, opt1, scaler, batches, case["max_norm"], dtype)
    calls = [[e.kind, e.index, e.info.get("owners", e.info.get("via_scaler"))] for e in rec.events if e.kind in KINDS]
    return {"params0": _flat(model0), "params1": _flat(model1), "scale": scaler.get_scale(), "calls": calls}


def _reference(case: dict, dtype: torch.dtype, mistake: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The grader side: the parameters a correct loop (or one with `mistake`) ends at. Nothing is
    wrapped here: the grader judges submissions in threads, and the Recorder patches torch globally."""
    model0, model1, opt0, opt1, scaler, batches = _build(case)
    reference_loop(model0, model1, opt0, opt1, scaler, batches, case["max_norm"], dtype, mistake)
    return _flat(model0), _flat(model1)


def reference_loop(model0, model1, opt0, opt1, scaler, batches, max_norm, dtype, mistake: str | None = None):
    """The correct loop; with `mistake`, the same loop with one known mistake (for the grader's explanations),
    or "summed", the other correct way: one backward of loss0 + loss1."""
    for x, y in batches:
        opt0.zero_grad()
        if mistake != "zero_between":
            opt1.zero_grad()
        with torch.autocast(x.device.type, dtype=dtype):
            out0, out1 = model0(x), model1(x)
            loss0 = F.mse_loss(2 * out0 + 3 * out1, y)
            loss1 = F.mse_loss(3 * out0 - 5 * out1, y)
        if mistake == "summed":  # also right: one backward of the sum needs no retain_graph
            scaler.scale(loss0 + loss1).backward()
        else:
            scaler.scale(loss0).backward(retain_graph=True)
            if mistake == "zero_between":
                opt1.zero_grad()
            scaler.scale(loss1).backward()
        if mistake != "no_clip":
            scaler.unscale_(opt0)
            nn.utils.clip_grad_norm_(model0.parameters(), max_norm)
        if mistake == "clip_both":
            scaler.unscale_(opt1)
            nn.utils.clip_grad_norm_(model1.parameters(), max_norm)
        scaler.step(opt0)
        scaler.step(opt1)
        scaler.update()


MISTAKES = {
    "zero_between": "opt1.zero_grad() runs between the two backward() calls: model1 loses loss0's gradient. Clear "
                    "both optimizers' gradients once, before the forward",
    "no_clip": "model0's gradients are not clipped: scaler.unscale_(opt0), then clip_grad_norm_(model0's "
               "parameters, max_norm)",
    "clip_both": "model1's gradients are clipped too: clip model0's only (and unscale only opt0)",
}


def _calls_message(calls: list, iterations: int) -> str | None:
    """What is wrong with the sequence of calls, in words; None if nothing."""
    updates = sum(k == "update" for k, _, _ in calls)
    if updates != iterations:
        return (f"scaler.update() ran {updates} times in {iterations} iterations: call it exactly once per "
                "iteration, after scaler.step() of both optimizers")
    direct = sorted({i for k, i, via in calls if k == "step" and not via})
    if direct:
        return (f"opt{direct[0]}.step() was called directly: with a GradScaler its gradients are still multiplied "
                "by the scale, and inf/NaN steps are not skipped. Use scaler.step(opt" f"{direct[0]})")
    for i in (0, 1):
        n = sum(k == "scaler.step" and j == i for k, j, _ in calls)
        if n != iterations:
            return f"scaler.step(opt{i}) ran {n} times in {iterations} iterations: once per iteration for each"
    stepped: set[int] = set()
    unscaled: set[int] = set()
    for kind, i, extra in calls:
        if kind == "scaler.step":
            stepped.add(i)
            unscaled.add(i)
        elif kind == "unscale_":
            unscaled.add(i)
        elif kind == "clip" and 0 in extra and 0 not in unscaled:
            return ("model0's gradients were clipped before scaler.unscale_(opt0): they were still multiplied by the "
                    "scale, so clipping cut them far too much. Unscale first, then clip")
        elif kind == "update":
            if stepped != {0, 1}:
                return ("scaler.update() ran before scaler.step(opt1): update() may change the scale, and opt1's "
                        "gradients, scaled with the old one, are then unscaled with the new one. Step both "
                        "optimizers, then update once")
            stepped, unscaled = set(), set()
    return None


def _close(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor) -> tuple[bool, float]:
    """Do two runs end at the same parameters? Measured on the change from the start, relatively."""
    if not torch.isfinite(got).all():
        return False, float("inf")
    err = ((got - want).norm() / (want - start).norm().clamp_min(1e-12)).item()
    return err < 2e-2, err


@register
class FixTwoModels(Check):
    name, args, points = "05.fix_two_models", ("train_two_models",), 4
    hint = ("Per iteration: zero both optimizers' gradients; forward and both losses under autocast; "
            "scaler.scale(loss0).backward(retain_graph=True); scaler.scale(loss1).backward(); "
            "scaler.unscale_(opt0); clip model0's gradients; scaler.step(opt0); scaler.step(opt1); "
            "scaler.update() once, last.")
    forbidden = ("course_lib.chapters.multi",)
    forbidden_why = "fix the loop yourself instead of calling chapter 05's two_model_step"
    time_limit = 60.0

    def cases(self, rng: random.Random) -> list:
        dtype = str(amp_mode("cpu").dtype).removeprefix("torch.")
        return [{"seed": rng.getrandbits(31), "iterations": rng.randint(4, 6), "batch": rng.choice([8, 16, 32]),
                 "lr": rng.uniform(0.01, 0.05), "max_norm": rng.uniform(0.05, 0.3), "dtype": dtype,
                 "init_scale": 2.0 ** scale_exp, "growth_interval": rng.choice([1, 2, 3])}
                for scale_exp in (rng.randint(6, 10), rng.randint(12, 14), 16)]  # the last overflows at first

    def run(self, case: dict, train_two_models) -> object:
        return _record(case, train_two_models, getattr(torch, case["dtype"]))

    def describe(self, case: dict) -> str:
        return (f"train_two_models on {case['iterations']} batches (seed {case['seed']}, init_scale "
                f"{case['init_scale']:g}, growth_interval {case['growth_interval']})")

    def judge(self, cases: list, results: list) -> None:
        for case, got in zip(cases, results):
            where = self.describe(case)
            if not (isinstance(got, dict) and {"params0", "params1", "calls"} <= set(got)):
                raise CheckFailure(f"{where}: the check could not read the run ({got!r:.80})")
            why = _calls_message(got["calls"], case["iterations"])
            if why:
                raise CheckFailure(f"{where}: {why}")
            dtype = getattr(torch, case["dtype"])
            summed = sum(k == "backward" for k, _, _ in got["calls"]) == case["iterations"]
            want = _reference(case, dtype, "summed" if summed else None)
            start = [_flat(m) for m in _build(case)[:2]]
            mine = [torch.tensor(got[k]["array"], dtype=torch.float32) for k in ("params0", "params1")]
            checks = [_close(mine[i], want[i], start[i]) for i in (0, 1)]
            if all(ok for ok, _ in checks):
                continue
            for mistake, text in MISTAKES.items():
                variant = _reference(case, dtype, mistake)
                if all(_close(mine[i], variant[i], start[i])[0] for i in (0, 1)):
                    raise CheckFailure(f"{where}: the parameters match a loop in which {text}")
            i = 0 if not checks[0][0] else 1
            raise CheckFailure(f"{where}: after {case['iterations']} iterations model{i}'s parameters differ from a "
                               f"correct loop's (by {checks[i][1]:.3g} of the change a correct loop makes). Compare "
                               "your loop with the hint, line by line")
