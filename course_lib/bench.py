"""Timing done right, peak memory, MFU, and the FP32 / TF32 / AMP table of seed article 000.

Chapter 00 runs the table on your hardware; chapters 06 and 09 explain every line.

    python -m course_lib.bench                      # table for this machine
    python -m course_lib.bench --json out.json      # also write it, with provenance

Rules every measurement here follows (chapter 06): warm up first (cuDNN autotuning, lazy
allocations, first-call compilation); synchronize the GPU before reading a clock, because
CUDA calls return before the work is done; report the median of several runs, not one.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .device import pick_device, recommend_precision

# Dense peak TFLOP/s from the vendors' datasheets (sparse figures halved). Sources are listed in
# ../shared/research/perf_anchors.md §1 (T4, L4, A100, H100, H200); A10 and V100 from NVIDIA's
# A10 and V100 datasheets. None = no Tensor Core path for that dtype on that GPU.
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
}
# How torch.cuda.get_device_name() spells them. Order matters: the first match wins, and a
# name we do not recognise (H100 NVL, A10G, RTX cards ...) gets "unknown", never a guess.
_GPU_PATTERNS = [
    ("H200", r"H200"), ("H100 PCIe", r"H100.*PCIe"), ("H100 SXM", r"H100.*(HBM3|SXM)"),
    ("A100", r"A100"), ("A10", r"\bA10$"), ("L4", r"\bL4$"), ("T4", r"\bT4$"),
    ("V100 SXM2", r"V100.*SXM2"), ("V100 PCIe", r"V100.*PCIE"),
]


def gpu_key(name: str) -> str | None:
    """Chapter 06: the PEAK_TFLOPS row for a device name, or None if we do not know it."""
    for key, pattern in _GPU_PATTERNS:
        if re.search(pattern, name, flags=re.I):
            return key
    return None


def peak_tflops(name: str, dtype: str) -> float | None:
    """Chapter 06: datasheet dense peak for `dtype` ('fp32', 'tf32', 'fp16', 'bf16'); None = unknown."""
    key = gpu_key(name)
    return PEAK_TFLOPS[key].get(dtype) if key else None


def mfu(achieved_tflops: float, name: str, dtype: str) -> float | None:
    """Chapter 09: model FLOPs utilisation = achieved / peak; None where the peak is unknown."""
    peak = peak_tflops(name, dtype)
    return achieved_tflops / peak if peak else None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass
class Timing:
    """Chapter 06: several timed runs of one function, in milliseconds."""
    times_ms: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    def __str__(self) -> str:
        return f"median {self.median_ms:.3f} ms (min {min(self.times_ms):.3f}, max {max(self.times_ms):.3f}, n={len(self.times_ms)})"


def time_fn(fn: Callable[[], object], *, warmup: int = 3, iters: int = 10,
            device: torch.device | str | None = None) -> Timing:
    """Chapter 06: time `fn` properly: warm-up, synchronised clocks, `iters` samples.

    On CUDA each sample is bracketed by CUDA events (GPU time, no host jitter); elsewhere by
    time.perf_counter after a synchronize.
    """
    dev = torch.device(device) if device is not None else pick_device()
    for _ in range(warmup):
        fn()
    synchronize(dev)
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            synchronize(dev)
            times.append((time.perf_counter() - t0) * 1e3)
    return Timing(times)


def peak_memory_bytes(fn: Callable[[], object], device: torch.device | str | None = None) -> int | None:
    """Chapter 06: peak CUDA memory allocated while `fn` runs; None off CUDA (no allocator stats)."""
    dev = torch.device(device) if device is not None else pick_device()
    if dev.type != "cuda":
        fn()
        return None
    synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    synchronize(dev)
    return torch.cuda.max_memory_allocated(dev)


def saved_activation_bytes(fn: Callable[[], object]) -> int:
    """Chapter 02: bytes of tensors autograd saves for backward while `fn` runs (any device).

    This is the memory AMP shrinks: saved activations in fp16/bf16 take half the bytes.
    Tensors saved twice (same storage) are counted once.
    """
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            seen[(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@contextlib.contextmanager
def tf32(enabled: bool):
    """Chapter 09: allow (or forbid) TF32 in fp32 matmuls and cuDNN convolutions, then restore.

    PyTorch's defaults differ: fp32 matmuls do NOT use TF32 ('highest'), cuDNN convolutions DO.
    "Strict FP32" therefore needs both switched off.
    """
    old = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old[0])
        torch.backends.cudnn.allow_tf32 = old[1]


def matmul_tflops(n: int, dtype: torch.dtype, device: torch.device | str, *, allow_tf32: bool = False,
                  iters: int = 10) -> float:
    """Chapter 02: achieved TFLOP/s of an n x n x n matmul in `dtype` (2*n^3 FLOPs per call)."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    with tf32(allow_tf32):
        t = time_fn(lambda: a @ b, warmup=3, iters=iters, device=dev)
    return 2 * n ** 3 / (t.median_ms * 1e-3) / 1e12


