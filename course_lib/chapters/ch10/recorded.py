"""A recorded GPU run's memory, predicted row by row with CUDA's rules (chapter 10, section 10).

`tools/gpu_study.py memory` measured each step on a GPU with the caching allocator's own counter
(`torch.cuda.max_memory_allocated`, reset at the start of each phase; data/reference/memory_*.json).
Its loop differs from the CPU measurement in three ways the prediction must follow: it keeps only
the loss (`model(x, y)[1]`, so the logits are freed after the forward), it uses fused AdamW (no
foreach temporary) and it counts the batch, made before the step. CUDA autocast differs from the
CPU's in one rule that matters here: a materialized softmax runs in fp32 (gpt_step_tensors,
device="cuda"). The cuBLAS workspaces were allocated before the run's baseline, so they are not in
its numbers. What the SimpleCNN rows hold beyond the walk is not predicted here (most likely
cuDNN's convolution workspaces; a GPU run has to say).
"""

from __future__ import annotations

from course_lib.chapters.ch02.step_memory import mlp_moments
from course_lib.chapters.ch04.cnn_memory import cnn_moments
from course_lib.chapters.ch10.memory_model import gpt_step_tensors, resnet50_moments
from course_lib.models import GPTConfig
from course_lib.tables import table

__all__ = ["predicted_recorded_row", "format_recorded_rows"]


def _backward_peak(moments: dict[str, int]) -> int:
    return max(n for moment, n in moments.items() if moment != "optimizer step")


def predicted_recorded_row(row: dict) -> dict:
    """Chapter 10: one row of a recorded memory run with its prediction: {"model", "batch",
    "precision", "setup" (what else differs), "predicted", "measured" (bytes: the step's peak,
    batch included), "error" (predicted / measured - 1), "note"}."""
    model, batch, precision = row["model"], row["batch"], row["precision"]
    note = ""
    if model == "gpt2":
        phases = gpt_step_tensors(
            GPTConfig(**row["config"]),
            batch,
            row["seq"],
            precision,
            row["checkpointing"],
            device="cuda",
            logits_held=False,
            optimizer=row["optimizer"],
        )
        predicted = max(sum(t.nbytes for t in held) for held in phases.values())
        setup = ", ".join(
            [row["optimizer"] + " AdamW", "SDPA" if row["sdpa"] else "textbook attention"]
            + (["checkpointing"] if row["checkpointing"] else [])
        )
    elif model == "mlp":  # forward and backward only: no optimizer
        predicted = _backward_peak(mlp_moments(row["width"], row["depth"], batch, precision))
        setup = f"{row['width']} x {row['depth']}, no optimizer"
    elif model == "simplecnn":  # SGD with momentum: one fp32 buffer per parameter, besides the walk's
        predicted = _backward_peak(cnn_moments(64, batch, row["shape"][-1], precision)) + 4 * row["param_count"]
        setup = "SGD, momentum"
        note = "not predicted: convolution workspaces?"
    elif model == "resnet50":
        # Whether SGD ever made its momentum buffer, read from the record: at the start of the measured
        # step the run holds weights, gradients and the batch, and the buffer only if a step has run.
        state = row["phases"]["start"]["allocated"] - row["model_bytes"] - row["batch_bytes"]
        momentum = state > 1.5 * row["model_bytes"]
        predicted = _backward_peak(resnet50_moments(batch, row["shape"][-1], precision, momentum=momentum))
        setup = "SGD, momentum"
        if not momentum:
            note = "GradScaler skipped every step: no momentum buffer yet"
    else:
        raise ValueError(f"no prediction for model {model!r}")
    predicted += row["batch_bytes"]
    measured = row["peak_bytes"]
    return {
        "model": model,
        "batch": batch,
        "precision": precision,
        "setup": setup,
        "predicted": predicted,
        "measured": measured,
        "error": predicted / measured - 1,
        "note": note,
    }


def format_recorded_rows(rows: list[dict]) -> str:
    """Chapter 10: predicted_recorded_row's rows as a table, in GiB, the error in percent."""
    gib = 2.0**30
    columns = [
        ("model", "model", "<"),
        ("batch", "batch", ""),
        ("precision", "precision", "<"),
        ("setup", "setup", "<"),
        ("predicted GiB", lambda r: r["predicted"] / gib, ".3f"),
        ("measured GiB", lambda r: r["measured"] / gib, ".3f"),
        ("error", lambda r: 100 * r["error"], "+.2f"),
        ("note", "note", "<"),
    ]
    return table(rows, columns)
