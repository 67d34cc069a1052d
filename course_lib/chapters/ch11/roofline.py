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
from dataclasses import dataclass
from typing import Callable

import torch

from course_lib.tables import table
from course_lib.timing import time_fn

__all__ = [
    "DTYPES",
    "Ceilings",
    "measured_seconds",
    "measure_ceilings",
    "Op",
    "matmul_op",
    "conv_op",
    "elementwise_op",
    "predicted_seconds",
    "bound_by",
    "roofline_rows",
    "format_roofline_rows",
    "recorded_ceilings",
    "recorded_matmul_rows",
    "host_bound_rows",
    "format_host_bound_rows",
    "recorded_op_cost",
    "recorded_step_rows",
    "format_step_rows",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Ceilings:
    """Chapter 11: one machine's measured ceilings: matmul FLOP/s per dtype, memory bandwidth in
    bytes/s, and `launch`, the seconds of the smallest op (what every op pays to start)."""

    device: str
    flops: dict[str, float]
    bandwidth: float
    launch: float

    def ridge(self, dtype: str) -> float:
        """FLOPs per byte above which an op in `dtype` is compute-bound here."""
        return self.flops[dtype] / self.bandwidth


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
    device: str = "cpu", dtypes: tuple[str, ...] = ("fp32", "bf16"), size: int = 1024, copy_mib: int = 64
) -> Ceilings:
    """Chapter 11: this machine's ceilings: a `size`-cubed matmul per dtype (FLOP/s), a copy of
    `copy_mib` MiB (read plus written bytes per second), and an in-place add of one element (the
    floor every op stands on)."""
    flops = {}
    for name in dtypes:
        a = torch.randn(size, size, device=device).to(DTYPES[name])
        b = torch.randn(size, size, device=device).to(DTYPES[name])
        flops[name] = 2 * size**3 / measured_seconds(lambda: a @ b, device)
    src = torch.randn(copy_mib * 2**18, device=device)  # 4-byte floats
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / measured_seconds(lambda: dst.copy_(src), device)
    one = torch.ones(1, device=device)
    launch = measured_seconds(lambda: one.add_(1), device)
    return Ceilings(device=device, flops=flops, bandwidth=bandwidth, launch=launch)


@dataclass(frozen=True)
class Op:
    """Chapter 11: one operation as the roofline sees it: its FLOPs, the bytes it must move (each
    input read once, the output written once), its dtype, and how to run it."""

    name: str
    flops: float
    bytes: float
    dtype: str
    run: Callable[[], object]

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def matmul_op(m: int, k: int, n: int, dtype: str = "fp32", device: str = "cpu") -> Op:
    """Chapter 11: (m x k) @ (k x n): 2mkn FLOPs (a multiply and an add per term), mk + kn + mn elements moved."""
    a = torch.randn(m, k, device=device).to(DTYPES[dtype])
    b = torch.randn(k, n, device=device).to(DTYPES[dtype])
    size = a.element_size()
    return Op(f"matmul {m}x{k}x{n}", 2.0 * m * k * n, float(size * (m * k + k * n + m * n)), dtype, lambda: a @ b)


