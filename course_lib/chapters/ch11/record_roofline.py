"""Records a GPU's roofline for chapter 11: its ceilings, Tensor-Core shapes, fp8 matmuls and profiled steps.

    python -m course_lib.chapters.ch11.record_roofline --json data/reference/roofline_<gpu>.json

"matmul": square matmuls per dtype and size (TF32 as labelled); "bandwidth": a copy, a sum and a
scale over 1 GiB; "launch": a one-element op back to back and waited for; "shapes": the GPT's output
layer with the real and the padded vocabulary, and K around 4,096; "fp8": bf16 against e4m3
`torch._scaled_mm` (tensorwise, rowwise), alone and with the casts (chapter 11's fp8.py); "ops": the
profiled ATen ops of real training steps (the core's `amp_step`); "cuda_graphs": the small CNN eager
and as one CUDA graph. course_lib.chapters.ch11.roofline, step_profile and chapter 09's
recorded_profiles read the file. On a CPU the same code runs at toy size, to test it, not to record.
"""

from __future__ import annotations

import sys

import torch

from course_lib.chapters.ch09.record_questions import (
    back_to_back_ms,
    gpt_setup,
    one_step,
    op_table,
    profile_trace,
    run_recorder,
)
from course_lib.chapters.ch11.fp8 import amax_scales, fp8_matmul, to_fp8
from course_lib.device import tf32
from course_lib.models import SimpleCNN
from course_lib.tables import table
from course_lib.timing import time_fn

__all__: list[str] = []  # a recorder: the chapter reads its file through roofline and step_profile


