"""A recorded GPU run's memory, predicted row by row with CUDA's rules (chapter 10, section 10).

`python -m course_lib.chapters.ch10.record_memory` measured each step on a GPU with the caching allocator's own counter
(`torch.cuda.max_memory_allocated`, reset at the start of each phase; data/reference/memory_*.json).
Each row becomes a `Step` with `device="cuda"` and the run's loop: it keeps only the loss
(`model(x, y)[1]`, so the logits go after the forward), uses fused (or foreach) AdamW or SGD with
momentum, and counts the batch, made before the step. Two facts come from the record itself:

- whether SGD has made its momentum buffer (a GradScaler that skipped every step of a short fp16
  run never stepped): the run's reading at the start of the step says;
- what the allocator held before the step beyond the tensors the step names (weights, gradients,
  optimizer state, batch): the same reading, minus those. `memory_allocated` counts whole blocks,
  and a block cut from a cached one may keep up to 1 MiB it was not asked for; the first row of a
  run also holds a cuBLAS workspace made after the run's baseline. What was held before the step is
  still held at its peak, so the prediction adds it (`with_start`).

What the SimpleCNN rows hold beyond that is not predicted (most likely cuDNN's convolution
workspaces); `convolution_gap` bounds it from the record.
"""

from __future__ import annotations

import re

from course_lib.chapters.ch10.predict import Step, predict_step
from course_lib.models import GPTConfig
from course_lib.tables import table

__all__ = ["recorded_step", "predicted_recorded_row", "format_recorded_rows", "convolution_gap"]


def recorded_step(row: dict) -> Step:
    """Chapter 10: the `Step` a recorded row measured, with CUDA's rules and the run's loop."""
    model, batch, precision = row["model"], row["batch"], row["precision"]
    if model == "gpt2":
        return Step(
            "gpt",
            batch,
            seq=row["seq"],
            config=GPTConfig(**row["config"]),
            precision=precision,
            optimizer="adamw-" + row["optimizer"],
            checkpointing=row["checkpointing"],
            device="cuda",
            logits_held=False,
        )
    if model == "mlp":  # forward and backward only
        return Step(
            "mlp", batch, width=row["width"], depth=row["depth"], precision=precision, optimizer="none", device="cuda"
        )
    # SGD with momentum, unless no step has run yet: then it holds no buffer (read from the record)
    state = row["phases"]["start"]["allocated"] - row["model_bytes"] - row["batch_bytes"]
    optimizer = "sgd-momentum" if state > 1.5 * row["model_bytes"] else "sgd"
    if model == "simplecnn":
        return Step(
            "simplecnn", batch, size=row["shape"][-1], width=64, precision=precision, optimizer=optimizer, device="cuda"
        )
    if model == "resnet50":
        return Step("resnet50", batch, size=row["shape"][-1], precision=precision, optimizer=optimizer, device="cuda")
    raise ValueError(f"no prediction for model {model!r}")


def predicted_recorded_row(row: dict) -> dict:
    """Chapter 10: one recorded row with its prediction: {"model", "batch", "precision", "setup",
    "predicted" (the step's peak plus the batch), "before" (what the allocator held before the step
    beyond the weights, gradients, optimizer state and batch), "with_start" (predicted + before),
    "measured", "error" and "error_with_start" (against measured), "moment", "note"}; bytes."""
    step = recorded_step(row)
    p = predict_step(step)
    predicted = p.peak + row["batch_bytes"]
    # at the start of the step the last one's gradients are still there (zero_grad comes first),
    # except with master weights, whose step releases them
    fixed = sum(h.nbytes for h in p.held if h.category in ("parameters", "buffers", "optimizer"))
    grads = 0 if step.precision == "bf16-master" else sum(h.nbytes for h in p.held if h.category == "parameters")
    before = row["phases"]["start"]["allocated"] - fixed - grads - row["batch_bytes"]
    measured = row["peak_bytes"]
    short = {"sgd-momentum": "SGD, momentum", "sgd": "SGD", "none": "no optimizer"}
    setup = short.get(step.optimizer_kind, step.optimizer_kind.removeprefix("adamw-"))
    if step.model == "gpt":
        setup += ", SDPA" if step.gpt.sdpa else ", materialized"
        setup += ", ckpt" if step.checkpointing else ""
    note = ""
    if step.optimizer_kind == "sgd" and step.model != "mlp":
        note = "the GradScaler skipped every step: no momentum buffer yet"
    if step.model == "simplecnn":
        note = "not predicted: convolution workspaces? (bounded below)"
    return {
        "model": row["model"],
        "batch": row["batch"],
        "precision": step.precision,
        "setup": setup,
        "predicted": predicted,
        "before": before,
        "with_start": predicted + before,
        "measured": measured,
        "error": predicted / measured - 1,
        "error_with_start": (predicted + before) / measured - 1,
        "moment": p.moment,
        "note": note,
    }


def format_recorded_rows(rows: list[dict]) -> str:
    """Chapter 10: predicted_recorded_row's rows as a table, in MiB, the errors in percent, the
    rows' notes below it."""
    mib = 2.0**20
    columns = [
        ("model", "model", "<"),
        ("b", "batch", ""),
        ("precision", "precision", "<"),
        ("setup", "setup", "<"),
        ("predicted", lambda r: r["predicted"] / mib, ",.1f"),
        ("before", lambda r: r["before"] / mib, ".1f"),
        ("measured", lambda r: r["measured"] / mib, ",.1f"),
        ("error %", lambda r: 100 * r["error"], "+.2f"),
        ("+before %", lambda r: 100 * r["error_with_start"], "+.2f"),
    ]
    notes = [f"{r['model']} b={r['batch']} {r['precision']}: {r['note']}" for r in rows if r["note"]]
    head = "MiB; 'before': held before the step beyond what it names; errors against the measured peak"
    return "\n".join([head, table(rows, columns), *notes])


def convolution_gap(row: dict) -> dict[str, dict[str, int]]:
    """Chapter 10: what a recorded convolutional row holds beyond the walk, phase by phase, in bytes:
    "missing", the phase's measured peak minus the predicted one (the batch and what was held before
    the step added); "one buffer", how large a single buffer alive during one convolution (forward,
    or its backward) alone would have to be to make that convolution's moment the measured peak: the
    smallest over the convolutions, so a workspace that explains the gap is at least that large."""
    p, r = predict_step(recorded_step(row)), predicted_recorded_row(row)
    extra = row["batch_bytes"] + r["before"]
    out = {}
    for phase in ("forward", "backward"):
        moments = {k: v + extra for k, v in p.moments.items() if k.startswith(phase + ":")}
        convolutions = [v for k, v in moments.items() if re.search(r"conv\d?$", k)]
        measured = row["phases"][phase]["peak"]
        out[phase] = {"missing": measured - max(moments.values()), "one buffer": measured - max(convolutions)}
    return out
