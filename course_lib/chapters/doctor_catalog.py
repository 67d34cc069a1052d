"""The AMP doctor's catalogue: every mistake it names, with the fix and the chapter that teaches it.

Chapter 05 introduces the doctor (`course_lib.chapters.doctor`); chapter 09 completes it. This
module is only text: the rules that find each mistake live in doctor.py, beside the recorder.
"""
from __future__ import annotations

__all__ = ["PROBLEMS", "ERRORS"]

# code: (what was wrong, what to do instead, the chapter that teaches it)
PROBLEMS: dict[str, tuple[str, str, str]] = {
    "fp16_params": ("parameters are stored in 16 bits", "keep the model in fp32 (no model.half()): autocast makes "
                    "16-bit copies where they pay, and the optimizer updates fp32 weights. A GradScaler refuses fp16 "
                    "gradients ('Attempting to unscale FP16 gradients').", "02, 03"),
    "backward_in_autocast": ("backward() ran inside an autocast region", "end the `with torch.autocast(...)` block "
                             "after the loss and call backward() outside it: each backward op already runs in its "
                             "forward op's dtype, and a region around backward casts fp32 parts of it to 16 bits.",
                             "02"),
    "step_in_autocast": ("the optimizer stepped inside an autocast region (one region around the whole loop?)",
                         "open one region per iteration, around the forward and the loss only. Inside a long region "
                         "autocast keeps its 16-bit copies of the weights: after step() the forwards keep using the "
                         "old copies, which also stay in memory.", "02"),
    "bce_in_autocast": ("binary_cross_entropy (BCELoss) ran under autocast", "drop the sigmoid and use "
                        "BCEWithLogitsLoss / F.binary_cross_entropy_with_logits on the logits: a 16-bit probability "
                        "rounds to 1.0, and the loss and gradient break (CUDA autocast refuses BCELoss).", "02"),
    "no_autocast": ("a GradScaler is on, but no forward ran under autocast", "put the forward and the loss in `with "
                    "torch.autocast(device_type, dtype=torch.float16):`; without it everything runs in fp32 and the "
                    "scaler only costs time.", "02, 03"),
    "not_scaled": ("backward() on a loss that did not go through scaler.scale()", "call scaler.scale(loss).backward():"
                   " fp16 gradients of an unscaled loss can underflow to zero, and scaler.step() then divides them by "
                   "the scale, shrinking the update by that factor.", "03"),
    "step_without_scaler": ("optimizer.step() was called directly while a GradScaler is on", "call scaler.step("
                            "optimizer): it unscales the gradients first and skips the step when they hold inf/NaN; "
                            "optimizer.step() applies gradients still multiplied by the scale.", "03, 05"),
    "clip_before_unscale": ("gradients were clipped while still scaled", "call scaler.unscale_(optimizer) before "
                            "clip_grad_norm_ / clip_grad_value_: scaled gradients are the scale times too large, so "
                            "the threshold cuts them far too much.", "03"),
    "step_per_microstep": ("the optimizer stepped before accum_steps micro-batches had accumulated", "call "
                           "scaler.step(optimizer) (and update, zero_grad) only on every accum_steps-th micro-batch.",
                           "04"),
    "update_per_microstep": ("scaler.update() ran inside an accumulation window", "call scaler.update() once per "
                             "optimizer step, after scaler.step(): the scale must stay the same while the "
                             "micro-batches' scaled gradients add up.", "04"),
    "update_between_steps": ("scaler.update() ran between a backward and the step that uses its gradients", "call "
                             "scaler.update() once per iteration, after every optimizer's scaler.step(): update may "
                             "change the scale, and gradients still waiting are then unscaled with the wrong one.",
                             "05"),
    "missing_zero_grad": ("gradients were never cleared between two optimizer steps", "call optimizer.zero_grad() "
                          "once per step (after step(), or before the first micro-batch): otherwise every step adds "
                          "all earlier gradients, and one inf stays forever, so every later step is skipped.", "04"),
    "zero_grad_in_window": ("the gradients were cleared inside an accumulation window", "call zero_grad() only "
                            "after the step (or before the window's first micro-batch): clearing in between "
                            "throws away the micro-batches accumulated so far.", "04"),
    "loss_not_divided": ("each step's gradient is accum_steps times too large", "divide each micro-batch's loss by "
                         "accum_steps before backward: the sum of N mean losses is N times the big batch's mean.",
                         "04"),
    "empty_step": ("the optimizer stepped with all-zero gradients (zero_grad between backward and step?)", "clear "
                   "the gradients before the forward (or right after the step), never between backward and step.",
                   "04"),
    "nonfinite_loss": ("the loss itself was inf or NaN", "the forward overflowed before any gradient existed: a "
                       "GradScaler cannot fix that, it only skips the step. Find the first layer whose output leaves "
                       "fp16's range (course_lib.chapters.overflow.trace_magnitudes; torch.autograd.detect_anomaly "
                       "for the backward) and run it in fp32 (autocast(enabled=False) around it), or use bf16.",
                       "03, 09"),
    "scale_collapsing": ("the loss scale keeps falling: every recent step was skipped", "no scale helps: either "
                         "the loss itself is inf/NaN (see the finding about it, if any) or an inf/NaN is made "
                         "inside the model or the backward (find it with torch.autograd.detect_anomaly). Training "
                         "is not happening while every step is skipped, and a scale near 1 or below can no longer "
                         "protect small gradients.", "03, 09"),
    "scheduler_on_skipped_step": ("the learning-rate scheduler stepped on steps the scaler skipped", "step the "
                                  "scheduler only when the optimizer really stepped (the scale falls exactly when a "
                                  "step is skipped: compare scaler.get_scale() before and after update(), as the "
                                  "course's Trainer does); otherwise the schedule runs ahead of the real updates.",
                                  "03"),
    "scaler_with_bf16": ("a GradScaler is on, but the forwards ran in bf16", "bf16 has fp32's exponent range, so "
                         "its gradients do not underflow: drop the scaler (or GradScaler(enabled=False)). It only "
                         "costs an inf/NaN check per step, and it hides nothing bf16 gets wrong.", "01, 03"),
    "deprecated_amp_api": ("the deprecated torch.cuda.amp / torch.cpu.amp spellings were used", "write "
                           "torch.autocast(device_type, dtype=...) and torch.amp.GradScaler(device_type): the old "
                           "names only forward to these and raise a FutureWarning.", "02"),
    "checkpoint_without_scaler": ("a checkpoint was saved without the scaler's state", "save scaler.state_dict() "
                                  "with the model and the optimizer, and load it with scaler.load_state_dict() on "
                                  "resume: otherwise the scale restarts at init_scale and the growth tracker at 0, "
                                  "and the resumed run is not the run it continues.", "03"),
    "raised": ("your loop raised an error", "", ""),
}