def matmul_row(
    device: torch.device, m: int, k: int, n: int, dtype: torch.dtype, allow_tf32: bool = False, iters: int = 20
) -> dict:
    """One (m x k) @ (k x n) matmul in `dtype`, timed back to back: {"m", "k", "n", "ms", "ms_min", "ms_max",
    "tflops"}."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    with tf32(allow_tf32):
        t = back_to_back_ms(lambda: a @ b, iters=iters, device=device)
    return {"m": m, "k": k, "n": n, **t, "tflops": 2 * m * k * n / (t["ms"] * 1e-3) / 1e12}


def fp8_row(device: torch.device, m: int, k: int, n: int, iters: int = 20) -> dict:
    """bf16 matmul against fp8 e4m3 _scaled_mm (tensorwise, rowwise scales: fp8.py's amax_scales and
    to_fp8), the operands cast beforehand and, through fp8_matmul, with the casts."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    bt = torch.randn(n, k, device=device, dtype=torch.bfloat16).t()  # column-major (k x n), as cuBLAS wants it
    row = {"m": m, "k": k, "n": n, "bf16_ms": back_to_back_ms(lambda: a @ bt, iters=iters, device=device)["ms"]}
    for mode in ("tensorwise", "rowwise"):
        try:
            scale_a, scale_b = amax_scales(a, bt, mode)
            a8, b8 = to_fp8(a, scale_a), to_fp8(bt, scale_b)  # b8 keeps bt's column-major layout

            def mm(a8=a8, b8=b8, inv_a=1 / scale_a, inv_b=1 / scale_b):
                return torch._scaled_mm(a8, b8, scale_a=inv_a, scale_b=inv_b, out_dtype=torch.bfloat16)

            ref = a.float() @ bt.float()
            err = ((mm().float() - ref).norm() / ref.norm()).item()
            t = back_to_back_ms(mm, iters=iters, device=device)
            tc = back_to_back_ms(
                lambda mode=mode: fp8_matmul(a, bt, mode, out_dtype=torch.bfloat16), max(iters // 2, 2), device
            )
            row[f"{mode}_ms"] = t["ms"]
            row[f"{mode}_with_cast_ms"] = tc["ms"]
            row[f"{mode}_rel_error"] = err
        except (RuntimeError, TypeError, NotImplementedError) as e:
            row[f"{mode}_error"] = str(e).splitlines()[0][:200]
    row["bf16_tflops"] = 2 * m * k * n / (row["bf16_ms"] * 1e-3) / 1e12
    return row


def _ceilings(device: torch.device, big: bool) -> list[dict]:
    sizes = (512, 1024, 2048, 4096, 8192) if big else (128, 256, 512)
    rows = []
    for label, dtype, allow in (
        ("fp32", torch.float32, False),
        ("tf32", torch.float32, True),
        ("bf16", torch.bfloat16, False),
        ("fp16", torch.float16, False),
    ):
        if device.type != "cuda" and label in ("tf32", "fp16"):
            continue
        for n in sizes:
            rows.append({"dtype": label, **matmul_row(device, n, n, n, dtype, allow, iters=20 if big else 3)})
    return rows


def _bandwidth(device: torch.device, big: bool) -> dict:
    """Memory bandwidth: copy (read + write), a read-only reduction, an elementwise op."""
    nbytes, iters = (2**30, 20) if big else (2**26, 3)
    x = torch.empty(nbytes // 4, device=device).normal_()
    y = torch.empty_like(x)
    return {
        "copy_gbps": 2 * nbytes / (back_to_back_ms(lambda: y.copy_(x), iters, device)["ms"] * 1e-3) / 1e9,
        "sum_gbps": nbytes / (back_to_back_ms(lambda: x.sum(), iters, device)["ms"] * 1e-3) / 1e9,
        "scale_gbps": 2
        * nbytes
        / (back_to_back_ms(lambda: torch.mul(x, 2.0, out=y), iters, device)["ms"] * 1e-3)
        / 1e9,
    }


def _shapes(device: torch.device, big: bool) -> list[dict]:
    """Tensor-Core shapes: the GPT's lm_head with the real and the padded vocabulary, and K around 4096."""
    rows, tokens = [], 16384 if big else 512
    dtypes = (
        ((torch.bfloat16, "bf16"), (torch.float16, "fp16")) if device.type == "cuda" else ((torch.float32, "fp32"),)
    )
    for dtype, label in dtypes:
        for n in (50257, 50304):
            rows.append(
                {"what": "lm_head", "dtype": label, **matmul_row(device, tokens, 768, n if big else n // 64, dtype)}
            )
        for k in (4088, 4095, 4096, 4097, 4104) if big else (255, 256):
            side = 4096 if big else 256
            rows.append({"what": "K sweep", "dtype": label, **matmul_row(device, side, k, side, dtype)})
    return rows


def _fp8(device: torch.device, big: bool) -> list[dict]:
    """fp8 against bf16: square sizes, then the GPT-2-small linear layers at 16,384 tokens."""
    rows, iters = [], 20 if big else 2
    if hasattr(torch, "float8_e4m3fn"):
        for s in (512, 1024, 2048, 4096, 8192, 16384) if big else (64, 128):
            rows.append({"what": "square", **fp8_row(device, s, s, s, iters=iters)})
        t, e, v = (16384, 768, 50304) if big else (128, 64, 512)
        for what, k, n in (("qkv", e, 3 * e), ("proj", e, e), ("fc", e, 4 * e), ("fc2", 4 * e, e), ("lm_head", e, v)):
            rows.append({"what": what, **fp8_row(device, t, k, n, iters=iters)})
    return rows


def _step_ops(device: torch.device, big: bool) -> dict[str, list[dict]]:
    """Per-op device times of real training steps (amp_step), with shapes and dtypes: the roofline's test set."""
    steps = {}
    model, opt, x, y, fwd = gpt_setup(device, 8 if big else 2, 1024 if big else 64)
    off = torch.amp.GradScaler(device.type, enabled=False)
    steps["gpt2 bf16 batch 8"] = one_step(model, opt, off, x, y, "bf16", forward=fwd)
    torch.manual_seed(0)
    cnn = SimpleCNN().to(device)
    cx, cy = torch.randn(256, 1, 28, 28, device=device), torch.randint(0, 10, (256,), device=device)
    copt = torch.optim.SGD(cnn.parameters(), lr=0.01, momentum=0.9)
    for label, precision in (("simplecnn fp32 batch 256", "fp32"), ("simplecnn bf16 batch 256", "bf16")):
        steps[label] = one_step(cnn, copt, off, cx, cy, precision)
    return {
        label: op_table(profile_trace(step, device, steps=3, shapes=True), 3, top=80) for label, step in steps.items()
    }


def roofline(device: torch.device) -> dict:
    """The whole payload; full size on a GPU, toy size elsewhere."""
    big = device.type == "cuda"
    out: dict = {"matmul": _ceilings(device, big), "bandwidth": _bandwidth(device, big)}
    # launch overhead: a one-element op, back to back (the GPU's rate) and each one waited for
    z = torch.zeros(1, device=device)
    out["launch"] = {
        "back_to_back_us": back_to_back_ms(lambda: z.add_(1), iters=2000, device=device)["ms"] * 1e3,
        "synchronized_us": time_fn(lambda: z.add_(1), warmup=10, iters=200, device=device).median_ms * 1e3,
    }
    out["shapes"] = _shapes(device, big)
    out["fp8"] = _fp8(device, big)
    out["ops"] = _step_ops(device, big)
    if big:  # the small CNN's step, eager and replayed as one CUDA graph (chapter 11, section 6)
        from course_lib.chapters.ch11.step_profile import cuda_graph_rows

        out["cuda_graphs"] = cuda_graph_rows()
    out["tf32_note"] = (
        "matmul rows: torch.backends.cuda.matmul.allow_tf32 as labelled; cuDNN keeps its default (TF32 on)"
    )
    return out


def summary(out: dict) -> str:
    """What a recording printed: the ceilings, bandwidths, launch times, shapes, fp8 rows and CUDA graphs."""
    parts = [table(out["matmul"], [("dtype", "dtype", "<"), ("n", "n", "d"), ("TFLOP/s", "tflops", ".1f")])]
    parts.append("bandwidth GB/s: " + ", ".join(f"{k} {v:.0f}" for k, v in out["bandwidth"].items()))
    parts.append("launch us: " + ", ".join(f"{k} {v:.2f}" for k, v in out["launch"].items()))
    for r in out["shapes"]:
        parts.append(
            f"{r['what']} {r['dtype']} m{r['m']} k{r['k']} n{r['n']}: {r['ms']:.3f} ms {r['tflops']:.0f} TFLOP/s"
        )
    for r in out["fp8"]:
        parts.append(
            f"fp8 {r['what']} {r['m']}x{r['k']}x{r['n']}: bf16 {r['bf16_ms']:.3f} ms, tensorwise "
            f"{r.get('tensorwise_ms', float('nan')):.3f} "
            f"({r.get('tensorwise_with_cast_ms', float('nan')):.3f} with casts), "
            f"rowwise {r.get('rowwise_ms', float('nan')):.3f}"
        )
    for r in out.get("cuda_graphs", []):
        parts.append(f"cuda graph {r['mode']}: eager {r['eager_ms']:.3f} ms, graph {r['graph_ms']:.3f} ms")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    # --deadline is accepted as the other recorders take it: every part here is kept
    return run_recorder(
        "course_lib.chapters.ch11.record_roofline", __doc__, lambda device, _: roofline(device), summary, argv
    )


if __name__ == "__main__":
    sys.exit(main())
