"""Checks for exercise 04 (gradient accumulation).

The grader draws each case as plain data: a model seed and size, micro-batch sizes (ragged in
some cases), the loss, the precision, the scaler's initial scale (in one fp16 case so large that
the scaled gradients overflow, so that a correct loop must skip its step and back the scale off).
The probe (course_lib/tooling/probes/ch04.py) builds the model and micro-batches, runs the
learner's loop with an optimizer and a scaler that record what they are asked to do, and reports
each forward's batch size and the autocast state at each backward, step and update. The grader runs
its own correct loop through the same probe, computes the large batch's gradient in the same
precision, and compares.
"""

from __future__ import annotations

import math
import random

import torch

from ...chapters.ch04.accumulation import accumulated_grad
from ..checkbase import Check, CheckFailure, expect_dict, expect_list, expect_number, expect_numbers, register
from ..probes.ch04 import DTYPES, LOSSES, build, junk, run_loop

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

# Accumulated and large-batch gradients add the same terms in a different order, and under
# autocast each micro-batch's weight gradient leaves a 16-bit matmul rounded to 16 bits before
# it is summed in fp32: they agree to a few units of the precision's epsilon (chapter 04, §3,
# measures about 1 eps in fp32 and 0.3 eps in bf16 and fp16). Every mistake the hints name
# moves the gradient by 10% or more.
TOLERANCE = {
    "fp32": 32 * torch.finfo(torch.float32).eps,
    "bf16": 4 * torch.finfo(torch.bfloat16).eps,
    "fp16": 4 * torch.finfo(torch.float16).eps,
}
KEYS = (
    "grads",
    "steps",
    "updates",
    "forward_dtypes",
    "forward_sizes",
    "backward_autocast",
    "step_autocast",
    "update_autocast",
    "scale",
)


def _grad(case: dict, weights: list[float] | None = None, large: bool = False, double: bool = False) -> torch.Tensor:
    """The summed gradient of weight_i * loss_i over the case's micro-batches (or of the large batch):
    chapter 04's accumulated_grad on the case's model, batches, loss, precision and scale."""
    model, micro = build(case)
    if double:
        model, micro = model.double(), [(x.double(), y.double() if y.is_floating_point() else y) for x, y in micro]
    if large:
        micro, weights = [(torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))], [1.0]
    dtype = None if double else DTYPES[case["precision"]]
    scaler = torch.amp.GradScaler("cpu", init_scale=case["init_scale"], enabled=dtype == torch.float16)
    if weights is None or len(weights) != len(micro):
        raise ValueError(f"one weight per micro-batch: {len(micro)} micro-batches, weights {weights}")
    return accumulated_grad(model, micro, weights, loss_fn=LOSSES[case["loss"]], dtype=dtype, scaler=scaler)


def reference_accumulate(model, optimizer, scaler, micro_batches, loss_fn, dtype) -> None:
    """The correct loop (the solution's), run by the grader through the probe to learn what it does."""
    total = sum(len(y) for _, y in micro_batches)
    optimizer.zero_grad(set_to_none=True)
    for x, y in micro_batches:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model(x), y) * (len(y) / total)
        scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def _expect_flags(value: object, where: str) -> list[bool]:
    flags = expect_list(value, where)
    if not all(isinstance(f, bool) for f in flags):
        raise CheckFailure(f"{where}: expected a list of True/False, got {flags!r:.80}")
    return flags


def _expect_run(got: object, where: str, numels: list[int]) -> dict:
    """The probe's record of one run, every field checked for its type and size."""
    got = expect_dict(got, f"{where}: the record of your loop", KEYS)
    for key in ("steps", "updates"):
        expect_number(got[key], f"{where}: the number of {key}", integer=True)
    expect_number(got["scale"], f"{where}: the scaler's scale")
    for key in ("forward_dtypes", "forward_sizes"):
        expect_list(got[key], f"{where}: {key}")
    if not all(isinstance(d, str) for d in got["forward_dtypes"]):
        raise CheckFailure(f"{where}: forward_dtypes: expected dtype names, got {got['forward_dtypes']!r:.80}")
    for i, n in enumerate(got["forward_sizes"]):
        expect_number(n, f"{where}: the batch size of forward {i + 1}", integer=True)
    for key in ("backward_autocast", "step_autocast", "update_autocast"):
        _expect_flags(got[key], f"{where}: {key}")
    if got["grads"] is not None:
        grads = expect_list(got["grads"], f"{where}: the gradients the optimizer was handed", len(numels))
        for k, (grad, n) in enumerate(zip(grads, numels, strict=True)):
            if grad is not None:
                expect_numbers(grad, f"{where}: the gradient of parameter tensor {k}", n, finite=False)
    return got