# Known error messages (torch's words) -> what they mean in a training loop.
ERRORS = [
    ("backward through the graph a second time", "two backward() calls went through one graph: pass "
     "retain_graph=True to the first (chapter 05), or call backward() once on the sum of the losses"),
    ("No inf checks were recorded prior to update", "scaler.update() ran without a scaler.step() since the last "
     "update(): call it once per optimizer step, after scaler.step() (accumulating: on the last micro-batch)"),
    ("unscale_() has already been called", "unscale_() twice for one optimizer before update(): unscale (and "
     "clip) once, right before the step"),
    ("step() has already been called since", "scaler.step() twice for one optimizer before update(): once each"),
    ("is being called after step()", "no scaler.update() after the last step: call it once per iteration, last"),
    ("_scale is None", "scaler.step() before any scaler.scale(): call scaler.scale(loss).backward()"),
    ("Attempting to unscale FP16 gradients", "the parameters are fp16: keep the model in fp32 (chapter 02)"),
    ("unsafe to autocast", "BCELoss under CUDA autocast: use BCEWithLogitsLoss on the logits (chapter 02)"),
    ("No inf checks were recorded for this optimizer", "scaler.step() on an optimizer none of whose parameters "
     "has a gradient: is its model in the loss, and were the gradients cleared after backward, not before?"),
    ("to have the same dtype", "an op got one 16-bit and one fp32 operand outside autocast's casts: a custom "
     "autograd.Function needs @torch.amp.custom_fwd(device_type=..., cast_inputs=torch.float32) on forward and "
     "@torch.amp.custom_bwd(device_type=...) on backward (chapter 02), or cast the operands yourself"),
    ("must have the same dtype", "an op got one 16-bit and one fp32 operand outside autocast's casts: decorate a "
     "custom autograd.Function with torch.amp.custom_fwd / custom_bwd (chapter 02), or cast the operands yourself"),
]
