"""Predicting an op's time from two measured ceilings: the roofline (chapter 11).

An op needs FLOPs and moves bytes. A machine does at most `peak` FLOP/s (its matmul ceiling, per
dtype) and moves at most `bandwidth` bytes/s, and every op pays a fixed cost to start (a kernel
launch on a GPU, the dispatcher on a CPU). So an op cannot take less than

    time = max(flops / peak, bytes / bandwidth) + launch

Its *arithmetic intensity*, flops / bytes, says which term wins: above the *ridge point*
peak / bandwidth the op is compute-bound, below it memory-bound; an op so small that `launch`
dominates is launch-bound, and then neither a faster dtype nor a bigger GPU helps it. Every ceiling
here is measured on the machine at hand (`measure_ceilings`), never typed in from a datasheet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from course_lib.device import AMP_DTYPES
from course_lib.tables import table
from course_lib.timing import time_fn

__all__ = [
    "DTYPES",
    "Ceilings",
    "measured_seconds",
    "measure_ceilings",
    "Op",
    "matmul_cost",
    "matmul_op",
    "conv_op",
    "elementwise_op",
    "predicted_seconds",
    "bound_by",
    "roofline_rows",
    "format_roofline_rows",
    "recorded_ceilings",
    "recorded_matmul_rows",
]

DTYPES = {name: dtype or torch.float32 for name, dtype in AMP_DTYPES.items()}  # the dtype tensors are stored in


@dataclass(frozen=True)
class Ceilings:
    """Chapter 11: one machine's measured ceilings: matmul FLOP/s per dtype, memory bandwidth in
    bytes/s, and `launch`, the seconds of the smallest op (what every op pays to start).
    `conv_flops`, where measured, is the convolution library's own ceiling per dtype: convolutions
    run in kernels of their own (oneDNN on a CPU, cuDNN on a GPU), whose best rate is not the
    matmul's."""

    device: str
    flops: dict[str, float]
    bandwidth: float
    launch: float
    conv_flops: dict[str, float] = field(default_factory=dict)

    def ridge(self, dtype: str) -> float:
        """FLOPs per byte above which an op in `dtype` is compute-bound here."""
        return self.flops[dtype] / self.bandwidth

    def peak(self, op: Op) -> float:
        """The compute ceiling `op` runs against: the convolution ceiling for a convolution where
        one was measured, the matmul ceiling otherwise."""
        if op.kind == "conv" and op.dtype in self.conv_flops:
            return self.conv_flops[op.dtype]
        return self.flops[op.dtype]