def matmul_speed_table(n: int | None = None, device: str = "auto", iters: int = 10) -> list[dict]:
    """Chapter 02: matmul speed per dtype on this device, next to the datasheet peak.

    On a GPU this is where Tensor Cores show: fp16/bf16 (and TF32) run on them, strict fp32
    does not. n defaults to 8192 on CUDA (large enough to approach peak) and 512 on a CPU.
    """
    dev = pick_device(device)
    n = n or (8192 if dev.type == "cuda" else 512)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else ""
    specs = [("fp32 (strict)", torch.float32, False, "fp32"), ("tf32", torch.float32, True, "tf32"),
             ("fp16", torch.float16, False, "fp16"), ("bf16", torch.bfloat16, False, "bf16")]
    rows = []
    for label, dtype, allow, key in specs:
        if allow and dev.type != "cuda":
            continue  # TF32 is an NVIDIA Ampere+ mode; on a CPU the row would repeat strict fp32
        achieved = matmul_tflops(n, dtype, dev, allow_tf32=allow, iters=iters)
        peak = peak_tflops(name, key) if name else None
        rows.append({"dtype": label, "n": n, "tflops": achieved, "peak_tflops": peak,
                     "fraction_of_peak": achieved / peak if peak else None})
    return rows


def format_matmul_speed(rows: list[dict]) -> str:
    """Chapter 02: matmul_speed_table rows as text."""
    out = [f"{'dtype':<15}{'n':>7}{'TFLOP/s':>10}{'peak':>9}{'of peak':>9}"]
    for r in rows:
        peak = f"{r['peak_tflops']:.0f}" if r["peak_tflops"] else "n/a"
        frac = f"{r['fraction_of_peak']:.0%}" if r["fraction_of_peak"] else "n/a"
        out.append(f"{r['dtype']:<15}{r['n']:>7}{r['tflops']:>10.2f}{peak:>9}{frac:>9}")
    return "\n".join(out)


def provenance(command: str) -> dict:
    """Chapter 00: where and how a number was measured; stored with every reference result."""
    dev = pick_device()
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{dev.type}: {platform.processor() or platform.machine()}",
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(), "date": datetime.date.today().isoformat(), "command": command,
    }


# Input shape, constructor arguments and class count of each model the table can run.
WORKLOADS: dict[str, tuple[tuple[int, ...], dict, int]] = {
    "simplecnn": ((1, 28, 28), {"in_channels": 1}, 10),
    "mlp": ((1, 28, 28), {"in_features": 784}, 10),
    "small_resnet": ((3, 32, 32), {"in_channels": 3}, 10),
    "resnet50": ((3, 224, 224), {"num_classes": 1000}, 1000),
}


def load_references(pattern: str = "*.json") -> list[dict]:
    """Chapter 00: reference results recorded on GPUs, from data/reference/, each with provenance."""
    from .data import DATA_DIR
    out = []
    for path in sorted((DATA_DIR / "reference").glob(pattern)):
        with open(path) as f:
            out.append({"file": path.name, **json.load(f)})
    return out


def report(module: str, argv: list[str] | None, rows: list[dict], text: str, json_path: str | None) -> dict:
    """Chapter 00: print a measured table under its provenance line; with json_path, save both.

    Every CLI that records a reference result for data/reference/ goes through here, so every
    file carries the same provenance fields.
    """
    prov = provenance(f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"{prov['device']} | torch {prov['torch']} | CUDA {prov['cuda']} | {prov['date']}")
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"provenance": prov, "rows": rows}, f, indent=2)
        print(f"wrote {json_path}")
    return prov


def default_workload(device: torch.device) -> tuple[str, int, int]:
    """Chapter 00: (model, batch, steps): ResNet-50 at 224 px on a GPU (seed 000's model), SimpleCNN on a CPU."""
    return ("resnet50", 128, 20) if device.type == "cuda" else ("simplecnn", 64, 5)