def conv_op(batch: int, cin: int, cout: int, hw: int, kernel: int = 3, dtype: str = "fp32", device: str = "cpu") -> Op:
    """Chapter 11: a stride-1, same-padded convolution: 2 * batch * cout * hw^2 * cin * kernel^2 FLOPs."""
    x = torch.randn(batch, cin, hw, hw, device=device).to(DTYPES[dtype])
    w = torch.randn(cout, cin, kernel, kernel, device=device).to(DTYPES[dtype])
    size = x.element_size()
    flops = 2.0 * batch * cout * hw * hw * cin * kernel * kernel
    moved = size * (x.numel() + w.numel() + batch * cout * hw * hw)
    name = f"conv {cin}->{cout} {kernel}x{kernel}, {batch}x{hw}x{hw}"
    return Op(name, flops, float(moved), dtype, lambda: torch.nn.functional.conv2d(x, w, padding=kernel // 2))


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
            f"add, {numel:,} elements", float(numel), float(3 * numel * size), dtype, lambda: torch.add(x, y, out=out)
        )
    if kind == "relu":

        def relu() -> torch.Tensor:
            return torch.clamp(x, min=0, out=out)  # relu, written where an output can be given

        return Op(f"relu, {numel:,} elements", float(numel), float(2 * numel * size), dtype, relu)
    raise ValueError(f"unknown elementwise op {kind!r}; choose 'add' or 'relu'")


def predicted_seconds(op: Op, ceilings: Ceilings) -> float:
    """Chapter 11: the roofline's time: max(compute, memory) plus the launch floor."""
    return max(op.flops / ceilings.flops[op.dtype], op.bytes / ceilings.bandwidth) + ceilings.launch


def bound_by(op: Op, ceilings: Ceilings) -> str:
    """Chapter 11: which term of predicted_seconds is the largest: "compute", "memory" or "launch"."""
    terms = {
        "compute": op.flops / ceilings.flops[op.dtype],
        "memory": op.bytes / ceilings.bandwidth,
        "launch": ceilings.launch,
    }
    return max(terms, key=terms.get)


def roofline_rows(ops: list[Op], ceilings: Ceilings) -> list[dict]:
    """Chapter 11: each op predicted and measured: {"op", "dtype", "intensity", "bound", "predicted",
    "measured" (seconds), "error" (predicted / measured - 1), "flops_per_s" (measured)}."""
    rows = []
    for op in ops:
        seconds = measured_seconds(op.run, ceilings.device)
        predicted = predicted_seconds(op, ceilings)
        rows.append(
            {
                "op": op.name,
                "dtype": op.dtype,
                "intensity": op.intensity,
                "bound": bound_by(op, ceilings),
                "predicted": predicted,
                "measured": seconds,
                "error": predicted / seconds - 1,
                "flops_per_s": op.flops / seconds,
            }
        )
    return rows


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
    """Chapter 11: a recorded GPU's ceilings (roofline_<gpu>.json, tools/gpu_study.py roofline): the
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
        size = 4 if r["dtype"] in ("fp32", "tf32") else 2
        m, k, n = r["m"], r["k"], r["n"]
        op = Op(
            f"{r.get('what', 'matmul')} {m}x{k}x{n}",
            2.0 * m * k * n,
            float(size * (m * k + k * n + m * n)),
            r["dtype"],
            lambda: None,
        )
        predicted = predicted_seconds(op, ceilings)
        measured = r["ms"] * 1e-3
        rows.append(
            {
                "op": op.name,
                "dtype": r["dtype"],
                "intensity": op.intensity,
                "bound": bound_by(op, ceilings),
                "predicted": predicted,
                "measured": measured,
                "error": predicted / measured - 1,
                "flops_per_s": op.flops / measured,
            }
        )
    return rows


def host_bound_rows(profiles: dict[str, dict], base: str = "fp32") -> list[dict]:
    """Chapter 11: a recorded small model's steps (questions_<gpu>.json "simplecnn"), predicted as
    max(the GPU's kernel time, kernels x the host's cost per kernel). The host's cost per kernel is
    read from the `base` step (its wall time over its kernels: one number, not fitted per row); the
    other modes are predicted from their own kernel counts."""
    ref = profiles[base]
    per_kernel = ref["ms_per_step"] / ref["kernels"]["kernels_per_step"]
    rows = []
    for mode, r in profiles.items():
        kernels = r["kernels"]["kernels_per_step"]
        gpu_ms = r["kernels"]["gpu_us_per_step"] / 1e3
        host_ms = kernels * per_kernel
        predicted = max(gpu_ms, host_ms)
        rows.append(
            {
                "mode": mode,
                "kernels": kernels,
                "gpu_ms": gpu_ms,
                "host_ms": host_ms,
                "bound": "host" if host_ms >= gpu_ms else "GPU",
                "predicted_ms": predicted,
                "measured_ms": r["ms_per_step"],
                "error": predicted / r["ms_per_step"] - 1,
                "per_kernel_us": 1e3 * per_kernel,
            }
        )
    return rows


def format_host_bound_rows(rows: list[dict]) -> str:
    """Chapter 11: host_bound_rows as a table, times in ms, the error in percent."""
    columns = [
        ("mode", "mode", "<"),
        ("kernels", "kernels", ".0f"),
        ("GPU busy ms", "gpu_ms", ".2f"),
        ("host ms", "host_ms", ".2f"),
        ("bound by", "bound", "<"),
        ("predicted ms", "predicted_ms", ".2f"),
        ("measured ms", "measured_ms", ".2f"),
        ("error %", lambda r: 100 * r["error"], "+.0f"),
    ]
    return table(rows, columns)


_ITEMSIZE = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "bool": 1}


def _numel(dims: list) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _tensor_bytes(dims: list, types: list) -> list[int]:
    """The bytes of each tensor argument of a profiled op (lists of tensors flattened; scalars: none)."""
    out = []
    for d, t in zip(dims, types):
        if t in _ITEMSIZE and d:
            out.append(_numel(d) * _ITEMSIZE[t])
    return out


def recorded_op_cost(op: dict, params: int) -> tuple[str, float, float]:
    """Chapter 11: (kind, FLOPs, bytes) of one profiled op of a recorded step (roofline_<gpu>.json
    "ops": name, input shapes and types, time), by the roofline's rules: a matmul's 2mkn FLOPs;
    causal attention's 2*B*H*T^2*D forward and 2.5 times that backward; fused AdamW's seven fp32
    passes over the `params` parameters; any other op touches each input once and writes an output
    the size of its first input (an in-place op writes that input back). Kinds: "matmul",
    "attention", "optimizer", "memory", and "unmodelled" where the shapes do not say what the
    kernel touches."""
    name, dims, types = op["op"], op["dims"], op["types"]
    size = _ITEMSIZE.get(types[0], 2) if types else 2
    if name in ("aten::mm", "aten::addmm"):
        (m, k), (_, n) = (dims[1], dims[2]) if name == "aten::addmm" else (dims[0], dims[1])
        size = _ITEMSIZE[types[-3] if name == "aten::addmm" else types[0]]
        return "matmul", 2.0 * m * k * n, float(size * (m * k + k * n + m * n))
    if "attention" in name:
        b, h, t, d = dims[0]
        forward = 2.0 * b * h * t * t * d  # QK^T and PV, each 2*B*H*T^2*D, halved by the causal mask
        moved = sum(_tensor_bytes(dims, types)) + b * h * t * d * size
        return "attention", forward * (2.5 if "backward" in name else 1.0), float(moved)
    if name == "aten::_fused_adamw_":
        return "optimizer", 0.0, 7.0 * 4 * params  # read weight, grad, two moments; write weight, moments
    if name in ("aten::nll_loss_backward", "aten::nll_loss_forward", "aten::gather", "aten::embedding_dense_backward"):
        return "unmodelled", 0.0, 0.0  # they touch a row per token, not the whole of their inputs
    moved = _tensor_bytes(dims, types)
    if not moved:
        return "unmodelled", 0.0, 0.0
    if name == "aten::fill_":
        return "memory", 0.0, float(moved[0])
    if name == "aten::copy_":
        return "memory", 0.0, float(sum(moved))
    if name == "aten::cat":
        total = sum(_numel(d) * size for d in dims[0])
        return "memory", 0.0, float(2 * total)
    out = moved[0]  # elementwise: an output (or the in-place input written back) the size of the first input
    if name in ("aten::sum", "aten::mean"):
        out = 0
    return "memory", float(_numel(dims[0])), float(sum(moved) + out)


def _shape(op: dict) -> str:
    """A matmul as M x K x N; any other op by its first input's shape."""
    dims = op["dims"]
    if op["op"] in ("aten::mm", "aten::addmm"):
        (m, k), (_, n) = (dims[1], dims[2]) if op["op"] == "aten::addmm" else (dims[0], dims[1])
        return f"{m}x{k}x{n}"
    return "x".join(str(d) for d in dims[0]) if dims and dims[0] else ""


def recorded_step_rows(ops: list[dict], ceilings: Ceilings, params: int) -> list[dict]:
    """Chapter 11: every op of a recorded step, predicted from its kind, FLOPs and bytes on that GPU's
    ceilings (a 16-bit op at the bf16 ceiling) and compared with its measured GPU time. A profiled
    kernel time holds no launch (the host pays it, overlapped), so the floor is not added here.
    Unmodelled ops keep their measurement and no prediction (None)."""
    rows = []
    for op in ops:
        kind, flops, moved = recorded_op_cost(op, params)
        calls = op["calls"]
        dtype = "bf16" if any(t == "c10::BFloat16" for t in op["types"]) else "fp32"
        compute = flops / ceilings.flops[dtype]
        memory = moved / ceilings.bandwidth
        predicted = None if kind == "unmodelled" else 1e6 * max(compute, memory) * calls
        rows.append(
            {
                "op": op["op"].removeprefix("aten::"),
                "shape": _shape(op),
                "kind": kind,
                "calls": calls,
                "bound": "-" if predicted is None else ("compute" if compute >= memory else "memory"),
                "predicted_us": predicted,
                "measured_us": op["us"],
                "error": None if predicted is None else predicted / op["us"] - 1,
            }
        )
    return rows


def format_step_rows(rows: list[dict], top: int = 20) -> str:
    """Chapter 11: the `top` slowest ops of recorded_step_rows as a table, then the totals by kind."""
    columns = [
        ("op", "op", "<"),
        ("shape (matmul: MxKxN)", "shape", "<"),
        ("calls", "calls", ".0f"),
        ("bound by", "bound", "<"),
        ("predicted us", "predicted_us", ",.0f"),
        ("measured us", "measured_us", ",.0f"),
        ("error %", lambda r: None if r["error"] is None else 100 * r["error"], "+.0f"),
    ]
    slowest = sorted(rows, key=lambda r: -r["measured_us"])[:top]
    totals: dict[str, dict] = {}
    for r in rows:
        if r["predicted_us"] is None:
            continue
        t = totals.setdefault(r["kind"], {"op": r["kind"], "predicted_us": 0.0, "measured_us": 0.0, "calls": 0.0})
        t["predicted_us"] += r["predicted_us"]
        t["measured_us"] += r["measured_us"]
        t["calls"] += r["calls"]
    for t in totals.values():
        t["error"] = t["predicted_us"] / t["measured_us"] - 1
    by_kind = [
        ("kind", "op", "<"),
        ("calls", "calls", ".0f"),
        ("predicted us", "predicted_us", ",.0f"),
        ("measured us", "measured_us", ",.0f"),
        ("error %", lambda r: 100 * r["error"], "+.0f"),
    ]
    unmodelled = [r for r in rows if r["predicted_us"] is None]
    tail = f"\nnot modelled: {len(unmodelled)} ops, {sum(r['measured_us'] for r in unmodelled):,.0f} us measured"
    return table(slowest, columns, missing="-") + "\n\n" + table(list(totals.values()), by_kind) + tail
