"""Checks for exercise 03 (GradScaler). The references run in the grader's process: task 1 drives a
real torch.amp.GradScaler("cpu") through the overflow pattern it drew, task 2 runs a correct
unscale-clip-step-update loop on the same model, data and scaler settings it drew."""
from __future__ import annotations

import contextlib
import math
import random
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...chapters.scaler import f32, torch_trajectory
from ..grading import Check, CheckFailure, register

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

_KERNELS = ("_amp_update_scale_", "_amp_foreach_non_finite_check_and_unscale_")


@contextlib.contextmanager
def _kernels_off() -> Iterator[None]:
    """While the learner's function runs, torch's own scaler kernels raise (the probe cannot see them:
    they are C functions of module `torch`, like every other torch function)."""
    saved = {name: getattr(torch, name) for name in _KERNELS}

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("GradScaler's own kernels (torch._amp_update_scale_ ...) are switched off while your "
                           "function is checked: write the rule yourself")

    for name in _KERNELS:
        setattr(torch, name, refuse)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)


def _factor(rng: random.Random, low: float, high: float) -> float:
    return round(rng.uniform(low, high), rng.randint(1, 6))


@register
class UpdateScale(Check):
    name, args, points = "03.update_scale", ("update_scale",), 3
    hint = ("On an overflow: scale = to_float32(scale * backoff_factor), tracker = 0. Otherwise t = tracker + 1; "
            "if t == growth_interval (equality, not >=): tracker = 0 and the scale becomes "
            "to_float32(scale * growth_factor) unless that is inf; else tracker = t. Multiply the Python floats "
            "(double precision) and round once to float32.")
    forbidden = ("torch.amp", "torch.cuda.amp", "course_lib")
    forbidden_why = "implement the rule instead of running GradScaler (or course_lib's DynamicLossScaler)"
    time_limit = 30.0

    def cases(self, rng: random.Random) -> list:
        kinds = ["defaults", "odd factors", "odd factors", "odd init", "interval 1", "tracker past the interval",
                 "the top", "toward zero", "odd factors", "defaults"]
        cases = []
        for kind in kinds:
            gi = 1 if kind == "interval 1" else rng.randint(2, 12)
            case = {"kind": kind, "init_scale": 2.0 ** rng.randint(4, 24), "growth_factor": 2.0,
                    "backoff_factor": 0.5, "growth_interval": gi, "growth_tracker": 0}
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
                case["found_inf"][:gi + 1] = [False] * (gi + 1)
            cases.append(case)
        rng.shuffle(cases)
        return cases

    def run(self, case: dict, update_scale) -> object:
        scale, tracker, out = case["init_scale"], case["growth_tracker"], []
        with _kernels_off():
            for found_inf in case["found_inf"]:
                result = update_scale(scale, tracker, found_inf, case["growth_factor"], case["backoff_factor"],
                                      case["growth_interval"])
                if not (isinstance(result, (tuple, list)) and len(result) == 2):
                    return {"bad_return": repr(result)[:80], "at": len(out)}
                scale, tracker = result
                out.append([scale, tracker])
        return out

    def describe(self, case: dict) -> str:
        return (f"init_scale={case['init_scale']!r}, growth_factor={case['growth_factor']!r}, "
                f"backoff_factor={case['backoff_factor']!r}, growth_interval={case['growth_interval']}"
                + (f", tracker starting at {case['growth_tracker']}" if case["growth_tracker"] else ""))

    def judge(self, cases: list, results: list) -> None:
        for case, got in zip(cases, results):
            where = self.describe(case)
            if isinstance(got, dict):
                raise CheckFailure(f"with {where}: update_scale returned {got.get('bad_return')} at step "
                                   f"{got.get('at', 0) + 1}; expected a pair (new_scale, new_tracker)")
            want = torch_trajectory(case["found_inf"], case["init_scale"], case["growth_factor"],
                                    case["backoff_factor"], case["growth_interval"], case["growth_tracker"])
            scale, tracker = case["init_scale"], case["growth_tracker"]
            for i, (pair, (w_scale, w_tracker)) in enumerate(zip(got, want)):
                g_scale, g_tracker = pair
                numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (g_scale, g_tracker))
                if not numbers or g_scale != w_scale or g_tracker != w_tracker:
                    why = self._why(case, case["found_inf"][i], scale, tracker, g_scale, g_tracker, w_scale, w_tracker)
                    raise CheckFailure(
                        f"with {where}: at step {i + 1} (found_inf={case['found_inf'][i]}, scale {scale!r}, "
                        f"tracker {tracker}) torch's GradScaler gives ({w_scale!r}, {w_tracker}), "
                        f"update_scale returned ({g_scale!r}, {g_tracker!r}). {why}")
                scale, tracker = w_scale, w_tracker

    @staticmethod
    def _why(case: dict, inf: bool, scale: float, tracker: int, g_scale: object, g_tracker: object,
             w_scale: float, w_tracker: int) -> str:
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (g_scale, g_tracker)):
            return "Return two numbers: the new scale (a float) and the new tracker (an int)."
        gi, factor = case["growth_interval"], case["backoff_factor"] if inf else case["growth_factor"]
        if math.isinf(g_scale) and not math.isinf(w_scale):
            return "The scale never grows to inf: if the grown scale would be inf, keep the old one."
        changed = inf or (tracker + 1 == gi and w_scale != scale)  # torch multiplied the scale by `factor`
        if g_scale == scale * factor and f32(g_scale) != g_scale:  # a double that is no float32
            return ("The scale is a float32 in torch: round the double product to float32 "
                    "(to_float32(scale * factor))" + (", which is inf here, so the growth is refused."
                                                      if math.isinf(f32(g_scale)) else "."))
        if changed and g_scale == f32(scale * f32(factor)) and g_scale != w_scale:
            return ("Multiply in double precision and round once: torch's kernel computes float32 x double in "
                    "double, not float32 x float32(factor).")
        if g_scale == w_scale:  # only the tracker is wrong
            return ("The scale is right; the tracker " + (
                "restarts at 0 after an overflow." if inf else
                "restarts at 0 when tracker + 1 reaches growth_interval (also when the growth is refused "
                "because the scale would become inf)." if tracker + 1 == gi else "counts clean steps: tracker + 1."))
        if inf:
            return "An overflow multiplies the scale by backoff_factor and resets the tracker to 0."
        if tracker + 1 > gi and g_scale != scale:
            return (f"The tracker ({tracker}) is already past growth_interval ({gi}): torch tests "
                    "tracker + 1 == growth_interval, with ==, so the scale does not grow.")
        if tracker + 1 < gi and g_scale != scale:
            return (f"Only {tracker + 1} clean step(s) in a row: the scale grows when tracker + 1 reaches "
                    f"growth_interval ({gi}), not before.")
        if g_scale == scale:
            return (f"This was clean step number {tracker + 1} in a row, equal to growth_interval: time to grow "
                    "by growth_factor and reset the tracker.")
        return "Compare your rule with the task's description step by step."


