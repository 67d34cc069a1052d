"""What the recorded GPU profiles say, chapter 09: each function reads a recorded file and returns sentences
computed from its numbers.

`python -m course_lib.chapters.ch09.record_questions` profiled three open questions on a GPU
(questions_<gpu>.json): why the course's small CNN gets slower with AMP there (`read_host_bound`), why
fp16 trains ResNet-50 faster than bf16 (`read_batch_norm`), and what holds the GPT's MFU (`read_mfu`).
Chapter 11's `record_roofline` timed the GPT's output layer with the real and the padded vocabulary
(`read_vocab_padding`; `vocab_padding_times` measures it here). `read_checkpointing` reads the
checkpointing rows of the ladder in bytes.
"""

from __future__ import annotations

import textwrap

import torch

from course_lib.tables import table
from course_lib.timing import time_fn

__all__ = [
    "read_fp8",
    "read_host_bound",
    "read_batch_norm",
    "read_mfu",
    "vocab_padding_times",
    "read_vocab_padding",
    "read_checkpointing",
    "read_cell_times",
]


# The share of the MFU formula's attention FLOPs (12*L*E*T per token: the full score matrix, forward and
# backward) that causal kernels compute: the lower triangle, half of it.
_CAUSAL_SHARE = 0.5


def _fill(text: str) -> str:
    return textwrap.fill(text, 100, subsequent_indent="    ")


def read_host_bound(profiles: dict[str, dict]) -> str:
    """Chapter 09: the small CNN's recorded steps (questions_<gpu>.json "simplecnn"): wall time against the
    GPU's kernel time and the number of kernels launched, per mode, and what that says about AMP there."""
    columns = [
        ("mode", lambda mode: mode, ""),
        ("ms/step", lambda mode: profiles[mode]["ms_per_step"], ".2f"),
        ("GPU kernels, ms", lambda mode: profiles[mode]["kernels"]["gpu_us_per_step"] / 1e3, ".2f"),
        ("kernels/step", lambda mode: profiles[mode]["kernels"]["kernels_per_step"], ".0f"),
        (
            "GPU busy",
            lambda mode: profiles[mode]["kernels"]["gpu_us_per_step"] / 1e3 / profiles[mode]["ms_per_step"],
            ".0%",
        ),
    ]
    out = [table(profiles, columns)]
    base, low = profiles.get("fp32"), profiles.get("bf16")
    if base and low:
        kb, kl = base["kernels"], low["kernels"]
        out.append(
            _fill(
                f"bf16 cut the GPU's kernel time from {kb['gpu_us_per_step'] / 1e3:.2f} to "
                f"{kl['gpu_us_per_step'] / 1e3:.2f} ms, yet the step went from {base['ms_per_step']:.2f} to "
                f"{low['ms_per_step']:.2f} ms. The GPU is busy for only part of each step; the rest is the "
                f"host, launching {kl['kernels_per_step']:.0f} kernels instead of {kb['kernels_per_step']:.0f} "
                "(autocast's casts among them)."
                + (
                    " A step the host sets is not made faster by faster arithmetic."
                    if low["ms_per_step"] >= base["ms_per_step"]
                    else ""
                )
            )
        )
    return "\n".join(out)


def _batch_norm_op(ops: list[dict]) -> str:
    """The ATen batch-norm op that took the most time in a recorded op table."""
    norms = [o for o in ops if "batch_norm" in o["op"] and "backward" not in o["op"]]
    return max(norms, key=lambda o: o["us"])["op"] if norms else "?"


