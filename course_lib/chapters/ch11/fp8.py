"""FP8 matmuls by hand: formats, scales, and what `torch._scaled_mm` computes (chapter 11).

An FP8 matmul on Hopper or Ada multiplies 8-bit operands on the Tensor Cores and accumulates in
fp32. Eight bits hold little range, so each operand is first *scaled* into the format's range and
the product is scaled back: with `scale = fp8_max / amax`,

    a8 = round_to_fp8(a * scale_a)      b8 = round_to_fp8(b * scale_b)
    a @ b  ~=  (a8 @ b8) / (scale_a * scale_b)

`torch._scaled_mm(a8, b8, scale_a=1/scale_a, scale_b=1/scale_b)` takes the *inverse* scales (what
to multiply the product by) and runs on a CPU too, so every number here can be checked without an
FP8 GPU. Tensorwise scaling uses one amax for a whole operand; rowwise uses one per row of `a` and
one per column of `b` (the rows and columns a dot product pairs), so one outlier row costs only its
own row's precision. Forward operands (activations, weights) use e4m3, which has more mantissa;
tensorwise recipes store gradients in e5m2, which has more range (torchao's rowwise recipe keeps e4m3
for them). Scales are computed from the current tensor (dynamic scaling): torchao removed delayed
scaling, which used an amax history, in its 0.10 release. Block scales (MX) are microscaling.py's.

On a CPU `torch._scaled_mm` needs a recent torch (SCALED_MM_ON_CPU): the cells that call it ask
`torch_at_least` first, and on an older torch print one line saying so.
"""

from __future__ import annotations

import torch

from course_lib.tables import table
from course_lib.timing import time_fn

__all__ = [
    "FP8_FORMATS",
    "SCALED_MM_ON_CPU",
    "fp8_max",
    "amax_scales",
    "to_fp8",
    "fp8_matmul",
    "fp8_matmul_by_hand",
    "fp8_gemm_sweep",
    "format_fp8_sweep",
]

FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# The first torch whose `_scaled_mm` runs on a CPU, per granularity, measured on 2026-11-29 (a Xeon with
# AMX-INT8, through oneDNN and with torch.backends.mkldnn off): 2.6 and 2.7 raise NotImplementedError
# (the CPU kernel, pytorch#150410, came after the 2.7 branch cut); 2.8 and 2.11 run tensorwise scales
# and assert one scale per operand for rowwise; 2.12 runs both.
SCALED_MM_ON_CPU = {"tensorwise": "2.8", "rowwise": "2.12"}


def fp8_max(fmt: str = "e4m3") -> float:
    """Chapter 11: the largest finite number of an FP8 format (448 for e4m3fn, 57,344 for e5m2)."""
    return float(torch.finfo(FP8_FORMATS[fmt]).max)


def amax_scales(
    a: torch.Tensor, b: torch.Tensor, granularity: str = "tensorwise", fmt: str = "e4m3"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chapter 11: the scales that map `a` (M x K) and `b` (K x N) into `fmt`'s range: fp8_max / amax,
    fp32. "tensorwise": one scalar each; "rowwise": a (M, 1) column for `a` (one per row) and a
    (1, N) row for `b` (one per column: the pairs a dot product multiplies)."""
    if granularity == "tensorwise":
        amax_a, amax_b = a.abs().amax(), b.abs().amax()
    elif granularity == "rowwise":
        amax_a, amax_b = a.abs().amax(dim=1, keepdim=True), b.abs().amax(dim=0, keepdim=True)
    else:
        raise ValueError(f"unknown granularity {granularity!r}; choose 'tensorwise' or 'rowwise'")
    tiny = torch.finfo(torch.float32).tiny  # an all-zero row would divide by zero
    top = fp8_max(fmt)
    return top / amax_a.float().clamp(min=tiny), top / amax_b.float().clamp(min=tiny)


def to_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """Chapter 11: `x * scale` rounded to `fmt`, saturated at its largest number first (a cast alone
    would turn an out-of-range e4m3 value into NaN)."""
    top = fp8_max(fmt)
    return (x.float() * scale).clamp(-top, top).to(FP8_FORMATS[fmt])


def fp8_matmul(
    a: torch.Tensor, b: torch.Tensor, granularity: str = "tensorwise", out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Chapter 11: `a @ b` through e4m3 with `torch._scaled_mm`, as torchao's float8 training runs a
    forward Linear (its second operand column-major, as cuBLAS wants it)."""
    scale_a, scale_b = amax_scales(a, b, granularity)
    a8, b8 = to_fp8(a, scale_a), to_fp8(b, scale_b)
    b8 = b8.t().contiguous().t()  # column-major
    return torch._scaled_mm(a8, b8, scale_a=1 / scale_a, scale_b=1 / scale_b, out_dtype=out_dtype)


def fp8_matmul_by_hand(a: torch.Tensor, b: torch.Tensor, granularity: str = "tensorwise") -> torch.Tensor:
    """Chapter 11: the same product written out: round both operands to e4m3, multiply them exactly in
    fp32, divide by the scales."""
    scale_a, scale_b = amax_scales(a, b, granularity)
    a8, b8 = to_fp8(a, scale_a), to_fp8(b, scale_b)
    return (a8.float() @ b8.float()) / (scale_a * scale_b)


SWEEP = ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (16384, 768, 3072))


def fp8_gemm_sweep(device: str = "cuda", shapes: tuple[tuple[int, int, int], ...] = SWEEP) -> list[dict]:
    """Chapter 11: for each (m, k, n), a bf16 matmul against the same product in e4m3 with tensorwise
    scales (`torch._scaled_mm`, bf16 out), operands quantized beforehand: the GEMMs alone, as
    `torch.compile` leaves them once it has fused the casts. On a GPU with FP8 Tensor Cores (sm_89
    and newer) this shows where FP8 starts to pay; elsewhere `_scaled_mm` is emulated."""
    rows = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device)
        b = torch.randn(k, n, device=device)
        scale_a, scale_b = amax_scales(a, b)
        a8 = to_fp8(a, scale_a)
        b8 = to_fp8(b, scale_b).t().contiguous().t()
        inv_a, inv_b = 1 / scale_a, 1 / scale_b
        a16, b16 = a.bfloat16(), b.bfloat16()
        bf16 = time_fn(lambda: a16 @ b16, device=device).median_ms
        fp8 = time_fn(
            lambda: torch._scaled_mm(a8, b8, scale_a=inv_a, scale_b=inv_b, out_dtype=torch.bfloat16), device=device
        ).median_ms
        rows.append({"m": m, "k": k, "n": n, "bf16_ms": bf16, "fp8_ms": fp8, "speedup": bf16 / fp8})
    return rows


def format_fp8_sweep(rows: list[dict]) -> str:
    """Chapter 11: fp8_gemm_sweep's rows as a table."""
    columns = [
        ("M x K x N", lambda r: f"{r['m']} x {r['k']} x {r['n']}", "<"),
        ("bf16 ms", "bf16_ms", ".3f"),
        ("fp8 ms", "fp8_ms", ".3f"),
        ("speed-up", "speedup", ".2f"),
    ]
    return table(rows, columns)