def measured_seconds(fn: Callable[[], object], device: str = "cpu", target_s: float = 0.01) -> float:
    """Chapter 11: the median seconds of one call of `fn`: core's time_fn (warm-up, synchronized
    clocks, several samples) over a batch of calls that lasts about `target_s`, so that even an op of
    a few microseconds is timed well above the clock's own cost."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, round(target_s / once))

    def batch() -> None:
        for _ in range(calls):
            fn()

    return time_fn(batch, warmup=1, iters=7, device=device).median_ms / 1e3 / calls


def measure_ceilings(
    device: str = "cpu",
    dtypes: tuple[str, ...] = ("fp32", "bf16"),
    size: int = 1024,
    copy_mib: int = 64,
    conv_dtypes: tuple[str, ...] = (),
) -> Ceilings:
    """Chapter 11: this machine's ceilings: a `size`-cubed matmul per dtype (FLOP/s) and a copy of
    `copy_mib` MiB (read plus written bytes per second), and an in-place add of one element (the
    floor every op stands on). For each of `conv_dtypes`, also the convolution ceiling: a 3x3
    convolution, 64 channels in and out, 8 images of 56x56, in channels_last. Each ceiling is the
    best of three rounds that time every op once in turn."""
    ops: dict[tuple[str, str], tuple[float, Callable[[], object]]] = {}  # (kind, dtype) -> (work, run)
    for name in dtypes:
        a = torch.randn(size, size, device=device).to(DTYPES[name])
        b = torch.randn(size, size, device=device).to(DTYPES[name])
        ops["matmul", name] = (2.0 * size**3, lambda a=a, b=b: a @ b)
    src = torch.randn(copy_mib * 2**18, device=device)  # 4-byte floats
    dst = torch.empty_like(src)
    ops["copy", "fp32"] = (2.0 * src.numel() * 4, lambda: dst.copy_(src))  # bytes read plus written
    for name in conv_dtypes:
        conv = conv_op(8, 64, 64, 56, dtype=name, device=device)
        ops["conv", name] = (conv.flops, conv.run)
    # A ceiling is the best the machine shows. The rounds spread each op's three timings over a few
    # seconds: a CPU that has just woken, or a neighbour's burst, then spoils one round, not all three.
    best = dict.fromkeys(ops, 0.0)
    for _ in range(3):
        for key, (work, run) in ops.items():
            best[key] = max(best[key], work / measured_seconds(run, device))
    flops = {name: best["matmul", name] for name in dtypes}
    conv_flops = {name: best["conv", name] for name in conv_dtypes}
    bandwidth = best["copy", "fp32"]
    one = torch.ones(1, device=device)
    launch = measured_seconds(lambda: one.add_(1), device)
    return Ceilings(device=device, flops=flops, bandwidth=bandwidth, launch=launch, conv_flops=conv_flops)


@dataclass(frozen=True)
class Op:
    """Chapter 11: one operation as the roofline sees it: its FLOPs, the bytes it must move (each
    input read once, the output written once), its dtype, how to run it, and its kind ("matmul",
    "conv" or "elementwise": which compute ceiling it runs against)."""

    name: str
    flops: float
    bytes: float
    dtype: str
    run: Callable[[], object]
    kind: str = "matmul"

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def matmul_cost(m: int, k: int, n: int, itemsize: int) -> tuple[float, float]:
    """Chapter 11: (FLOPs, bytes) of (m x k) @ (k x n): 2mkn FLOPs (a multiply and an add per term),
    mk + kn + mn elements moved."""
    return 2.0 * m * k * n, float(itemsize * (m * k + k * n + m * n))


def matmul_op(m: int, k: int, n: int, dtype: str = "fp32", device: str = "cpu") -> Op:
    """Chapter 11: a (m x k) @ (k x n) matmul to run, with its matmul_cost."""
    a = torch.randn(m, k, device=device).to(DTYPES[dtype])
    b = torch.randn(k, n, device=device).to(DTYPES[dtype])
    return Op(f"matmul {m}x{k}x{n}", *matmul_cost(m, k, n, a.element_size()), dtype, lambda: a @ b)


def conv_op(
    batch: int,
    cin: int,
    cout: int,
    hw: int,
    kernel: int = 3,
    dtype: str = "fp32",
    device: str = "cpu",
    channels_last: bool = True,
) -> Op:
    """Chapter 11: a stride-1, same-padded convolution: 2 * batch * cout * hw^2 * cin * kernel^2 FLOPs,
    its input and weight in channels_last (NHWC) memory order, or in PyTorch's default NCHW with
    `channels_last=False` (which a CPU's oneDNN copies into a layout of its own and back: bytes the
    roofline does not count)."""
    layout = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(batch, cin, hw, hw, device=device).to(DTYPES[dtype], memory_format=layout)
    w = torch.randn(cout, cin, kernel, kernel, device=device).to(DTYPES[dtype], memory_format=layout)
    size = x.element_size()
    flops = 2.0 * batch * cout * hw * hw * cin * kernel * kernel
    moved = size * (x.numel() + w.numel() + batch * cout * hw * hw)
    name = f"conv {cin}->{cout} {kernel}x{kernel}, {batch}x{hw}x{hw} {'NHWC' if channels_last else 'NCHW'}"
    return Op(name, flops, float(moved), dtype, lambda: torch.nn.functional.conv2d(x, w, padding=kernel // 2), "conv")


def elementwise_op(numel: int, kind: str = "add", dtype: str = "fp32", device: str = "cpu") -> Op:
    """Chapter 11: `add` (two inputs, one output) or `relu` (one in, one out) over `numel` elements,
    into an output made beforehand (a fresh one would time the allocator too): one FLOP an element,
    and every byte read or written once."""
    x = torch.randn(numel, device=device).to(DTYPES[dtype])
    y = torch.randn(numel, device=device).to(DTYPES[dtype])
    out = torch.empty_like(x)
    size = x.element_size()
    if kind == "add":
        return Op(
            f"add, {numel:,} elements",
            float(numel),
            float(3 * numel * size),
            dtype,
            lambda: torch.add(x, y, out=out),
            "elementwise",
        )
    if kind == "relu":

        def relu() -> torch.Tensor:
            return torch.clamp(x, min=0, out=out)  # relu, written where an output can be given

        return Op(f"relu, {numel:,} elements", float(numel), float(2 * numel * size), dtype, relu, "elementwise")
    raise ValueError(f"unknown elementwise op {kind!r}; choose 'add' or 'relu'")


def predicted_seconds(op: Op, ceilings: Ceilings) -> float:
    """Chapter 11: the roofline's time: max(compute, memory) plus the launch floor."""
    return max(op.flops / ceilings.peak(op), op.bytes / ceilings.bandwidth) + ceilings.launch