# --------------------------------------------------------------------------- task 2

IN, HIDDEN, OUT, BATCH = 6, 12, 4, 16


def _model(case: dict) -> nn.Module:
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    with torch.no_grad():
        for p, w in zip(model.parameters(), case["weights"]):
            p.copy_(torch.tensor(w, dtype=torch.float32))
    return model


def _steps(case: dict, step_fn) -> list[dict]:
    """Train a fresh copy of the case's model with `step_fn` doing the optimizer step; record each step."""
    model = _model(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=case["lr"], momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=case["init_scale"], growth_interval=case["growth_interval"])
    out = []
    for x, y in zip(case["x"], case["y"]):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(torch.tensor(x)), torch.tensor(y))
        norm = step_fn(model, optimizer, scaler, loss, case["max_norm"])
        out.append({"norm": float(norm) if isinstance(norm, (int, float, torch.Tensor)) else repr(norm)[:60],
                    "scale": scaler.get_scale(),
                    "params": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
                    "grads": [None if p.grad is None else p.grad.flatten().tolist() for p in model.parameters()]})
    return out


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
    hint = ("After scaler.scale(loss).backward(), the gradients are multiplied by the scale: call "
            "scaler.unscale_(optimizer) before torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), "
            "then scaler.step(optimizer) (it skips the step on inf/NaN) and scaler.update(); return the norm "
            "clip_grad_norm_ returns.")
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
            model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
            weights = [(torch.randn(p.shape, generator=g) * 0.5).tolist() for p in model.parameters()]
            cases.append({"weights": weights, "x": xs, "y": torch.randint(0, OUT, (steps, BATCH), generator=g).tolist(),
                          "init_scale": 2.0 ** rng.randint(2, 6), "growth_interval": rng.randint(2, 3),
                          "max_norm": rng.choice([0.05, 0.1] if k == 0 else [0.05, 0.1, 0.2, 0.5, 1.0, 100.0]),
                          "lr": rng.choice([0.05, 0.1])})
        return cases

    def run(self, case: dict, clipped_step) -> object:
        return _steps(case, clipped_step)

    def describe(self, case: dict) -> str:
        return (f"clipped_step on {len(case['x'])} steps (max_norm={case['max_norm']}, "
                f"init_scale={case['init_scale']:g}, growth_interval={case['growth_interval']})")

    def judge(self, cases: list, results: list) -> None:
        for case, got in zip(cases, results):
            want, where = _steps(case, _reference_step), self.describe(case)
            for i, (g, w) in enumerate(zip(got, want)):
                at = f"{where}, step {i + 1}"
                if isinstance(g["norm"], str):
                    raise CheckFailure(f"{at}: clipped_step returned {g['norm']}; return the norm that "
                                       "clip_grad_norm_ returns")
                used = want[i - 1]["scale"] if i else case["init_scale"]
                w_norm, g_norm = w["norm"], g["norm"]
                finite = math.isfinite(w_norm)
                if finite and not math.isclose(g_norm, w_norm, rel_tol=1e-4, abs_tol=1e-7):
                    if math.isclose(g_norm, w_norm * used, rel_tol=1e-3):
                        why = ("that is the norm times the scale: clip_grad_norm_ saw scaled gradients. Call "
                               "scaler.unscale_(optimizer) before clipping")
                    elif g_norm <= case["max_norm"] * 1.0001 < w_norm:
                        why = "that is the norm after clipping; return what clip_grad_norm_ returns"
                    else:
                        why = "the norm of the unscaled gradients, before clipping, is asked for"
                    raise CheckFailure(f"{at}: clipped_step returned a gradient norm of {g_norm:.6g}, expected "
                                       f"{w_norm:.6g}: {why}.")
                if g["scale"] != w["scale"]:
                    why = ("the scale never changed: call scaler.update() once after scaler.step(optimizer)"
                           if all(s["scale"] == case["init_scale"] for s in got[: i + 1]) else
                           "call scaler.step(optimizer) and then scaler.update() exactly once per step")
                    raise CheckFailure(f"{at}: the scaler's scale is {g['scale']:g} after the step, expected "
                                       f"{w['scale']:g}: {why}.")
                if not _close(g["params"], w["params"]):
                    if any(math.isnan(v) for v in g["params"]) and not finite:
                        why = ("this step's gradients were inf/NaN and were applied: use scaler.step(optimizer), "
                               "which skips the step then, instead of optimizer.step()")
                    elif finite and w_norm > case["max_norm"]:
                        why = ("the update has the wrong size: clip the unscaled gradients (scaler.unscale_ before "
                               "clip_grad_norm_) to max_norm")
                    else:
                        why = "the parameters differ from those of a correct loop"
                    raise CheckFailure(f"{at}: {why}.")
                cleared = all(a is None or not any(a) for a in g["grads"])  # zero_grad() at the end is fine
                if finite and not cleared and not all(
                        b is not None and a is not None and _close(a, b) for a, b in zip(g["grads"], w["grads"])):
                    raise CheckFailure(f"{at}: after the step the .grad tensors are not the unscaled, clipped "
                                       "gradients (unscale_ once, then clip_grad_norm_, then step)")