def precision_table(model: str | None = None, batch: int | None = None, steps: int | None = None,
                    device: str = "auto") -> list[dict]:
    """Chapter 00: the FP32 / TF32 / AMP comparison of seed 000, measured with course_lib.train.

    Each row trains the same model on the same synthetic on-device batch with the course's
    own Trainer.train_step, so it measures the real loop. AMP uses the precision the course
    recommends for this device (bf16 on Ampere+, fp16 + GradScaler on T4/V100), and
    channels_last for conv nets on CUDA.
    """
    from .data import synthetic_batches
    from .models import build_model
    from .train import Trainer, TrainConfig

    dev = pick_device(device)
    d_model, d_batch, d_steps = default_workload(dev)
    model, batch, steps = model or d_model, batch or d_batch, steps or d_steps
    shape, kwargs, num_classes = WORKLOADS[model]
    (x, y), = synthetic_batches(1, batch, shape=shape, num_classes=num_classes, device=dev, seed=0)
    amp = recommend_precision(dev).precision
    rows_spec = [("FP32 (strict)", "fp32", False, False), ("TF32", "fp32", True, False),
                 (f"AMP {amp}" + (" + channels_last" if dev.type == "cuda" else ""), amp, False, dev.type == "cuda")]
    rows = []
    for label, precision, allow_tf32, channels_last in rows_spec:
        if allow_tf32 and dev.type != "cuda":
            rows.append({"mode": label, "note": "TF32 exists only on NVIDIA Ampere+ GPUs"})
            continue
        torch.manual_seed(0)
        net = build_model(model, **kwargs)
        cfg = TrainConfig(precision=precision, device=str(dev), channels_last=channels_last, progress=False, log_every=10**9)
        trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9), cfg)
        step = functools.partial(trainer.train_step, [(x, y)])
        with tf32(allow_tf32):
            timing = time_fn(step, warmup=3, iters=steps, device=dev)
            peak = peak_memory_bytes(step, dev)
        rows.append({"mode": label, "precision": precision, "tf32": allow_tf32, "channels_last": channels_last,
                     "model": model, "batch": batch, "ms_per_step": timing.median_ms,
                     "samples_per_s": batch / timing.median_ms * 1e3,
                     "peak_memory_gib": peak / 2**30 if peak is not None else None})
        # Free this row's model, gradients and optimizer state before the next row is measured:
        # max_memory_allocated counts everything still allocated, so a leftover would inflate it.
        del step, trainer, net
    base = rows[0]["ms_per_step"]
    for r in rows:
        if "ms_per_step" in r:
            r["speedup_vs_fp32"] = base / r["ms_per_step"]
    return rows


def format_table(rows: list[dict]) -> str:
    """Chapter 00: the rows of precision_table as a fixed-width text table."""
    out = [f"{'mode':<28}{'ms/step':>10}{'samples/s':>12}{'speed-up':>10}{'peak mem':>11}"]
    for r in rows:
        if "ms_per_step" not in r:
            out.append(f"{r['mode']:<28}  skipped: {r['note']}")
            continue
        mem = f"{r['peak_memory_gib']:.2f} GiB" if r["peak_memory_gib"] is not None else "n/a (CPU)"
        out.append(f"{r['mode']:<28}{r['ms_per_step']:>10.2f}{r['samples_per_s']:>12.0f}{r['speedup_vs_fp32']:>9.2f}x{mem:>11}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.bench", description="FP32 / TF32 / AMP training-step table for this machine")
    p.add_argument("--model", choices=["simplecnn", "mlp", "small_resnet", "resnet50"])
    p.add_argument("--batch", type=int)
    p.add_argument("--steps", type=int, help="timed steps per row (median reported)")
    p.add_argument("--device", default="auto")
    p.add_argument("--matmul", action="store_true", help="time an n^3 matmul per dtype instead (chapter 02)")
    p.add_argument("--n", type=int, help="matrix size for --matmul")
    p.add_argument("--json", help="also write rows + provenance to this JSON file "
                                  "(data/reference/bench_<gpu>.json, or matmul_<gpu>.json with --matmul)")
    args = p.parse_args(argv)
    if args.matmul:
        rows = matmul_speed_table(args.n, args.device)
    else:
        rows = precision_table(args.model, args.batch, args.steps, args.device)
    report("course_lib.bench", argv, rows, format_matmul_speed(rows) if args.matmul else format_table(rows), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
