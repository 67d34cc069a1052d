"""Checks for exercise 05 (several models, losses and optimizers under one GradScaler).

Graded by behaviour. The grader draws seeds, sizes and scaler settings (the last case's initial
scale overflows fp16 at first, and in the middle one opt1's gradients often overflow while opt0's
do not, so each optimizer must skip on its own); the task process (course_lib/tooling/probes/
ch05.py) builds the two models, optimizers, scaler and batches from them, runs the learner's loop
with its calls recorded, and returns the final parameters, the scale, the steps each optimizer
really took and the calls, each with the autocast state it ran in. The grader checks the calls
(one update per iteration, after both steps; every optimizer through the scaler; clipping after
unscale_; backward, unscale_, clipping, steps and update outside autocast), runs a correct loop
on the same case and compares the parameters, the steps taken and the scale; where the
parameters differ, it runs loops with one known mistake each to say which one it is.
"""

from __future__ import annotations

import random

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...chapters.ch05.multi import amp_mode
from ..checkbase import Check, CheckFailure, expect_dict, expect_list, expect_number, expect_numbers, register
from ..probes.ch05 import KINDS, build, flat

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

# the calls that must run outside autocast (zero_grad may run anywhere), as the messages name them
OUTSIDE = {
    "backward": "backward()",
    "unscale_": "scaler.unscale_()",
    "clip": "clip_grad_norm_()",
    "scaler.step": "scaler.step()",
    "step": "the optimizer step",
    "update": "scaler.update()",
}


def _reference(case: dict, dtype: torch.dtype, mistake: str | None = None) -> dict:
    """The grader side: where a correct loop (or one with `mistake`) ends: parameters, steps taken, scale.
    Nothing is wrapped here: the grader judges submissions in threads, and the Recorder patches torch globally."""
    model0, model1, opt0, opt1, scaler, batches = build(case)
    reference_loop(model0, model1, opt0, opt1, scaler, batches, case["max_norm"], dtype, mistake)
    return {"params": (flat(model0), flat(model1)), "steps": [opt0.taken, opt1.taken], "scale": scaler.get_scale()}


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
    updates = sum(k == "update" for k, _, _, _ in calls)
    if updates != iterations:
        return (
            f"scaler.update() ran {updates} times in {iterations} iterations: call it exactly once per "
            "iteration, after scaler.step() of both optimizers"
        )
    direct = sorted({i for k, i, via, _ in calls if k == "step" and not via})
    if direct:
        return (
            f"opt{direct[0]}.step() was called directly: with a GradScaler its gradients are still multiplied "
            "by the scale, and inf/NaN steps are not skipped. Use scaler.step(opt"
            f"{direct[0]})"
        )
    for i in (0, 1):
        n = sum(k == "scaler.step" and j == i for k, j, _, _ in calls)
        if n != iterations:
            return f"scaler.step(opt{i}) ran {n} times in {iterations} iterations: once per iteration for each"
    stepped: set[int] = set()
    unscaled: set[int] = set()
    for kind, i, extra, _ in calls:
        if kind == "scaler.step":
            stepped.add(i)
            unscaled.add(i)
        elif kind == "unscale_":
            unscaled.add(i)
        elif kind == "clip" and 0 in extra and 0 not in unscaled:
            return (
                "model0's gradients were clipped before scaler.unscale_(opt0): they were still multiplied by the "
                "scale, so clipping cut them far too much. Unscale first, then clip"
            )
        elif kind == "update":
            if stepped != {0, 1}:
                return (
                    "scaler.update() ran before scaler.step(opt1): update() may change the scale, and opt1's "
                    "gradients, scaled with the old one, are then unscaled with the new one. Step both "
                    "optimizers, then update once"
                )
            stepped, unscaled = set(), set()
    return None


def _autocast_message(calls: list) -> str | None:
    """Which calls ran inside autocast that belong after it, in words; None if none did."""
    inside = [OUTSIDE[k] for k, _, _, on in calls if on and k in OUTSIDE]
    if not inside:
        return None
    names = ", ".join(dict.fromkeys(inside))  # each name once, in the order they first ran
    return (
        f"{len(inside)} calls ran with autocast on ({names}): only the forward passes and the losses go inside "
        "`with torch.autocast(...)`; backward, unscale_, clipping, the steps and update() come after the block "
        "(chapter 02: autocast is for the forward pass)"
    )


def _expect_calls(value: object, where: str) -> list:
    """The recorded calls: [kind, optimizer index or None, details, autocast on?] each, of known kinds."""
    calls = expect_list(value, f"{where}: the recorded calls")
    for n, call in enumerate(calls):
        kind, index, extra, on = expect_list(call, f"{where}: recorded call {n + 1}", 4)
        if kind not in KINDS or not isinstance(on, bool) or not (index is None or index in (0, 1)):
            raise CheckFailure(
                f"{where}: recorded call {n + 1}: expected [one of {list(KINDS)}, 0, 1 or None, "
                f"details, True/False], got {call!r:.80}"
            )
        if kind == "clip" and not (isinstance(extra, list) and all(i in (0, 1) for i in extra)):
            raise CheckFailure(
                f"{where}: recorded call {n + 1}: expected the optimizers owning the clipped "
                f"parameters, got {extra!r:.60}"
            )
    return calls


