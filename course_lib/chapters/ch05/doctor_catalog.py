"""The AMP doctor's words: every mistake it names, with what it saw, the fix and the chapter that teaches it.

Chapter 05 introduces the doctor (`course_lib.chapters.ch05.doctor`); chapter 09 completes it. This
module is text and the shapes that hold it (Event, Finding, Report, the summary line): the rules
that find each mistake live in doctor.py, the recorder that sees the calls in doctor_recorder.py.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

__all__ = ["PROBLEMS", "SEEN", "ERRORS", "Finding", "Report"]  # and findings(), summary(): the doctor's

WIDTH = 100

# code: (what was wrong, what to do instead, the chapter that teaches it)
PROBLEMS: dict[str, tuple[str, str, str]] = {
    "fp16_params": (
        "parameters are stored in 16 bits",
        "keep the model in fp32 (no model.half()): autocast makes "
        "16-bit copies where they pay, and the optimizer updates fp32 weights. A GradScaler refuses fp16 "
        "gradients ('Attempting to unscale FP16 gradients').",
        "02, 03",
    ),
    "backward_in_autocast": (
        "backward() ran inside an autocast region",
        "end the `with torch.autocast(...)` block "
        "after the loss and call backward() outside it: each backward op already runs in its "
        "forward op's dtype, and a region around backward casts fp32 parts of it to 16 bits.",
        "02",
    ),
    "step_in_autocast": (
        "the optimizer stepped inside an autocast region (one region around the whole loop?)",
        "open one region per iteration, around the forward and the loss only. Inside a long region "
        "autocast keeps its 16-bit copies of the weights: after step() the forwards keep using the "
        "old copies, which also stay in memory.",
        "02",
    ),
    "bce_in_autocast": (
        "binary_cross_entropy (BCELoss) ran under autocast",
        "drop the sigmoid and use "
        "BCEWithLogitsLoss / F.binary_cross_entropy_with_logits on the logits: a 16-bit probability "
        "rounds to 1.0, and the loss and gradient break (CUDA autocast refuses BCELoss).",
        "02",
    ),
    "no_autocast": (
        "a GradScaler is on, but no forward ran under autocast",
        "put the forward and the loss in `with "
        "torch.autocast(device_type, dtype=torch.float16):`; without it everything runs in fp32 and the "
        "scaler only costs time.",
        "02, 03",
    ),
    "not_scaled": (
        "backward() on a loss that did not go through scaler.scale()",
        "call scaler.scale(loss).backward():"
        " fp16 gradients of an unscaled loss can underflow to zero, and scaler.step() then divides them by "
        "the scale, shrinking the update by that factor.",
        "03",
    ),
    "step_without_scaler": (
        "optimizer.step() was called directly while a GradScaler is on",
        "call scaler.step("
        "optimizer): it unscales the gradients first and skips the step when they hold inf/NaN; "
        "optimizer.step() applies gradients still multiplied by the scale.",
        "03, 05",
    ),
    "clip_before_unscale": (
        "gradients were clipped while still scaled",
        "call scaler.unscale_(optimizer) before "
        "clip_grad_norm_ / clip_grad_value_: scaled gradients are the scale times too large, so "
        "the threshold cuts them far too much.",
        "03",
    ),
    "step_per_microstep": (
        "the optimizer stepped before accum_steps micro-batches had accumulated",
        "call scaler.step(optimizer) (and update, zero_grad) only on every accum_steps-th micro-batch.",
        "04",
    ),
    "update_per_microstep": (
        "scaler.update() ran inside an accumulation window",
        "call scaler.update() once per "
        "optimizer step, after scaler.step(): the scale must stay the same while the "
        "micro-batches' scaled gradients add up.",
        "04",
    ),
    "update_between_steps": (
        "scaler.update() ran between a backward and the step that uses its gradients",
        "call "
        "scaler.update() once per iteration, after every optimizer's scaler.step(): update may "
        "change the scale, and gradients still waiting are then unscaled with the wrong one.",
        "05",
    ),
    "missing_zero_grad": (
        "gradients were never cleared between two optimizer steps",
        "call optimizer.zero_grad() "
        "once per step (after step(), or before the first micro-batch): otherwise every step adds "
        "all earlier gradients, and one inf stays forever, so every later step is skipped.",
        "04",
    ),
    "zero_grad_in_window": (
        "the gradients were cleared inside an accumulation window",
        "call zero_grad() only "
        "after the step (or before the window's first micro-batch): clearing in between "
        "throws away the micro-batches accumulated so far.",
        "04",
    ),
    "loss_not_divided": (
        "each micro-batch's loss was divided by the wrong count: the step's gradient is the wrong size",
        "divide each micro-batch's loss by the number of micro-batches accumulated per "
        "optimizer step (accum_steps) before backward: the sum of N mean losses is N times the big "
        "batch's mean, and any other divisor scales every update by the same wrong factor.",
        "04",
    ),
    "empty_step": (
        "the optimizer stepped with all-zero gradients (zero_grad between backward and step?)",
        "clear the gradients before the forward (or right after the step), never between backward and step.",
        "04",
    ),
    "missing_update": (
        "scaler.update() is missing",
        "call scaler.update() once per iteration, after the last "
        "scaler.step(): it ends the iteration (without it the next scaler.step() or unscale_() "
        "raises) and moves the scale, down after an overflow, up after a run of clean steps.",
        "03",
    ),
    "unscale_after_step": (
        "scaler.unscale_() ran after scaler.step(): the order is wrong",
        "call "
        "scaler.unscale_(optimizer) before scaler.step(optimizer), once per step, and clip "
        "between them: step() unscales (and checks for inf/NaN) by itself, so gradients read "
        "or clipped after it are no longer the ones it applied.",
        "03",
    ),
    "penalty_from_scaled_grads": (
        "a gradient penalty was computed from still-scaled gradients",
        "multiply the "
        "gradients autograd.grad returns for scaler.scale(loss) by 1 / scaler.get_scale() "
        "before the penalty (they belong to no optimizer, so unscale_ cannot reach them): "
        "otherwise the penalty is the scale times too large, and often inf.",
        "05",
    ),
    "penalty_from_unscaled_loss": (
        "autograd.grad ran on a loss that did not go through scaler.scale()",
        "take the "
        "penalty's gradients of scaler.scale(loss), then multiply them by 1 / "
        "scaler.get_scale(), as the AMP examples page does: fp16 gradients of the "
        "unscaled loss can underflow to zero, and the penalty misses them.",
        "05",
    ),
    "nonfinite_loss": (
        "the loss itself was inf or NaN",
        "the forward overflowed before any gradient existed: a "
        "GradScaler cannot fix that, it only skips the step. Find the first layer whose output leaves "
        "fp16's range (course_lib.chapters.ch03.overflow.trace_magnitudes; torch.autograd.detect_anomaly "
        "for the backward) and run it in fp32 (autocast(enabled=False) around it), or use bf16.",
        "03, 09",
    ),
    "scale_collapsing": (
        "the loss scale keeps falling: every recent step was skipped, at low scales too",
        "no scale helps: either "
        "the loss itself is inf/NaN (see the finding about it, if any) or an inf/NaN is made "
        "inside the model or the backward (find it with torch.autograd.detect_anomaly). Training "
        "is not happening while every step is skipped, and a scale near 1 or below can no longer "
        "protect small gradients.",
        "03, 09",
    ),
    "scheduler_before_step": (
        "the learning-rate scheduler stepped before the optimizer's step",
        "call "
        "scheduler.step() after scaler.step(optimizer) and scaler.update(), and with a "
        "GradScaler only when the step was not skipped (the scale falls exactly when it was); "
        "stepped first, the schedule runs one step ahead of the updates (torch warns 'Detected "
        "call of `lr_scheduler.step()` before `optimizer.step()`').",
        "03",
    ),
    "scheduler_on_skipped_step": (
        "the learning-rate scheduler stepped on steps the scaler skipped",
        "step the "
        "scheduler only when the optimizer really stepped (the scale falls exactly when a "
        "step is skipped: compare scaler.get_scale() before and after update(), as the "
        "course's Trainer does); otherwise the schedule runs ahead of the real updates.",
        "03",
    ),
    "scaler_with_bf16": (
        "a GradScaler is on, but the forwards ran in bf16",
        "bf16 has fp32's exponent range, so "
        "its gradients do not underflow: drop the scaler (or GradScaler(enabled=False)). It only "
        "costs an inf/NaN check per step, and it hides nothing bf16 gets wrong.",
        "01, 03",
    ),
    "deprecated_amp_api": (
        "the deprecated torch.cuda.amp / torch.cpu.amp spellings were used",
        "write "
        "torch.autocast(device_type, dtype=...) and torch.amp.GradScaler(device_type): the old "
        "names only forward to these and raise a FutureWarning.",
        "02",
    ),
    "checkpoint_without_scaler": (
        "a checkpoint was saved without the scaler's state",
        "save scaler.state_dict() "
        "with the model and the optimizer, and load it with scaler.load_state_dict() on "
        "resume: otherwise the scale restarts at init_scale and the growth tracker at 0, "
        "and the resumed run is not the run it continues.",
        "03",
    ),
    "raised": ("your loop raised an error", "", ""),
}

# code (or code.variant): what the doctor saw, with the numbers of the run
SEEN: dict[str, str] = {
    "fp16_params": "parameters of dtype {dtypes} before the loop ran",
    "backward_in_autocast": "{n} of {of} backward() calls ran with autocast on",
    "step_in_autocast": "{n} of {of} optimizer steps ran with autocast on",
    "bce_in_autocast": "F.binary_cross_entropy was called {n} times with autocast on",
    "no_autocast": "{n} forward passes, none of them under autocast",
    "not_scaled": "{n} of {of} backward() calls started from a loss scaler.scale() never saw",
    "step_without_scaler": "optimizer {i}'s step() was called {n} times directly",
    "empty_step": "{n} scaler.step() calls found every gradient of their optimizer zero",
    "penalty_from_scaled_grads": "{n} backward() calls went through gradients of autograd.grad(scaler.scale(loss)) "
    "that were not divided by the scale",
    "penalty_from_unscaled_loss": "{n} of {of} autograd.grad() calls started from a loss scaler.scale() never saw",
    "missing_update.never": "scaler.step() ran {n} times and scaler.update() never",
    "missing_update": "scaler.{call}(optimizer {i}) ran in an iteration after one whose scaler.step() had no "
    "scaler.update() after it",
    "unscale_after_step": "scaler.unscale_(optimizer {i}) ran after scaler.step(optimizer {i}) in the same iteration",
    "zero_grad_in_window": "clean gradients at a backward() after {n} in the same window",
    "update_per_microstep": "update() after {n} micro-batch(es); accum_steps = {accum}",
    "clip_before_unscale": "{clip} ran on optimizer {i}'s parameters before scaler.unscale_() in {which} iteration",
    "update_between_steps": "optimizer {i}'s gradients were scaled before an update() and unscaled after it",
    "missing_zero_grad": "optimizer {i} stepped again with no zero_grad() (and no clean gradients) since its "
    "previous step",
    "step_per_microstep": "a step after {n} micro-batch(es); accum_steps = {accum}",
    "loss_not_divided": "the gradient at an optimizer step was {ratio:.2f} times a correct loop's on the same {n} "
    "micro-batches, as if each loss were divided by {by:.2g} instead of {n}",
    "nonfinite_loss": "{n} of {of} backward() (or autograd.grad()) calls started from an inf/NaN loss",
    "consequence": "; the {n} inf/NaN losses after it are its doing, not a forward overflow",
    "scale_collapsing": "the last {n} of {of} scaler.step() calls were all skipped, at scales down to {low:g}; the "
    "scale ended at {end:g}",
    "skips_note": "{n} of {of} scaler.step() calls were skipped, at scales from {hi:g} to {lo:g}: normal GradScaler "
    "behaviour while the scale comes down from a large init_scale (each skip halves it), not an "
    "inf/NaN in the model, as long as the steps go through once the scale is lower (at 256, only "
    "gradients above 256 overflow fp16)",
    "scheduler_before_step": "scheduler.step() ran {n} times before the optimizer step that follows it",
    "scheduler_on_skipped_step": "scheduler.step() went with {n} of the {of} skipped steps",
    "scaler_with_bf16": "an enabled GradScaler beside {n} bf16 forwards",
    "deprecated_amp_api": "{what} is deprecated",
    "checkpoint_without_scaler": "{n} of {of} torch.save() calls of a training checkpoint (it holds an optimizer "
    "state) had no scaler state in it",
}

# Known error messages (torch's words) -> what they mean in a training loop.
ERRORS = [
    (
        "backward through the graph a second time",
        "two backward() calls went through one graph: pass "
        "retain_graph=True to the first (chapter 05), or call backward() once on the sum of the losses",
    ),
    (
        "No inf checks were recorded prior to update",
        "scaler.update() ran without a scaler.step() since the last "
        "update(): call it once per optimizer step, after scaler.step() (accumulating: on the last micro-batch)",
    ),
    (
        "unscale_() has already been called",
        "unscale_() twice for one optimizer before update(): unscale (and clip) once, right before the step",
    ),
    (
        "step() has already been called since",
        "scaler.step() ran again for one optimizer with no scaler.update() "
        "since its last step: one scaler.step() per optimizer, then one scaler.update() per iteration, last",
    ),
    (
        "is being called after step()",
        "scaler.unscale_() ran after scaler.step() for one optimizer with no "
        "scaler.update() between them: unscale_ (and clip) before the step, once per step; update() last",
    ),
    ("_scale is None", "scaler.step() before any scaler.scale(): call scaler.scale(loss).backward()"),
    ("Attempting to unscale FP16 gradients", "the parameters are fp16: keep the model in fp32 (chapter 02)"),
    ("unsafe to autocast", "BCELoss under CUDA autocast: use BCEWithLogitsLoss on the logits (chapter 02)"),
    (
        "No inf checks were recorded for this optimizer",
        "scaler.step() on an optimizer none of whose parameters "
        "has a gradient: is its model in the loss, and were the gradients cleared after backward, not before?",
    ),
    (
        "to have the same dtype",
        "an op got one 16-bit and one fp32 operand outside autocast's casts: a custom "
        "autograd.Function needs @torch.amp.custom_fwd(device_type=..., cast_inputs=torch.float32) on forward and "
        "@torch.amp.custom_bwd(device_type=...) on backward (chapter 02), or cast the operands yourself",
    ),
    (
        "must have the same dtype",
        "an op got one 16-bit and one fp32 operand outside autocast's casts: decorate a "
        "custom autograd.Function with torch.amp.custom_fwd / custom_bwd (chapter 02), or cast the operands yourself",
    ),
]


@dataclass(eq=False)
class Event:
    """One call the doctor saw: what, for which optimizer (or model), autocast on or off, details."""

    kind: str
    index: int | None = None
    autocast: bool = False
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Finding:
    """Chapter 05: one mistake the doctor found: what, what it saw, how to fix it, where it is taught."""

    code: str
    title: str
    seen: str
    fix: str
    chapter: str

    def __str__(self) -> str:
        head = f"✗ {self.title}" + (f"  (chapter {self.chapter})" if self.chapter else "")
        body = [f"  seen: {self.seen}"] + ([f"  fix:  {self.fix}"] if self.fix else [])
        return "\n".join(
            [textwrap.fill(head, WIDTH, subsequent_indent="  ")]
            + [textwrap.fill(b, WIDTH, subsequent_indent=" " * 8) for b in body]
        )


@dataclass
class Report:
    """Chapter 05: what diagnose() found, and what it watched."""

    findings: list[Finding]
    summary: str
    events: list[Event]
    notes: list[str] = field(default_factory=list)

    @property
    def codes(self) -> list[str]:
        return [f.code for f in self.findings]

    def __str__(self) -> str:
        ok = [] if self.findings else ["✓ none of the classic AMP mistakes the doctor knows was found"]
        return "\n".join(
            [
                textwrap.fill(self.summary, WIDTH, subsequent_indent="  "),
                *ok,
                *map(str, self.findings),
                *(textwrap.fill(f"note: {n}", WIDTH, subsequent_indent="  ") for n in self.notes),
            ]
        )


def findings(found: dict[str, str], error: Exception | None) -> list[Finding]:
    """The doctor's findings for `found` (code -> what was seen) in the catalogue's order, then the loop's error."""
    out = [Finding(c, PROBLEMS[c][0], found[c], *PROBLEMS[c][1:]) for c in PROBLEMS if c in found]
    if error is not None:
        text = f"{type(error).__name__}: " + " ".join(str(error).split()).split(". ")[0]  # its first sentence
        meaning = next((m for key, m in ERRORS if key in str(error)), "")
        out.append(Finding("raised", f"your loop raised {type(error).__name__}", text[:300], meaning, ""))
    return out


def summary(events: list, batches: int, scales: tuple[float, float] | str) -> str:
    """The report's first line: what the doctor's Events show the loop did."""

    def count(kind: str) -> int:
        return sum(e.kind == kind for e in events)

    skips = count("scaler.step") - sum(e.kind == "step" and e.info["via_scaler"] for e in events)
    dtypes = sorted({str(e.info["dtype"]).removeprefix("torch.") for e in events if e.kind == "forward" and e.autocast})
    scale = f"scale {scales[0]:g} -> {scales[1]:g}" if isinstance(scales, tuple) else scales
    return (
        f"the doctor ran your loop on copies over {batches} batches: {count('forward')} forward, "
        f"{count('backward')} backward, {count('step')} optimizer steps ({skips} skipped by the scaler); "
        f"autocast {', '.join(dtypes) or 'never on'}; {scale}"
    )
