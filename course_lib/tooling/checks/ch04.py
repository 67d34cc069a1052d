"""Checks for exercise 04 (gradient accumulation).

The grader draws each case as plain data: a model seed and size, micro-batch sizes (ragged in
some cases), the loss, the precision. The kernel builds the model and micro-batches from it, runs
the learner's loop with an optimizer that records the gradients it is asked to apply and counts
its steps, and a GradScaler that counts update() calls. The grader rebuilds the same model and
data, computes the large batch's gradient in the same precision, and compares.
"""
from __future__ import annotations

import random

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..grading import Check, CheckFailure, register

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
LOSSES = {"cross_entropy": F.cross_entropy, "mse_loss": F.mse_loss}
# Accumulated and large-batch gradients add the same terms in a different order, and under
# autocast each micro-batch's weight gradient leaves a 16-bit matmul rounded to 16 bits before
# it is summed in fp32: they agree to a few units of the precision's epsilon (chapter 04, §3,
# measures about 1 eps in fp32 and 0.3 eps in bf16 and fp16). Every mistake the hints name
# moves the gradient by 10% or more.
TOLERANCE = {"fp32": 32 * torch.finfo(torch.float32).eps, "bf16": 4 * torch.finfo(torch.bfloat16).eps,
             "fp16": 4 * torch.finfo(torch.float16).eps}


def _build(case: dict) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(case["seed"])
    model = nn.Sequential(nn.Linear(case["features"], case["hidden"]), nn.Tanh(),
                          nn.Linear(case["hidden"], case["classes"]))
    g = torch.Generator().manual_seed(case["seed"] + 1)
    n = sum(case["sizes"])
    x = torch.randn(n, case["features"], generator=g)
    y = (torch.randint(0, case["classes"], (n,), generator=g) if case["loss"] == "cross_entropy"
         else torch.randn(n, case["classes"], generator=g))
    return model, list(zip(x.split(case["sizes"]), y.split(case["sizes"])))


class _RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps the gradients of its first step and counts its steps."""
    calls: int = 0
    first: list | None = None

    def step(self, closure=None):
        self.calls += 1
        if self.first is None:
            self.first = [p.grad.detach().flatten().tolist() if p.grad is not None else None
                          for g in self.param_groups for p in g["params"]]
        return super().step(closure)


class _CountingScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler that counts update() calls."""
    updates: int = 0

    def update(self, new_scale=None):
        self.updates += 1
        return super().update(new_scale)


def _grad(case: dict, weights: list[float] | None = None, large: bool = False, double: bool = False,
          junk: bool = False) -> torch.Tensor:
    """The summed gradient of weight_i * loss_i over the case's micro-batches (or of the large batch)."""
    model, micro = _build(case)
    if double:
        model, micro = model.double(), [(x.double(), y.double() if y.is_floating_point() else y) for x, y in micro]
    if large:
        micro, weights = [(torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))], [1.0]
    dtype = None if double else DTYPES[case["precision"]]
    scaler = torch.amp.GradScaler("cpu", init_scale=case["init_scale"], enabled=dtype == torch.float16)
    for (x, y), w in zip(micro, weights):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = LOSSES[case["loss"]](model(x), y) * w
        scaler.scale(loss).backward()
    g = torch.cat([p.grad.flatten().double() for p in model.parameters()]) / scaler.get_scale()
    return g + _junk(case).double() if junk else g


def _junk(case: dict) -> torch.Tensor:
    """What .grad holds before the learner's function runs: it must not count."""
    model, _ = _build(case)
    g = torch.Generator().manual_seed(case["seed"] + 2)
    return torch.cat([torch.randn(p.numel(), generator=g) for p in model.parameters()])