def read_batch_norm(profiles: dict[str, dict]) -> str:
    """Chapter 09: ResNet-50 + channels_last in fp16 against bf16 (questions_<gpu>.json "resnet50"): images/s,
    GPU time per step by kind of kernel, and which batch-norm implementation each precision ran."""
    classes = ("conv/gemm", "batch_norm", "elementwise", "reduce", "copy/cast", "optimizer")
    columns = [("AMP", lambda prec: prec, ""), ("images/s", lambda prec: profiles[prec]["images_per_s"], ".0f")]
    columns += [(c, lambda prec, c=c: profiles[prec]["kernels"]["by_class_us"].get(c, 0) / 1e3, ".1f") for c in classes]
    columns += [("batch-norm op", lambda prec: _batch_norm_op(profiles[prec]["ops"]), "<")]
    out = [table(profiles, columns)]
    out.append("(GPU milliseconds per step by kind of kernel)")
    fp16, bf16 = profiles.get("fp16"), profiles.get("bf16")
    if fp16 and bf16:
        f, b = fp16["kernels"]["by_class_us"], bf16["kernels"]["by_class_us"]
        gap = (bf16["kernels"]["gpu_us_per_step"] - fp16["kernels"]["gpu_us_per_step"]) / 1e3
        bn_gap = (b.get("batch_norm", 0) - f.get("batch_norm", 0)) / 1e3
        out.append(
            _fill(
                f"fp16 trained {fp16['images_per_s'] / bf16['images_per_s']:.2f}x as fast as bf16. Of the "
                f"{gap:.1f} ms of GPU time per step that bf16 spends more, batch norm accounts for {bn_gap:.1f} ms: "
                f"in fp16 PyTorch runs {_batch_norm_op(fp16['ops'])}, in bf16 "
                f"{_batch_norm_op(bf16['ops'])}, its own kernels. The convolutions and matmuls take "
                f"{b.get('conv/gemm', 0) / 1e3:.1f} against {f.get('conv/gemm', 0) / 1e3:.1f} ms."
            )
        )
    return "\n".join(out)


def read_mfu(gpt: dict) -> str:
    """Chapter 09: the GPT-2-small recipe's recorded profile (questions_<gpu>.json "gpt"): MFU per batch and
    where the GPU time of a step went: matmuls, attention, fused Triton kernels, the optimizer."""
    peak = gpt.get("mfu_peak_tflops")
    out = []
    for r in gpt["rows"]:
        if "mfu" not in r:
            continue
        k = r["kernels"]
        step_us = r["ms_per_step"] * 1e3
        shares = ", ".join(f"{c} {us / step_us:.0%}" for c, us in k["by_class_us"].items() if us / step_us >= 0.01)
        # the record's attention rate counts the MFU formula's 12*L*E*T FLOPs per token: the whole T x T score
        # matrix; the causal kernels compute its lower half, 6*L*E*T
        causal = r["attention_tflops"] * _CAUSAL_SHARE
        out.append(
            _fill(
                f"batch {r['batch']} x {r['seq']}: {r['ms_per_step']:.1f} ms per step, MFU {r['mfu']:.1%} of "
                f"{peak:.0f} TFLOP/s; the GPU was busy {r['gpu_busy']:.0%} of the step: {shares}. The matmuls ran "
                f"at {r['gemm_tflops']:.0f} TFLOP/s ({r['gemm_tflops'] / peak:.0%} of the peak); attention at "
                f"{causal:.0f} TFLOP/s ({causal / peak:.0%}) counting the causal half its kernels compute, "
                f"{r['attention_tflops']:.0f} by the MFU formula, which counts the masked half too."
            )
        )
    return "\n".join(out)


