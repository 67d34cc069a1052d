"""Checks for exercise 03 (GradScaler). The references run in the grader's process: task 1 drives a
real torch.amp.GradScaler("cpu") through the overflow pattern it drew, task 2 runs a correct
unscale-clip-step-update loop on the same model, data and scaler settings it drew. The task side
(what runs the learner's functions) is course_lib/tooling/probes/ch03.py; every answer that comes
back is checked for its shape and type before it is compared."""

from __future__ import annotations

import math
import random

import torch
import torch.nn as nn

from ...chapters.ch03.scaler import f32, torch_trajectory
from ..checkbase import Check, CheckFailure, expect_dict, expect_list, expect_number, expect_numbers, register
from ..probes.ch03 import BATCH, HIDDEN, IN, OUT, train_steps

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name


def _factor(rng: random.Random, low: float, high: float) -> float:
    return round(rng.uniform(low, high), rng.randint(1, 6))


@register
class UpdateScale(Check):
    name, args, points = "03.update_scale", ("update_scale",), 3
    # Shown after every failed attempt, under the message that names the failing step: the idea to
    # look for, never the rule itself (the task states the rule; the learner writes it).
    hint = (
        "Sort the step the message names into one of the task's three cases: an overflow, the clean step "
        "that completes growth_interval clean steps in a row, or any other clean step. Then ask what that "
        "case does to the scale and to the count of clean steps, and when the scale is rounded to float32. "
        "Chapter 03, section 3, explains each case and the three details that decide a bit-for-bit match."
    )
    # torch._amp_update_scale_ is the op GradScaler.update() calls: the rule itself, in C++
    forbidden = ("torch.amp", "torch.cuda.amp", "torch._amp_update_scale_", "course_lib")
    forbidden_why = (
        "implement the rule instead of running GradScaler, its op torch._amp_update_scale_ or course_lib's "
        "DynamicLossScaler"
    )
    time_limit = 30.0

    def cases(self, rng: random.Random) -> list:
        kinds = [
            "defaults",
            "odd factors",
            "odd factors",
            "odd init",
            "interval 1",
            "tracker past the interval",
            "the top",
            "toward zero",
            "odd factors",
            "defaults",
        ]
        cases = []
        for kind in kinds:
            gi = 1 if kind == "interval 1" else rng.randint(2, 12)
            case = {
                "kind": kind,
                "init_scale": 2.0 ** rng.randint(4, 24),
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": gi,
                "growth_tracker": 0,
            }
            p = rng.uniform(0.1, 0.45)
            if kind in ("odd factors", "odd init", "interval 1", "the top", "toward zero"):
                case["growth_factor"], case["backoff_factor"] = _factor(rng, 1.05, 4.0), _factor(rng, 0.05, 0.95)
            if kind == "odd init":
                case["init_scale"] = f32(2.0 ** rng.uniform(-20, 40))
            if kind == "tracker past the interval":
                case["growth_tracker"] = gi + rng.randint(0, 6)
                p = 0.05
            if kind == "the top":  # the first growth would pass float32's largest value
                case["init_scale"], p = f32(3.4e38 / rng.uniform(1.0, case["growth_factor"])), 0.02
            if kind == "toward zero":
                case["init_scale"], p = f32(2.0 ** rng.uniform(-148, -120)), 0.9
            case["found_inf"] = [rng.random() < p for _ in range(rng.randint(60, 160))]
            if kind in ("tracker past the interval", "the top"):  # start clean, so that the point shows at once
                case["found_inf"][: gi + 1] = [False] * (gi + 1)
            cases.append(case)
        rng.shuffle(cases)
        return cases

    def describe(self, case: dict) -> str:
        return (
            f"init_scale={case['init_scale']!r}, growth_factor={case['growth_factor']!r}, "
            f"backoff_factor={case['backoff_factor']!r}, growth_interval={case['growth_interval']}"
            + (f", tracker starting at {case['growth_tracker']}" if case["growth_tracker"] else "")
        )

    def judge(self, cases: list, results: list) -> None:
        expect_list(results, "the answers to the cases", len(cases))
        for case, got in zip(cases, results):
            where = self.describe(case)
            if isinstance(got, dict):
                got = expect_dict(got, f"with {where}", ("bad_return", "at"))
                raise CheckFailure(
                    f"with {where}: update_scale returned {got['bad_return']} at step "
                    f"{expect_number(got['at'], 'the step', integer=True) + 1}; expected a pair "
                    "(new_scale, new_tracker)"
                )
            steps = len(case["found_inf"])
            expect_list(got, f"with {where}: the pairs (scale, tracker) after each of the {steps} steps", steps)
            want = torch_trajectory(
                case["found_inf"],
                case["init_scale"],
                case["growth_factor"],
                case["backoff_factor"],
                case["growth_interval"],
                case["growth_tracker"],
            )
            scale, tracker = case["init_scale"], case["growth_tracker"]
            for i, (pair, (w_scale, w_tracker)) in enumerate(zip(got, want, strict=True)):
                at = f"with {where}: at step {i + 1}"
                g_scale, g_tracker = expect_list(pair, f"{at}, update_scale's answer (new_scale, new_tracker)", 2)
                self._expect_pair(at, g_scale, g_tracker)
                if g_scale != w_scale or g_tracker != w_tracker:
                    why = self._why(case, case["found_inf"][i], scale, tracker, g_scale, g_tracker, w_scale, w_tracker)
                    raise CheckFailure(
                        f"{at} (found_inf={case['found_inf'][i]}, scale {scale!r}, "
                        f"tracker {tracker}) torch's GradScaler gives ({w_scale!r}, {w_tracker}), "
                        f"update_scale returned ({g_scale!r}, {g_tracker!r}). {why}"
                    )
                scale, tracker = w_scale, w_tracker

    @staticmethod
    def _expect_pair(at: str, g_scale: object, g_tracker: object) -> None:
        """Two numbers: a scale that is not NaN (inf is diagnosed by _why) and a finite whole tracker."""
        what = "Return two numbers: the new scale (a float) and the new tracker (an int)"
        try:
            expect_number(g_scale, f"{at}, the new scale", finite=False)
            expect_number(g_tracker, f"{at}, the new tracker")
        except CheckFailure as e:
            raise CheckFailure(f"{e}. {what}.") from None
        if math.isnan(g_scale):
            raise CheckFailure(f"{at}, the new scale: expected a finite float32 value, got nan. {what}.")
        if g_tracker != int(g_tracker):
            raise CheckFailure(f"{at}, the new tracker: expected a whole number of clean steps, got {g_tracker!r}")

    @staticmethod
    def _why(
        case: dict,
        inf: bool,
        scale: float,
        tracker: int,
        g_scale: object,
        g_tracker: object,
        w_scale: float,
        w_tracker: int,
    ) -> str:
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (g_scale, g_tracker)):
            return "Return two numbers: the new scale (a float) and the new tracker (an int)."
        gi, factor = case["growth_interval"], case["backoff_factor"] if inf else case["growth_factor"]
        if math.isinf(g_scale) and not math.isinf(w_scale):
            return "The scale never grows to inf: if the grown scale would be inf, keep the old one."
        changed = inf or (tracker + 1 == gi and w_scale != scale)  # torch multiplied the scale by `factor`
        if g_scale == scale * factor and f32(g_scale) != g_scale:  # a double that is no float32
            return (
                "The scale is a float32 in torch: round the double product to float32 "
                "(to_float32(scale * factor))"
                + (", which is inf here, so the growth is refused." if math.isinf(f32(g_scale)) else ".")
            )
        if changed and g_scale == f32(scale * f32(factor)) and g_scale != w_scale:
            return (
                "Multiply in double precision and round once: torch's kernel computes float32 x double in "
                "double, not float32 x float32(factor)."
            )
        if g_scale == w_scale:  # only the tracker is wrong
            return "The scale is right; the tracker " + (
                "restarts at 0 after an overflow."
                if inf
                else "restarts at 0 when tracker + 1 reaches growth_interval (also when the growth is refused "
                "because the scale would become inf)."
                if tracker + 1 == gi
                else "counts clean steps: tracker + 1."
            )
        if inf:
            return "An overflow multiplies the scale by backoff_factor and resets the tracker to 0."
        if tracker + 1 > gi and g_scale != scale:
            return (
                f"The tracker ({tracker}) is already past growth_interval ({gi}): torch tests "
                "tracker + 1 == growth_interval, with ==, so the scale does not grow."
            )
        if tracker + 1 < gi and g_scale != scale:
            return (
                f"Only {tracker + 1} clean step(s) in a row: the scale grows when tracker + 1 reaches "
                f"growth_interval ({gi}), not before."
            )
        if g_scale == scale:
            return (
                f"This was clean step number {tracker + 1} in a row, equal to growth_interval: time to grow "
                "by growth_factor and reset the tracker."
            )
        return "Compare your rule with the task's description step by step."