def _expect_params(value: object, where: str, size: int) -> torch.Tensor:
    array = expect_dict(value, where, ("array",))["array"]
    return torch.tensor(expect_numbers(array, where, size, finite=False), dtype=torch.float32)


def _close(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor) -> tuple[bool, float]:
    """Do two runs end at the same parameters? Measured on the change from the start, relatively."""
    if not torch.isfinite(got).all():
        return False, float("inf")
    err = ((got - want).norm() / (want - start).norm().clamp_min(1e-12)).item()
    return err < 2e-2, err


@register
class FixTwoModels(Check):
    name, args, points = "05.fix_two_models", ("train_two_models",), 4
    hint = (
        "Per iteration: zero both optimizers' gradients; forward and both losses under autocast; "
        "scaler.scale(loss0).backward(retain_graph=True); scaler.scale(loss1).backward(); "
        "scaler.unscale_(opt0); clip model0's gradients; scaler.step(opt0); scaler.step(opt1); "
        "scaler.update() once, last. Everything after the losses runs outside the autocast block."
    )
    forbidden = ("course_lib.chapters.ch05.multi", "course_lib.chapters.ch05.article_two_models")
    forbidden_why = "fix the loop yourself instead of calling chapter 05's two_model_step"
    time_limit = 60.0

    def cases(self, rng: random.Random) -> list:
        dtype = str(amp_mode("cpu").dtype).removeprefix("torch.")
        cases = [
            {
                "seed": rng.getrandbits(31),
                "iterations": rng.randint(4, 6),
                "batch": rng.choice([8, 16, 32]),
                "lr": rng.uniform(0.01, 0.05),
                "max_norm": rng.uniform(0.05, 0.3),
                "dtype": dtype,
                "init_scale": 2.0**scale_exp,
                "growth_interval": rng.choice([1, 2, 3]),
            }
            for scale_exp in (rng.randint(6, 10), rng.randint(12, 14), 16)
        ]
        # The last case overflows fp16 at first, so that skipped steps are exercised: both optimizers of a
        # correct loop must skip at least once. 2^16 nearly always does; where it does not, double it.
        last = cases[-1]
        while (
            dtype == "float16"
            and last["init_scale"] < 2.0**24
            and max(_reference(last, torch.float16)["steps"]) == last["iterations"]
        ):
            last["init_scale"] *= 2
        return cases

    def describe(self, case: dict) -> str:
        return (
            f"train_two_models on {case['iterations']} batches (seed {case['seed']}, init_scale "
            f"{case['init_scale']:g}, growth_interval {case['growth_interval']})"
        )

    def judge(self, cases: list, results: list) -> None:
        expect_list(results, "the answers to the cases", len(cases))
        for case, got in zip(cases, results, strict=True):
            self._judge_one(case, got)

    def _judge_one(self, case: dict, got: object) -> None:
        where, n = self.describe(case), case["iterations"]
        got = expect_dict(got, f"{where}: the record of your loop", ("params0", "params1", "scale", "steps", "calls"))
        start = [flat(m) for m in build(case)[:2]]
        mine = [_expect_params(got[f"params{i}"], f"{where}: model{i}'s parameters", start[i].numel()) for i in (0, 1)]
        steps = [
            expect_number(s, f"{where}: the steps opt{i} took", integer=True)
            for i, s in enumerate(expect_list(got["steps"], f"{where}: the steps each optimizer took", 2))
        ]
        scale = expect_number(got["scale"], f"{where}: the scaler's scale")
        calls = _expect_calls(got["calls"], where)
        why = _calls_message(calls, n) or _autocast_message(calls)
        if why:
            raise CheckFailure(f"{where}: {why}")
        dtype = getattr(torch, case["dtype"])
        summed = sum(k == "backward" for k, _, _, _ in calls) == n
        want = _reference(case, dtype, "summed" if summed else None)
        checks = [_close(mine[i], want["params"][i], start[i]) for i in (0, 1)]
        if not all(ok for ok, _ in checks):
            for mistake, text in MISTAKES.items():
                variant = _reference(case, dtype, mistake)["params"]
                if all(_close(mine[i], variant[i], start[i])[0] for i in (0, 1)):
                    raise CheckFailure(f"{where}: the parameters match a loop in which {text}")
            i = 0 if not checks[0][0] else 1
            raise CheckFailure(
                f"{where}: after {n} iterations model{i}'s parameters differ from a "
                f"correct loop's (by {checks[i][1]:.3g} of the change a correct loop makes). Compare "
                "your loop with the hint, line by line"
            )
        for i in (0, 1):
            if steps[i] != want["steps"][i]:
                raise CheckFailure(
                    f"{where}: opt{i} took {steps[i]} steps in {n} iterations, a correct loop "
                    f"{want['steps'][i]}: scaler.step(opt{i}) skips the step exactly when opt{i}'s own "
                    "gradients hold inf or NaN, whatever the other optimizer's hold"
                )
        if scale != want["scale"]:
            raise CheckFailure(
                f"{where}: the scale is {scale:g} at the end, a correct loop's {want['scale']:g}: "
                "scaler.update() once per iteration, after both scaler.step() calls"
            )