def bound_by(op: Op, ceilings: Ceilings) -> str:
    """Chapter 11: which term of predicted_seconds is the largest: "compute", "memory" or "launch"."""
    terms = {
        "compute": op.flops / ceilings.peak(op),
        "memory": op.bytes / ceilings.bandwidth,
        "launch": ceilings.launch,
    }
    return max(terms, key=terms.get)


def _compared(op: Op, ceilings: Ceilings, measured: float) -> dict:
    predicted = predicted_seconds(op, ceilings)
    return {
        "op": op.name,
        "dtype": op.dtype,
        "intensity": op.intensity,
        "bound": bound_by(op, ceilings),
        "predicted": predicted,
        "measured": measured,
        "error": predicted / measured - 1,
        "flops_per_s": op.flops / measured,
    }


def roofline_rows(ops: list[Op], ceilings: Ceilings, repeats: int = 3) -> list[dict]:
    """Chapter 11: each op predicted and measured: {"op", "dtype", "intensity", "bound", "predicted",
    "measured" (seconds), "error" (predicted / measured - 1), "flops_per_s" (measured)}. An op is
    measured as the ceilings are, the fastest of `repeats` rounds that time every op once in turn, so
    that both sides of the comparison are the machine at its best, not one of them at a neighbour's
    busiest moment."""
    fastest = [float("inf")] * len(ops)
    for _ in range(repeats):
        for i, op in enumerate(ops):
            fastest[i] = min(fastest[i], measured_seconds(op.run, ceilings.device))
    return [_compared(op, ceilings, seconds) for op, seconds in zip(ops, fastest)]


def format_roofline_rows(rows: list[dict]) -> str:
    """Chapter 11: roofline_rows as a table: times in microseconds, the error in percent."""
    columns = [
        ("op", "op", "<"),
        ("dtype", "dtype", "<"),
        ("FLOP/byte", "intensity", ".1f"),
        ("bound by", "bound", "<"),
        ("predicted us", lambda r: 1e6 * r["predicted"], ",.1f"),
        ("measured us", lambda r: 1e6 * r["measured"], ",.1f"),
        ("error %", lambda r: 100 * r["error"], "+.0f"),
    ]
    return table(rows, columns)


def recorded_ceilings(ref: dict) -> Ceilings:
    """Chapter 11: a recorded GPU's ceilings (roofline_<gpu>.json, ch11.record_roofline): the
    fastest matmul it measured per dtype, its copy bandwidth (bytes read plus written), and a
    one-element op launched back to back."""
    flops: dict[str, float] = {}
    for r in ref["matmul"]:
        flops[r["dtype"]] = max(flops.get(r["dtype"], 0.0), r["tflops"] * 1e12)
    return Ceilings(
        device=ref["provenance"]["device"],
        flops=flops,
        bandwidth=ref["bandwidth"]["copy_gbps"] * 1e9,
        launch=ref["launch"]["back_to_back_us"] * 1e-6,
    )


def recorded_matmul_rows(ref: dict, ceilings: Ceilings | None = None) -> list[dict]:
    """Chapter 11: every matmul a recorded GPU run timed ("matmul": square sizes per dtype; "shapes":
    GPT-2's output layer with the real and the padded vocabulary, and K around 4,096), predicted from
    that run's ceilings; the rows of roofline_rows."""
    ceilings = ceilings or recorded_ceilings(ref)
    rows = []
    for r in ref["matmul"] + ref.get("shapes", []):
        m, k, n = r["m"], r["k"], r["n"]
        cost = matmul_cost(m, k, n, 4 if r["dtype"] in ("fp32", "tf32") else 2)
        op = Op(f"{r.get('what', 'matmul')} {m}x{k}x{n}", *cost, r["dtype"], lambda: None)
        rows.append(_compared(op, ceilings, r["ms"] * 1e-3))
    return rows