# --------------------------------------------------------------------------- task 2


def _reference_step(model, optimizer, scaler, loss, max_norm):
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return norm


def _close(a: list, b: list, rtol: float = 1e-4, atol: float = 1e-6) -> bool:
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return ta.shape == tb.shape and bool(torch.allclose(ta, tb, rtol=rtol, atol=atol, equal_nan=True))


@register
class ClippedStep(Check):
    name, args, points = "03.clipped_step", ("clipped_step",), 3
    hint = (
        "After backward on a scaled loss every gradient is multiplied by the scale, so clipping them "
        "measures and clips the wrong numbers. The scaler can turn them back into true gradients in place, "
        "before you clip (chapter 03, section 6); let the scaler, not the optimizer, take the step, so that "
        "a step with inf or NaN gradients is skipped, and let it adjust the scale once per step."
    )
    forbidden, forbidden_why = ("course_lib",), "write the four calls yourself instead of calling the course's Trainer"
    time_limit = 60.0

    def cases(self, rng: random.Random) -> list:
        cases = []
        for k in range(5):
            g = torch.Generator().manual_seed(rng.getrandbits(31))
            steps = rng.randint(8, 11)
            bad = set(rng.sample(range(1, steps), rng.randint(1, 3)))  # batches holding a value fp16 turns into inf
            xs = []
            for i in range(steps):
                x = torch.randn(BATCH, IN, generator=g)
                if i in bad:
                    x[rng.randrange(BATCH), rng.randrange(IN)] = 1e6
                xs.append(x.tolist())
            shapes = [(HIDDEN, IN), (HIDDEN,), (OUT, HIDDEN), (OUT,)]  # the parameters of probes.ch03.case_model
            weights = [(torch.randn(shape, generator=g) * 0.5).tolist() for shape in shapes]
            cases.append(
                {
                    "weights": weights,
                    "x": xs,
                    "y": torch.randint(0, OUT, (steps, BATCH), generator=g).tolist(),
                    "init_scale": 2.0 ** rng.randint(2, 6),
                    "growth_interval": rng.randint(2, 3),
                    "max_norm": rng.choice([0.05, 0.1] if k == 0 else [0.05, 0.1, 0.2, 0.5, 1.0, 100.0]),
                    "lr": rng.choice([0.05, 0.1]),
                }
            )
        return cases

    def describe(self, case: dict) -> str:
        return (
            f"clipped_step on {len(case['x'])} steps (max_norm={case['max_norm']}, "
            f"init_scale={case['init_scale']:g}, growth_interval={case['growth_interval']})"
        )

    def judge(self, cases: list, results: list) -> None:
        expect_list(results, "the answers to the cases", len(cases))
        for case, got in zip(cases, results):
            want, where = train_steps(case, _reference_step), self.describe(case)
            expect_list(got, f"{where}: the record of each step", len(want))
            numels = [torch.tensor(w).numel() for w in case["weights"]]
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                at = f"{where}, step {i + 1}"
                g = _expect_step(g, at, numels)
                if isinstance(g["norm"], str):
                    raise CheckFailure(
                        f"{at}: clipped_step returned {g['norm']}; return the norm that clip_grad_norm_ returns"
                    )
                used = want[i - 1]["scale"] if i else case["init_scale"]
                w_norm, g_norm = w["norm"], g["norm"]
                finite = math.isfinite(w_norm)
                if finite:  # after an overflow any norm is right (inf or nan); else a finite one is expected
                    expect_number(g_norm, f"{at}: the norm clipped_step returned")
                if finite and not math.isclose(g_norm, w_norm, rel_tol=1e-4, abs_tol=1e-7):
                    if math.isclose(g_norm, w_norm * used, rel_tol=1e-3):
                        why = (
                            "that is the norm times the scale: clip_grad_norm_ saw scaled gradients. Call "
                            "scaler.unscale_(optimizer) before clipping"
                        )
                    elif g_norm <= case["max_norm"] * 1.0001 < w_norm:
                        why = "that is the norm after clipping; return what clip_grad_norm_ returns"
                    else:
                        why = "the norm of the unscaled gradients, before clipping, is asked for"
                    raise CheckFailure(
                        f"{at}: clipped_step returned a gradient norm of {g_norm:.6g}, expected {w_norm:.6g}: {why}."
                    )
                if g["scale"] != w["scale"]:
                    why = (
                        "the scale never changed: call scaler.update() once after scaler.step(optimizer)"
                        if all(s["scale"] == case["init_scale"] for s in got[: i + 1])
                        else "call scaler.step(optimizer) and then scaler.update() exactly once per step"
                    )
                    raise CheckFailure(
                        f"{at}: the scaler's scale is {g['scale']:g} after the step, expected {w['scale']:g}: {why}."
                    )
                if not _close(g["params"], w["params"]):
                    if not all(map(math.isfinite, g["params"])) and not finite:
                        why = (
                            "this step's gradients were inf/NaN and were applied: use scaler.step(optimizer), "
                            "which skips the step then, instead of optimizer.step()"
                        )
                    elif not all(map(math.isfinite, g["params"])):
                        why = "the parameters hold inf or NaN after a step whose gradients were finite"
                    elif finite and w_norm > case["max_norm"]:
                        why = (
                            "the update has the wrong size: clip the unscaled gradients (scaler.unscale_ before "
                            "clip_grad_norm_) to max_norm"
                        )
                    else:
                        why = "the parameters differ from those of a correct loop"
                    raise CheckFailure(f"{at}: {why}.")
                cleared = all(a is None or not any(a) for a in g["grads"])  # zero_grad() at the end is fine
                if (
                    finite
                    and not cleared
                    and not all(
                        b is not None and a is not None and _close(a, b)
                        for a, b in zip(g["grads"], w["grads"], strict=True)
                    )
                ):
                    raise CheckFailure(
                        f"{at}: after the step the .grad tensors are not the unscaled, clipped "
                        "gradients (unscale_ once, then clip_grad_norm_, then step)"
                    )


def _expect_step(got: object, at: str, numels: list[int]) -> dict:
    """One step's record as the probe makes it: {"norm": number or text, "scale": a finite number,
    "params": numbers (all parameters, flat), "grads": per parameter tensor None or its numbers}."""
    g = expect_dict(got, f"{at}: the record of the step", ("norm", "scale", "params", "grads"))
    if not isinstance(g["norm"], str):
        expect_number(g["norm"], f"{at}: the norm clipped_step returned", finite=False)
    expect_number(g["scale"], f"{at}: the scaler's scale after the step")
    expect_numbers(g["params"], f"{at}: the parameters after the step", sum(numels), finite=False)
    grads = expect_list(g["grads"], f"{at}: the .grad of each parameter tensor", len(numels))
    for k, (grad, n) in enumerate(zip(grads, numels, strict=True)):
        if grad is not None:
            expect_numbers(grad, f"{at}: the .grad of parameter tensor {k}", n, finite=False)
    return g