@register
class Accumulate(Check):
    name, args, points = "04.accumulate", ("accumulate",), 4
    hint = (
        "Zero the gradients first. For each micro-batch in turn (one forward and one backward each, never one "
        "pass over them all): forward and loss under torch.autocast(device_type, dtype=dtype, enabled=dtype is "
        "not None); multiply the loss by len(y) / (total samples) — loss / N when all N micro-batches have the "
        "same size; scaler.scale(loss).backward(), outside autocast. After the loop, outside autocast, once: "
        "scaler.step(optimizer) (not optimizer.step(): it skips the step when the gradients overflowed), then "
        "scaler.update()."
    )
    forbidden = ("course_lib.chapters", "course_lib.train")
    forbidden_why = "write the loop yourself instead of calling chapter 04's accumulation_step or the Trainer"
    time_limit = 60.0

    def cases(self, rng: random.Random) -> list:
        precisions = ["fp32", "fp32", "fp32", "fp16", "fp16", "fp16", "bf16", "bf16", "fp16"]
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
            # the last case overflows: a loss scaled by 2^40 or more sends inf into fp16's backward, so a correct
            # loop skips the step (scaler.step) and halves the scale (scaler.update)
            overflow = i == len(precisions) - 1
            cases.append(
                {
                    "seed": rng.getrandbits(31),
                    "features": rng.randint(3, 12),
                    "hidden": rng.randint(4, 16),
                    "classes": rng.randint(2, 5),
                    "sizes": sizes,
                    "precision": precision,
                    "loss": "mse_loss" if rng.random() < 0.25 else "cross_entropy",
                    "init_scale": 2.0 ** (rng.randint(40, 60) if overflow else rng.randint(6, 12)),
                    "overflow": overflow,
                }
            )
        rng.shuffle(cases)
        return cases

    def describe(self, case: dict) -> str:
        dtype = str(DTYPES[case["precision"]])  # "None", "torch.float16", "torch.bfloat16"
        scale = f", a scaler starting at init_scale=2**{math.log2(case['init_scale']):g}" if case["overflow"] else ""
        return (
            f"accumulate(model, optimizer, scaler, micro-batches of sizes {case['sizes']}, "
            f"F.{case['loss']}, dtype={dtype}{scale})"
        )

    def judge(self, cases: list, results: list) -> None:
        expect_list(results, "the answers to the cases", len(cases))
        # the ordinary cases first, whose messages name the usual mistakes; then the overflowing one
        for case, got in sorted(zip(cases, results, strict=True), key=lambda pair: pair[0]["overflow"]):
            self._judge_one(case, got)

    def _judge_one(self, case: dict, got: object) -> None:
        where, fp16, sizes = self.describe(case), case["precision"] == "fp16", case["sizes"]
        got = _expect_run(got, where, [p.numel() for p in build(case)[0].parameters()])
        want = run_loop(case, reference_accumulate)  # what a correct loop does on this case
        if case["overflow"] and want["steps"] != 0:  # the case must exercise a skipped step, or it tests nothing
            raise RuntimeError(f"the overflow case did not overflow ({want['steps']} steps)")
        steps, updates = got["steps"], got["updates"]
        computed = str(DTYPES[case["precision"]] or torch.float32)
        if got["forward_dtypes"] != [computed]:
            raise CheckFailure(
                f"{where}: the model's first layer computed in {got['forward_dtypes']!r}, expected "
                f"['{computed}']: run forward and loss under torch.autocast(device_type, "
                "dtype=dtype, enabled=dtype is not None)"
            )
        if sorted(got["forward_sizes"]) != sorted(sizes):
            concatenated = got["forward_sizes"] == [sum(sizes)]
            raise CheckFailure(
                f"{where}: the model ran forward on batches of sizes {got['forward_sizes']}, expected "
                f"one forward per micro-batch, on that micro-batch alone ({sizes})"
                + (
                    ": one pass over the concatenated micro-batches is the large batch, not "
                    "accumulation (its memory is what accumulation saves)"
                    if concatenated
                    else ""
                )
            )
        backwards = got["backward_autocast"]
        if len(backwards) != len(sizes):
            raise CheckFailure(
                f"{where}: backward ran {len(backwards)} time(s) for {len(sizes)} micro-batches: "
                "call scaler.scale(loss).backward() once per micro-batch, right after its forward, "
                "so that each micro-batch's graph is freed before the next one is built"
            )
        if any(backwards):
            raise CheckFailure(
                f"{where}: {sum(backwards)} of {len(backwards)} backward passes ran with autocast on: "
                "only the forward and the loss go inside the `with torch.autocast(...)` block; call "
                "scaler.scale(loss).backward() after it (chapter 02)"
            )
        for key, what in (("step_autocast", "the optimizer step"), ("update_autocast", "scaler.update()")):
            if any(got[key]):
                raise CheckFailure(
                    f"{where}: {what} ran with autocast on: step and update after the loop, "
                    "outside the `with torch.autocast(...)` block"
                )
        if want["steps"] == 0 and steps > 0:
            raise CheckFailure(
                f"{where}: the scaled fp16 gradients overflowed (inf/NaN), yet optimizer.step() ran "
                f"{steps} time(s). Call scaler.step(optimizer): it checks the gradients and skips "
                "the step when they hold inf or NaN (unscale_ followed by optimizer.step() applies "
                "them), then scaler.update() lowers the scale"
            )
        if want["steps"] == 1 and steps == 0:
            raise CheckFailure(
                f"{where}: optimizer.step() never ran. Call scaler.step(optimizer) once, after "
                "the last micro-batch"
                + (
                    " (with the scaler on, an inf or NaN in the gradients "
                    "makes it skip the step: were they scaled twice?)"
                    if fp16
                    else ""
                )
            )
        if steps > 1:
            raise CheckFailure(
                f"{where}: optimizer.step() ran {steps} times for {len(sizes)} "
                "micro-batches; accumulation means one step, after the last micro-batch"
            )
        if fp16 and updates != 1:
            raise CheckFailure(
                f"{where}: scaler.update() ran {updates} times; call it once per optimizer step, "
                "after scaler.step: the scale must stay the same while gradients accumulate"
            )
        if got["scale"] != want["scale"]:
            why = (
                f"after a skipped step update() multiplies it by the backoff factor ({want['scale']:g})"
                if want["steps"] == 0
                else "call scaler.update() once, after scaler.step(optimizer)"
            )
            raise CheckFailure(
                f"{where}: the scaler's scale is {got['scale']:g} after your loop, expected {want['scale']:g}: {why}"
            )
        if want["steps"] == 0:
            return  # the step was rightly skipped: no gradient was applied to compare
        grads = got["grads"]
        if grads is None or any(g is None for g in grads):
            raise CheckFailure(f"{where}: some parameters had no gradient when the optimizer stepped")
        g = torch.tensor([v for part in grads for v in part], dtype=torch.float64)
        want_g = _grad(case, large=True)
        if not torch.isfinite(g).all():
            raise CheckFailure(f"{where}: the optimizer was handed gradients with infs or NaNs")
        err = ((g - want_g).norm() / want_g.norm()).item()
        tol = TOLERANCE[case["precision"]]
        if err > tol:
            raise CheckFailure(
                f"{where}: the gradients at optimizer.step() differ from the large batch's by "
                f"{err:.3g} (relative; rounding allows {tol:.2g}). {self._diagnose(case, g)}"
            )

    def _diagnose(self, case: dict, g: torch.Tensor) -> str:
        """Name the mistake whose gradient (computed here, in float64) the learner's is closest to."""
        sizes, n = case["sizes"], len(case["sizes"])
        total = sum(sizes)
        right = [s / total for s in sizes]
        suspects = {
            "Each micro-batch's loss must be multiplied by len(y) / total (loss / N only when all sizes are "
            "equal): a short last micro-batch must count less.": [1 / n] * n,
            "The loss was not divided: the gradient is the sum over the micro-batches, not their average.": [1.0] * n,
            "Only the last micro-batch counted: is zero_grad() inside the micro-batch loop?": [0.0] * (n - 1)
            + [right[-1]],
        }
        candidates = [(msg, _grad(case, w, double=True)) for msg, w in suspects.items()]
        # gradients left in .grad were never multiplied by the scale, yet unscale_ divides them by it
        kept = junk(case).double() / (case["init_scale"] if case["precision"] == "fp16" else 1.0)
        candidates.append(
            (
                "The gradients already in .grad before the call were kept: zero the gradients first.",
                _grad(case, right, double=True) + kept,
            )
        )
        best, dist = min(((msg, ((g - c).norm() / c.norm()).item()) for msg, c in candidates), key=lambda t: t[1])
        return best if dist < 0.05 else "Compare your loop with the hint."
