"""How fast a matmul runs in each precision on this device, next to the datasheet peak.

On a GPU this is where Tensor Cores show: fp16 (and bf16 and TF32 from Ampere on) runs on them,
strict fp32 does not. Chapter 01 compared their accuracy (course_lib.chapters.ch01.matmul) and
holds the datasheet peaks (PEAK_TFLOPS) these are read against.

    python -m course_lib.chapters.ch02.matmul_speed [--json data/reference/matmul_<gpu>.json]
"""

from __future__ import annotations

import argparse
import sys

import torch

from course_lib.chapters.ch01.matmul import peak_tflops
from course_lib.device import has_tf32, pick_device, tf32
from course_lib.reference import record
from course_lib.tables import table
from course_lib.timing import time_fn

__all__ = ["matmul_tflops", "matmul_speed_table", "format_matmul_speed"]


def matmul_tflops(
    n: int, dtype: torch.dtype, device: torch.device | str, *, allow_tf32: bool = False, iters: int = 10
) -> tuple[float, float]:
    """Chapter 02: achieved TFLOP/s of an n x n x n matmul in `dtype` (2 n^3 FLOPs): (median, spread).

    The spread is the interquartile range of the timed runs relative to their median."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    with tf32(allow_tf32):
        t = time_fn(lambda: a @ b, warmup=3, iters=iters, device=dev)
    return 2 * n**3 / (t.median_ms * 1e-3) / 1e12, t.rel_spread


def matmul_speed_table(n: int | None = None, device: str = "auto", iters: int = 10) -> list[dict]:
    """Chapter 02: matmul speed per dtype on this device, next to the datasheet peak.

    On a GPU this is where Tensor Cores show: fp16 runs on them (and bf16 and TF32 on sm_80+;
    on a T4 or V100 bf16 is emulated), strict fp32 does not. n defaults to 8192 on CUDA (large
    enough to approach peak), 512 on a CPU.
    """
    dev = pick_device(device)
    n = n or (8192 if dev.type == "cuda" else 512)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else ""
    specs = [
        ("fp32 (strict)", torch.float32, False, "fp32"),
        ("tf32", torch.float32, True, "tf32"),
        ("fp16", torch.float16, False, "fp16"),
        ("bf16", torch.bfloat16, False, "bf16"),
    ]
    rows = []
    for label, dtype, allow, key in specs:
        if allow and not has_tf32(dev):
            continue
        achieved, spread = matmul_tflops(n, dtype, dev, allow_tf32=allow, iters=iters)
        peak = peak_tflops(name, key) if name else None
        rows.append(
            {
                "dtype": label,
                "n": n,
                "tflops": achieved,
                "spread": spread,
                "peak_tflops": peak,
                "fraction_of_peak": achieved / peak if peak else None,
            }
        )
    return rows


def format_matmul_speed(rows: list[dict]) -> str:
    """Chapter 02: matmul_speed_table rows as text ("±" = interquartile range / median of the timings)."""
    columns = [
        ("dtype", "dtype", ""),
        ("n", "n", ""),
        ("TFLOP/s", "tflops", ".3g"),
        ("±", lambda r: r.get("spread", 0), ".0%"),
        ("peak", "peak_tflops", ".0f"),  # n/a: a CPU, or a GPU the datasheet table does not know
        ("of peak", "fraction_of_peak", ".0%"),
    ]
    return table(rows, columns)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m course_lib.chapters.ch02.matmul_speed", description="matmul TFLOP/s per dtype on this device"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--n", type=int, help="matrix size (default: 8192 on CUDA, 512 on a CPU)")
    p.add_argument("--json", help="also write rows + provenance (data/reference/matmul_<gpu>.json)")
    args = p.parse_args(argv)
    rows = matmul_speed_table(args.n, args.device)
    arguments = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python -m course_lib.chapters.ch02.matmul_speed", *arguments])
    record(command, format_matmul_speed(rows), args.json, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