def vocab_padding_times(
    tokens: int = 1024, width: int = 768, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> dict[int, float]:
    """Chapter 09: ms for the GPT's output layer, a (tokens x width) @ (width x vocab) matmul in `dtype`, with
    GPT-2's 50,257 words and with the vocabulary padded to 50,304 (a multiple of 64), measured here. On a GPU
    pass its 16-bit type: the alignment that padding buys is the Tensor Cores', and fp32 does not use them."""
    out = {}
    for vocab in (50257, 50304):
        x = torch.randn(tokens, width, device=device, dtype=dtype)
        w = torch.randn(width, vocab, device=device, dtype=dtype)
        out[vocab] = time_fn(lambda x=x, w=w: x @ w, warmup=2, iters=5, device=device).median_ms
    return out


def _mkn(r: dict) -> str:
    """A recorded matmul's shape, M x K x N."""
    return f"{r['m']} x {r['k']} x {r['n']}"


def read_vocab_padding(shapes: list[dict]) -> str:
    """Chapter 09: the recorded output-layer and K-sweep matmuls (roofline_<gpu>.json "shapes") as a table,
    with the padded vocabulary's speed-up in words."""
    out = [
        table(
            shapes,
            [
                ("matmul", "what", ""),
                ("dtype", "dtype", "<"),
                ("M x K x N", _mkn, ""),
                ("ms", "ms", ".3f"),
                ("TFLOP/s", "tflops", ".0f"),
            ],
        )
    ]
    for dtype in sorted({r["dtype"] for r in shapes}):
        head = {r["n"]: r["ms"] for r in shapes if r["what"] == "lm_head" and r["dtype"] == dtype}
        if {50257, 50304} <= set(head):
            out.append(
                f"{dtype}: 47 more vocabulary columns (50,304) made the output layer {head[50257] / head[50304]:.1f}x "
                "faster"
            )
    return "\n".join(out)


def read_checkpointing(rows: list[dict]) -> str:
    """Chapter 09: the checkpointing rows (without, with) in bytes: how far the peak and the bytes saved for
    backward fell, each in GiB, and the time it cost."""
    a, b = rows
    saved = (a["saved_mib"] - b["saved_mib"]) / 1024
    out = [f"saved for backward: {a['saved_mib'] / 1024:.2f} -> {b['saved_mib'] / 1024:.2f} GiB ({saved:.2f} GiB less)"]
    if a.get("peak_memory_gib") and b.get("peak_memory_gib"):
        peak = a["peak_memory_gib"] - b["peak_memory_gib"]
        out.append(f"peak: {a['peak_memory_gib']:.2f} -> {b['peak_memory_gib']:.2f} GiB ({peak:.2f} GiB less)")
        out.append(
            _fill(
                f"The peak fell by {peak / saved:.0%} of what the blocks stopped saving"
                + (
                    ": the saved activations were part of the peak, and checkpointing removed them."
                    if peak > 0.9 * saved
                    else "."
                )
                + f" The {b['peak_memory_gib']:.2f} GiB left are what checkpointing does not touch."
            )
        )
    out.append(f"time per step: x{b['ms_per_step'] / a['ms_per_step']:.2f} (the blocks' forward runs twice)")
    return "\n".join(out)


def read_fp8(gemms: list[dict], gpt: dict | None = None) -> str:
    """Chapter 09: fp8 (e4m3, tensorwise scales) against bf16 on a recorded GPU: each matmul's time alone
    and with the casts to fp8 done in eager PyTorch (roofline_<gpu>.json "fp8"), then, if given, GPT-2
    small trained with torchao's float8 against bf16 (fp8gpt_<gpu>.json): step time and final loss."""
    columns = [
        ("matmul", "what", ""),
        ("M x K x N", _mkn, ""),
        ("bf16 ms", "bf16_ms", ".3f"),
        ("fp8 ms", "tensorwise_ms", ".3f"),
        ("speed-up", lambda r: f"{r['bf16_ms'] / r['tensorwise_ms']:.2f}x", ""),
        ("with casts", lambda r: f"{r['bf16_ms'] / r['tensorwise_with_cast_ms']:.2f}x", ""),
    ]
    out = [table([r for r in gemms if "tensorwise_ms" in r], columns)]  # a matmul fp8 could not run has no row
    rows = [r for r in (gpt or {}).get("rows", []) if "ms_per_step" in r]
    if rows:
        base = rows[0]
        for r in rows:
            tail = r["losses"][-5:]
            out.append(
                f"GPT-2 small, {r['recipe']:<10} batch {r['batch']} x {r['seq']}: {r['ms_per_step']:.1f} ms per step, "
                f"x{base['ms_per_step'] / r['ms_per_step']:.2f}; loss at the end {sum(tail) / len(tail):.3f}"
            )
    return "\n".join(out)


def read_cell_times(ref: dict, notebook: str) -> str:
    """Chapter 09: how long `notebook` ("notebooks/09_capstone.ipynb") took in a recorded GPU test run
    (celltimes_<gpu>.json, made by tools/celltimes.py): in all, and each cell that took over a second,
    `gpu` cells marked."""
    run = ref["notebooks"].get(notebook)
    if run is None:
        return f"{notebook} is not in this record"
    out = [f"{notebook}: {run['total_s']:.0f} s in all; the cells over a second:"]
    for cell in run["cells"]:
        if cell["seconds"] >= 1:
            tag = " (gpu)" if cell.get("gpu_tag") else ""
            out.append(f"  {cell['seconds']:6.1f} s{tag}  {cell['first_line'][:70]}")
    return "\n".join(out)