@register
class Accumulate(Check):
    name, args, points = "04.accumulate", ("accumulate",), 4
    hint = ("Zero the gradients first. For each micro-batch: forward and loss under torch.autocast(device_type, "
            "dtype=dtype, enabled=dtype is not None); multiply the loss by len(y) / (total samples) — loss / N "
            "when all N micro-batches have the same size; scaler.scale(loss).backward(), outside autocast. After "
            "the loop, once: scaler.step(optimizer), then scaler.update().")
    forbidden = ("course_lib.chapters", "course_lib.train")
    forbidden_why = "write the loop yourself instead of calling chapter 04's accumulation_step or the Trainer"
    time_limit = 60.0

    def cases(self, rng: random.Random) -> list:
        precisions = ["fp32", "fp32", "fp32", "fp16", "fp16", "fp16", "bf16", "bf16"]
        cases = []
        for i, precision in enumerate(precisions):
            n, size = rng.randint(2, 5), rng.randint(4, 10)
            sizes = [size] * n
            if i % 3 != 2:  # ragged: a short last micro-batch, as at the end of an epoch
                sizes[-1] = rng.randint(1, size // 2)
            if i == 0:  # sizes that all differ
                sizes = [rng.randint(1, 12) for _ in range(n)]
                while len(set(sizes)) < 2:
                    sizes[0] = rng.randint(1, 12)
            cases.append({"seed": rng.getrandbits(31), "features": rng.randint(3, 12), "hidden": rng.randint(4, 16),
                          "classes": rng.randint(2, 5), "sizes": sizes, "precision": precision,
                          "loss": "mse_loss" if rng.random() < 0.25 else "cross_entropy",
                          "init_scale": 2.0 ** rng.randint(6, 12)})
        rng.shuffle(cases)
        return cases

    def run(self, case: dict, accumulate) -> object:
        model, micro = _build(case)
        junk = _junk(case)
        with torch.no_grad():
            for p, j in zip(model.parameters(), junk.split([p.numel() for p in model.parameters()])):
                p.grad = j.view_as(p).clone()
        seen: list[str] = []  # the dtype the first layer computes in: tells whether autocast was on
        model[0].register_forward_hook(lambda module, args, out: seen.append(str(out.dtype)))
        optimizer = _RecordingSGD(model.parameters(), lr=0.1)
        scaler = _CountingScaler("cpu", init_scale=case["init_scale"], enabled=case["precision"] == "fp16")
        accumulate(model, optimizer, scaler, micro, LOSSES[case["loss"]], DTYPES[case["precision"]])
        return {"grads": optimizer.first, "steps": optimizer.calls, "updates": scaler.updates,
                "forward_dtypes": sorted(set(seen))}

    def describe(self, case: dict) -> str:
        dtype = str(DTYPES[case["precision"]])  # "None", "torch.float16", "torch.bfloat16"
        return (f"accumulate(model, optimizer, scaler, micro-batches of sizes {case['sizes']}, "
                f"F.{case['loss']}, dtype={dtype})")

    def judge(self, cases: list, results: list) -> None:
        for case, got in zip(cases, results):
            where = self.describe(case)
            if not isinstance(got, dict) or not {"grads", "steps", "updates", "forward_dtypes"} <= set(got):
                raise CheckFailure(f"{where}: the check could not read what your function did ({got!r})")
            steps, updates, fp16 = got["steps"], got["updates"], case["precision"] == "fp16"
            computed = str(DTYPES[case["precision"]] or torch.float32)
            if got["forward_dtypes"] != [computed]:
                raise CheckFailure(f"{where}: the model's first layer computed in {got['forward_dtypes']!r}, expected "
                                   f"['{computed}']: run forward and loss under torch.autocast(device_type, "
                                   "dtype=dtype, enabled=dtype is not None)")
            if steps == 0:
                raise CheckFailure(f"{where}: optimizer.step() never ran. Call scaler.step(optimizer) once, after "
                                   "the last micro-batch" + (" (with the scaler on, an inf or NaN in the gradients "
                                                             "makes it skip the step: were they scaled twice?)"
                                                             if fp16 else ""))
            if steps > 1:
                raise CheckFailure(f"{where}: optimizer.step() ran {steps} times for {len(case['sizes'])} "
                                   "micro-batches; accumulation means one step, after the last micro-batch")
            if fp16 and updates != 1:
                raise CheckFailure(f"{where}: scaler.update() ran {updates} times; call it once per optimizer step, "
                                   "after scaler.step: the scale must stay the same while gradients accumulate")
            grads = got["grads"]
            if not isinstance(grads, list) or any(g is None for g in grads):
                raise CheckFailure(f"{where}: some parameters had no gradient when the optimizer stepped")
            g = torch.tensor([v for part in grads for v in part], dtype=torch.float64)
            want = _grad(case, large=True)
            if g.shape != want.shape or not torch.isfinite(g).all():
                raise CheckFailure(f"{where}: the optimizer was handed gradients with infs or NaNs, or of a wrong "
                                   "size")
            err = ((g - want).norm() / want.norm()).item()
            tol = TOLERANCE[case["precision"]]
            if err > tol:
                raise CheckFailure(f"{where}: the gradients at optimizer.step() differ from the large batch's by "
                                   f"{err:.3g} (relative; rounding allows {tol:.2g}). {self._diagnose(case, g)}")

    def _diagnose(self, case: dict, g: torch.Tensor) -> str:
        """Name the mistake whose gradient (computed here, in float64) the learner's is closest to."""
        sizes, n = case["sizes"], len(case["sizes"])
        total = sum(sizes)
        right = [s / total for s in sizes]
        suspects = {
            "Each micro-batch's loss must be multiplied by len(y) / total (loss / N only when all sizes are "
            "equal): a short last micro-batch must count less.": [1 / n] * n,
            "The loss was not divided: the gradient is the sum over the micro-batches, not their "
            "average.": [1.0] * n,
            "Only the last micro-batch counted: is zero_grad() inside the micro-batch loop?": [0.0] * (n - 1)
            + [right[-1]],
        }
        candidates = [(msg, _grad(case, w, double=True)) for msg, w in suspects.items()]
        candidates.append(("The gradients already in .grad before the call were kept: zero the gradients first.",
                           _grad(case, right, double=True, junk=True)))
        best, dist = min(((msg, ((g - c).norm() / c.norm()).item()) for msg, c in candidates), key=lambda t: t[1])
        return best if dist < 0.05 else "Compare your loop with the hint."
