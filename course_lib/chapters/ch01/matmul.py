"""Matrix multiplies in each precision: how accurate they are, against float64.

A matmul is where mixed precision pays and where it costs: on a GPU with a Tensor Core path
for the format (fp16 from Volta on; bf16 and TF32 from Ampere on; fp8 from Ada and Hopper on)
16-bit inputs are multiplied many times faster than fp32 (`peak_ratios_text` computes how much
faster from the datasheets; chapter 02 measures it, course_lib.chapters.ch02.matmul_speed), and
the products are summed in fp32, which keeps the error near the floor set by rounding the inputs.

The datasheet peaks they are compared with (PEAK_TFLOPS, fp8 too) are here; the TF32 switch
(`tf32`) is the core's (course_lib.device).

    python -m course_lib.chapters.ch01.matmul error [--json data/reference/formats_matmul_<gpu>.json]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from typing import Iterator, Sequence

import torch

from course_lib.chapters.ch01.formats import Format, get_format
from course_lib.device import has_tf32, pick_device, tf32
from course_lib.reference import record
from course_lib.tables import table

__all__ = [
    "matmul_error",
    "matmul_table",
    "matmul_table_text",
    "FP8_PEAK_TFLOPS",
    "PEAK_TFLOPS",
    "peak_tflops",
    "peak_ratios",
    "peak_ratios_text",
]

# Dense peak TFLOP/s from the vendors' datasheets (sparse figures halved); None = no Tensor
# Core path for that dtype on that GPU. Sources (public):
#   V100  https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
#   T4    https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf
#   A10   https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf
#   L4    https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet
#   A100  https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
#   H100/H200  https://www.nvidia.com/en-us/data-center/h100/ and https://www.nvidia.com/en-us/data-center/h200/
PEAK_TFLOPS: dict[str, dict[str, float | None]] = {
    "V100 SXM2": {"fp32": 15.7, "tf32": None, "fp16": 125.0, "bf16": None},
    "V100 PCIe": {"fp32": 14.0, "tf32": None, "fp16": 112.0, "bf16": None},
    "T4": {"fp32": 8.1, "tf32": None, "fp16": 65.0, "bf16": None},
    "A10": {"fp32": 31.2, "tf32": 62.5, "fp16": 125.0, "bf16": 125.0},
    "L4": {"fp32": 30.3, "tf32": 60.0, "fp16": 121.0, "bf16": 121.0},
    "A100": {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0},
    "H100 SXM": {"fp32": 66.9, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
    "H200": {"fp32": 66.9, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
    # The NVL (PCIe, lower power) cards of both: 60 fp32, 835 tf32 and 1,671 bf16/fp16 sparse.
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "fp16": 835.5, "bf16": 835.5},
    "H200 NVL": {"fp32": 60.0, "tf32": 417.5, "fp16": 835.5, "bf16": 835.5},
}
# How torch.cuda.get_device_name() spells them. Order matters: the first match wins, and a
# name we do not recognise (A10G, RTX cards ...) gets None, never a guess.
_GPU_PATTERNS = [
    ("H200 NVL", r"H200.*NVL"),
    ("H200", r"H200"),
    ("H100 NVL", r"H100.*NVL"),
    ("H100 PCIe", r"H100.*PCIe"),
    ("H100 SXM", r"H100.*(HBM3|SXM)"),
    ("A100", r"A100"),
    ("A10", r"\bA10$"),
    ("L4", r"\bL4$"),
    ("T4", r"\bT4$"),
    ("V100 SXM2", r"V100.*SXM2"),
    ("V100 PCIe", r"V100.*PCIE"),
]


def peak_tflops(name: str, dtype: str) -> float | None:
    """Chapter 01: datasheet dense peak of GPU `name` for 'fp32', 'tf32', 'fp16' or 'bf16'.

    None means no Tensor Core path for that dtype on that GPU, or a GPU not in the table.
    """
    key = next((k for k, pattern in _GPU_PATTERNS if re.search(pattern, name, flags=re.I)), None)
    return PEAK_TFLOPS[key].get(dtype) if key else None


# Dense fp8 Tensor Core peaks in TFLOP/s (the datasheets print them "with sparsity": halved here),
# for the GPUs of PEAK_TFLOPS above. None = no fp8 Tensor Cores (before Ada, sm_89, and Hopper,
# sm_90); a GPU missing here has them, but no figure is cited. Sources (public):
#   H100 SXM  FP8 3,958 (sparse)  https://www.nvidia.com/en-us/data-center/h100/
#   H200      FP8 3,958 (sparse)  https://www.nvidia.com/en-us/data-center/h200/
#   H100/H200 NVL  FP8 3,341 (sparse)  (the same pages)
#   L4        FP8   485 (sparse)  https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet
FP8_PEAK_TFLOPS: dict[str, float | None] = {
    "V100 SXM2": None,
    "V100 PCIe": None,
    "T4": None,
    "A10": None,
    "A100": None,
    "L4": 242.5,
    "H100 SXM": 1979.0,
    "H200": 1979.0,
    "H100 NVL": 1670.5,
    "H200 NVL": 1670.5,
}


def matmul_error(
    k: int,
    fmt: str | torch.dtype | Format,
    *,
    method: str = "torch",
    m: int = 64,
    n: int = 64,
    scaled: bool = False,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> float:
    """Chapter 01: relative error ||C - C_ref||_F / ||C_ref||_F of A @ B against float64.

    A (m×k) and B (k×n) are N(0, 1) float32 matrices, the reference is their exact float64 product.
    method
      "torch"   torch.matmul on tensors of the format on `device` (the backend's accumulation)
      "inputs"  only the inputs rounded to the format, product in float64: the error floor
      "naive"   k rank-1 updates C = C + a_i b_i^T with C kept in the format (16-bit accumulation)
    scaled: multiply each input by format.max / amax before rounding (fp8 recipes' per-tensor
    scale) and divide it out afterwards.
    """
    f = get_format(fmt)
    if f.dtype is None:
        raise ValueError("tf32 is a matmul mode, not a dtype: use fmt='fp32' inside tf32(True)")
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    ref = a.double() @ b.double()
    sa = f.max / a.abs().max().item() if scaled else 1.0
    sb = f.max / b.abs().max().item() if scaled else 1.0
    la, lb = (a * sa).to(f.dtype), (b * sb).to(f.dtype)
    if method == "torch":
        c = (la.to(device) @ lb.to(device)).cpu().double()
    elif method == "inputs":
        c = la.double() @ lb.double()
    elif method == "naive":
        c16 = torch.zeros(m, n, dtype=f.dtype)
        for i in range(k):
            c16 = c16 + la[:, i : i + 1] * lb[i : i + 1, :]
        c = c16.double()
    else:
        raise ValueError(f"method must be 'torch', 'inputs' or 'naive', not {method!r}")
    c = c / (sa * sb)
    return ((c - ref).norm() / ref.norm()).item()


@contextlib.contextmanager
def _reduced_precision_reduction(dtype: torch.dtype, allowed: bool) -> Iterator[None]:
    # cuBLAS may do parts of an fp16 (or bf16) GEMM's reduction in that 16-bit type unless told
    # not to; PyTorch has one flag per dtype, both True by default.
    flags = torch.backends.cuda.matmul
    name = (
        "allow_fp16_reduced_precision_reduction" if dtype == torch.float16 else "allow_bf16_reduced_precision_reduction"
    )
    old = getattr(flags, name)
    setattr(flags, name, allowed)
    try:
        yield
    finally:
        setattr(flags, name, old)


def matmul_table(ks: Sequence[int] = (256, 4096, 65536), device: str | torch.device = "cuda") -> list[dict]:
    """Chapter 01: matmul_error on `device` for each K, in every mode the GPU offers.

    Columns: fp32 with TF32 off ("fp32") and on ("fp32 TF32", only on sm_80+); fp16 and bf16
    with cuBLAS's reduced-precision reduction allowed (the default) and forbidden ("RR off");
    and each 16-bit format's floor (inputs rounded, exact product).
    """
    dev = torch.device(device)
    rows = []
    for k in ks:
        row: dict = {"K": k}
        with tf32(False):
            row["fp32"] = matmul_error(k, "fp32", device=dev)
        if has_tf32(dev):
            with tf32(True):
                row["fp32 TF32"] = matmul_error(k, "fp32", device=dev)
        for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            row[name] = matmul_error(k, name, device=dev)
            with _reduced_precision_reduction(dtype, False):
                row[f"{name} RR off"] = matmul_error(k, name, device=dev)
            row[f"{name} floor"] = matmul_error(k, name, method="inputs")
        rows.append(row)
    return rows


def matmul_table_text(rows: list[dict]) -> str:
    """Chapter 01: the rows of matmul_table as fixed-width text, one line per mode and a column
    per K (so that the eight modes of a GPU fit in 100 characters)."""
    modes = [{"mode": c} for c in rows[0] if c != "K"]  # one line per mode, one column per K
    columns = [("relative error", "mode", "")]
    columns += [(f"K = {r['K']}", lambda m, r=r: r[m["mode"]], ".2e") for r in rows]
    return table(modes, columns)


def peak_ratios(
    peaks: dict[str, dict[str, float | None]] = PEAK_TFLOPS, fp8: dict[str, float | None] = FP8_PEAK_TFLOPS
) -> list[dict]:
    """Chapter 01: per GPU, the datasheet peak of each 16-bit (and TF32) path over the fp32 peak,
    and fp8's over bf16's. None: no Tensor Core path for that format on that GPU (bf16 on a
    V100 or T4 still runs, emulated on the fp32 units); "n/a": no cited figure."""
    rows = []
    for gpu, p in peaks.items():
        row: dict = {"gpu": gpu, "fp32_tflops": p["fp32"]}
        for d in ("tf32", "fp16", "bf16"):
            row[f"{d}/fp32"] = p.get(d) / p["fp32"] if p.get(d) else None
        f8 = fp8.get(gpu, "n/a")
        row["fp8/bf16"] = f8 / p["bf16"] if isinstance(f8, float) and p.get("bf16") else f8
        rows.append(row)
    return rows


def peak_ratios_text(peaks: dict[str, dict[str, float | None]] = PEAK_TFLOPS) -> str:
    """Chapter 01: peak_ratios as a fixed-width table (datasheet figures: the same on every machine)."""

    def ratio(value: float | str | None) -> str:
        if isinstance(value, float):
            return f"{value:.1f}×"
        return value or "no Tensor Core path"  # "n/a": a path, but no cited figure

    columns = [("GPU", "gpu", ""), ("fp32", "fp32_tflops", "")]
    for key in ("tf32/fp32", "fp16/fp32", "bf16/fp32", "fp8/bf16"):
        columns.append((key.replace("/fp32", ""), lambda r, key=key: ratio(r[key]), ""))
    title = "dense datasheet peaks: fp32 in TFLOP/s, the others as multiples of it (fp8: of bf16)"
    return title + "\n" + table(peak_ratios(peaks), columns)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m course_lib.chapters.ch01.matmul", description="matmul error against float64, per mode"
    )
    p.add_argument("what", choices=["error"], help="kept for the recorded commands (chapter 02 times matmuls)")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", help="also write rows + provenance (data/reference/formats_matmul_<gpu>.json)")
    args = p.parse_args(argv)
    rows = matmul_table(device=pick_device(args.device))
    text = matmul_table_text(rows)
    command = "python -m course_lib.chapters.ch01.matmul " + " ".join(argv if argv is not None else sys.argv[1:])
    record(command, text, args.json, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
