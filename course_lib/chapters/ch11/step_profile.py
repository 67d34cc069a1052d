"""A whole step, op by op: profiled ops costed by the roofline's rules (chapter 11, sections 3, 5, 6).

A profile lists a step's ops with their input shapes and times, on this CPU (`profile_step`) or as
recorded on a GPU (roofline_<gpu>.json "ops"). `recorded_op_cost` gives each op its FLOPs and bytes
by the roofline's rules, `recorded_step_rows` predicts it on a machine's `Ceilings` and sets the
measurement beside it. `host_bound_rows` predicts a small model's step from the kernels it launches:
where the host is slower than the GPU, the step takes the host's time. `fusion_rows` measures what
`torch.compile` removes on the machine at hand: a chain of elementwise ops, eager and fused;
`cuda_graph_rows` what a CUDA graph removes from the small CNN's host-bound step (a GPU only).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch
import torch.nn.functional as F

from course_lib.chapters.ch06.profiling import quiet_profiler
from course_lib.chapters.ch11.roofline import Ceilings, matmul_cost, measured_seconds
from course_lib.device import AMP_DTYPES, mixed_precision_for
from course_lib.tables import table
from course_lib.timing import time_fn

__all__ = [
    "host_bound_rows",
    "format_host_bound_rows",
    "profile_step",
    "recorded_op_cost",
    "recorded_step_rows",
    "format_step_rows",
    "compile_reading",
    "fusion_rows",
    "format_fusion_rows",
    "cuda_graph_rows",
    "format_cuda_graph_rows",
]


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


# ops that move no data of their own: views, and wrappers whose work a child op does (and is profiled)
_WRAPPERS = {
    "aten::t",
    "aten::transpose",
    "aten::view",
    "aten::as_strided",
    "aten::reshape",
    "aten::expand",
    "aten::permute",
    "aten::detach",
    "aten::linear",
    "aten::relu",
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::zeros",
    "aten::zeros_like",
    "aten::ones_like",
    "aten::to",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::result_type",
    "aten::lift_fresh",
    "aten::alias",
    "aten::cross_entropy_loss",
    "aten::log_softmax",
    "aten::nll_loss",
    "aten::nll_loss_nd",
    "aten::conv2d",
    "aten::convolution",
    "aten::_convolution",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::flatten",
}


def profile_step(step: Callable[[], object], steps: int = 3, dtype: str = "float") -> list[dict]:
    """Chapter 11: the ATen ops of `steps` calls of `step`, profiled on this CPU (torch.profiler with
    their input shapes), each as {"op", "dims", "types", "calls", "us"} per step, "us" its own time
    (children excluded): the format of a recorded GPU profile, for recorded_step_rows. `dtype` names
    the tensors' type (the CPU profile does not record it)."""
    from torch.profiler import ProfilerActivity, profile

    step()  # warm-up: the first call allocates and picks kernels
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            step()
    ops = []
    for event in prof.key_averages(group_by_input_shape=True):
        if not event.key.startswith("aten::") or event.self_cpu_time_total <= 0:
            continue
        dims = [list(d) if isinstance(d, (list, tuple)) else d for d in event.input_shapes]
        types = [dtype if isinstance(d, list) and d else "Scalar" for d in dims]
        ops.append(
            {
                "op": event.key,
                "dims": dims,
                "types": types,
                "calls": event.count / steps,
                "us": event.self_cpu_time_total / steps,
            }
        )
    return ops


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
        return "matmul", *matmul_cost(m, k, n, _ITEMSIZE[types[-3] if name == "aten::addmm" else types[0]])
    if "attention" in name:
        b, h, t, d = dims[0]
        forward = 2.0 * b * h * t * t * d  # QK^T and PV, each 2*B*H*T^2*D, halved by the causal mask
        moved = sum(_tensor_bytes(dims, types)) + b * h * t * d * size
        return "attention", forward * (2.5 if "backward" in name else 1.0), float(moved)
    if name == "aten::_fused_adamw_":
        return "optimizer", 0.0, 7.0 * 4 * params  # read weight, grad, two moments; write weight, moments
    if name in _WRAPPERS:
        return "unmodelled", 0.0, 0.0  # a view, or a wrapper whose work its child op does
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


def _bound(compute: float, memory: float, start: float) -> str:
    if start > max(compute, memory):
        return "launch"
    return "compute" if compute >= memory else "memory"


def _shape(op: dict) -> str:
    """A matmul as M x K x N; any other op by its first input's shape."""
    dims = op["dims"]
    if op["op"] in ("aten::mm", "aten::addmm"):
        (m, k), (_, n) = (dims[1], dims[2]) if op["op"] == "aten::addmm" else (dims[0], dims[1])
        return f"{m}x{k}x{n}"
    return "x".join(str(d) for d in dims[0]) if dims and dims[0] else ""


def recorded_step_rows(ops: list[dict], ceilings: Ceilings, params: int, floor: bool = False) -> list[dict]:
    """Chapter 11: every op of a profiled step, predicted from its kind, FLOPs and bytes on that
    machine's ceilings (a 16-bit op at the bf16 ceiling) and compared with its measured time. A GPU
    kernel's time holds no launch (the host pays it, overlapped): leave `floor` off there; an op's
    CPU time includes its dispatch, so `floor=True` adds the floor to every call. Unmodelled ops keep
    their measurement and no prediction (None)."""
    rows = []
    for op in ops:
        kind, flops, moved = recorded_op_cost(op, params)
        calls = op["calls"]
        dtype = "bf16" if any(t == "c10::BFloat16" for t in op["types"]) else "fp32"
        compute = flops / ceilings.flops[dtype]
        memory = moved / ceilings.bandwidth
        start = ceilings.launch if floor else 0.0
        predicted = None if kind == "unmodelled" else 1e6 * (max(compute, memory) + start) * calls
        rows.append(
            {
                "op": op["op"].removeprefix("aten::"),
                "shape": _shape(op),
                "kind": kind,
                "calls": calls,
                "bound": "-" if predicted is None else _bound(compute, memory, start),
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


def compile_reading(
    step_rows: list[dict], profiled_batch: int, ladder: list[dict], optimizer_ms: float | None = None
) -> dict:
    """Chapter 11: what `torch.compile` removed from a step, from a profiled step (recorded_step_rows, at
    `profiled_batch`) and chapter 09's GPT ladder at its own batch: "+ SDPA attention" uncompiled and
    "+ torch.compile", both with AdamW's foreach step. The profile is scaled to the ladder's batch, all
    but the optimizer, whose time does not grow with it; `optimizer_ms` (the foreach step's time,
    ladder_optimizer) replaces the profile's fused one, so that the runs differ only by compiling, which
    leaves matmuls and attention to the same library kernels: what it saved came out of the rest.
    {"batch", "kernels_ms", "rest_ms", "uncompiled_ms", "compiled_ms", "fused_ms" ("+ fused AdamW"),
    "rest_left_ms", "removed" (the share of the rest removed)}."""
    ms: dict[str, float] = {}
    for r in step_rows:
        ms[r["kind"]] = ms.get(r["kind"], 0.0) + r["measured_us"] / 1e3
    batch = ladder[0]["batch"]
    scale = batch / profiled_batch
    kernels = scale * (ms.get("matmul", 0.0) + ms.get("attention", 0.0))
    optimizer = ms.get("optimizer", 0.0) if optimizer_ms is None else optimizer_ms
    rest = scale * (ms.get("memory", 0.0) + ms.get("unmodelled", 0.0)) + optimizer
    rungs = {r["mode"]: r["ms_per_step"] for r in ladder}
    compiled = rungs["+ torch.compile"]
    return {
        "batch": batch,
        "kernels_ms": kernels,
        "rest_ms": rest,
        "uncompiled_ms": rungs["+ SDPA attention"],
        "compiled_ms": compiled,
        "fused_ms": rungs.get("+ fused AdamW"),
        "rest_left_ms": compiled - kernels,
        "removed": 1 - (compiled - kernels) / rest,
    }


def _residual_chain(x: torch.Tensor, b: torch.Tensor, g: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """relu(x + b) * g + r, four elementwise ops: the kind of chain that sits between a
    step's matmuls (a bias, an activation, a gate, a residual)."""
    return torch.relu(x + b) * g + r


def _fusion_row(
    ceilings: Ceilings, numel: int, tensors: list, mode: str, fn: Callable, passes: int, starts: int
) -> dict:
    start = time.perf_counter()
    fn(*tensors)  # compiles the compiled one
    first = time.perf_counter() - start
    # a warm-up round: eager's intermediates are fresh 16 MiB tensors, and until the C library's
    # allocator keeps such blocks instead of returning them, each one costs the operating
    # system's page faults, a cost of the process's first seconds that no later step pays
    measured_seconds(lambda: fn(*tensors), ceilings.device)
    measured = min(measured_seconds(lambda: fn(*tensors), ceilings.device) for _ in range(3))
    predicted = passes * numel * 4 / ceilings.bandwidth + starts * ceilings.launch
    return {
        "mode": mode,
        "passes": passes,
        "predicted": predicted,
        "measured": measured,
        "error": predicted / measured - 1,
        "first_call_s": first,
    }


def fusion_rows(ceilings: Ceilings, numel: int = 2**22) -> list[dict]:
    """Chapter 11: `_residual_chain` over `numel` fp32 elements, eager and under `torch.compile`, each
    predicted from the bandwidth and measured (after a round of warm-up, the best of three
    `measured_seconds`). Eager runs four ops, each reading its inputs and writing its output:
    3 + 2 + 3 + 3 = 11 passes over `numel` floats, and four starts. Compiled, Inductor fuses the
    chain into one kernel: the four inputs read and the output written once, 5 passes, one start.
    Rows: {"mode", "passes", "predicted", "measured" (seconds), "error", "first_call_s" (the first
    call: for the compiled one, compiling)}. Compiling for a CPU needs a C++ compiler; without one
    the first call raises."""
    tensors = [torch.randn(numel, device=ceilings.device) for _ in range(4)]
    modes = [
        ("eager: 4 ops", _residual_chain, 11, 4),
        ("torch.compile: 1 fused kernel", torch.compile(_residual_chain), 5, 1),
    ]
    # Compiling imports torch.utils.cpp_extension, which warns "No CUDA runtime is found" where a
    # CUDA build of torch runs without a GPU: true, and beside the point for a CPU kernel.
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        rows = [_fusion_row(ceilings, numel, tensors, *mode) for mode in modes]
    finally:
        quiet.setLevel(level)
    return rows


def format_fusion_rows(rows: list[dict]) -> str:
    """Chapter 11: fusion_rows as a table, times in milliseconds."""
    columns = [
        ("", "mode", "<"),
        ("passes", "passes", "d"),
        ("predicted ms", lambda r: 1e3 * r["predicted"], ".2f"),
        ("measured ms", lambda r: 1e3 * r["measured"], ".2f"),
        ("error %", lambda r: 100 * r["error"], "+.0f"),
        ("first call s", "first_call_s", ".1f"),
    ]
    return table(rows, columns)


def cuda_graph_rows(batch: int = 256, iters: int = 50) -> list[dict]:
    """Chapter 11: the course's small CNN (chapter 00; SGD, Fashion-MNIST-sized inputs) trained one
    step at a time on a CUDA GPU, eager and replayed as one captured CUDA graph, in fp32 and under autocast
    in the GPU's 16-bit type (`mixed_precision_for`: bf16, fp16 on a T4): {"mode", "eager_ms", "graph_ms",
    "speedup"} (medians of `iters` CUDA-event-timed steps). Eager, the host launches every kernel of the
    step; the graph launches the whole recorded step at once, so what it removes is the host's cost per
    kernel (section 5). fp16 runs without a GradScaler, whose `step` reads the inf flag back to the host.

    The capture follows PyTorch's recipe for a whole training step ("CUDA Graphs", whole-network
    capture): warm-up steps on a side stream, gradients set to None so that backward allocates them
    inside the graph's memory pool, then forward, backward and optimizer step captured together.
    Autocast runs with `cache_enabled=False`: `torch.cuda.make_graphed_callables`, PyTorch's own way
    of capturing, refuses autocast's cache of casted weights (torch/cuda/graphs.py), and so does this."""
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA graphs need a CUDA GPU; read the recorded rows (ch11.record_roofline)")
    from course_lib.models import SimpleCNN

    amp, rows = mixed_precision_for("cuda"), []  # bf16 from Ampere on; fp16 on a T4 or V100 (bf16 emulated)
    for mode, dtype in (("fp32", None), (amp, AMP_DTYPES[amp])):
        torch.manual_seed(0)
        model = SimpleCNN().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(batch, 1, 28, 28, device="cuda")
        y = torch.randint(0, 10, (batch,), device="cuda")

        def step() -> None:
            with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None, cache_enabled=False):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()

        def eager() -> None:
            opt.zero_grad(set_to_none=True)
            step()

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture: lazy initialisations happen here
            for _ in range(3):
                eager()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            step()
        graph_ms = time_fn(graph.replay, warmup=5, iters=iters, device="cuda").median_ms
        eager_ms = time_fn(eager, warmup=5, iters=iters, device="cuda").median_ms
        rows.append({"mode": mode, "eager_ms": eager_ms, "graph_ms": graph_ms, "speedup": eager_ms / graph_ms})
        del graph
    return rows


def format_cuda_graph_rows(rows: list[dict]) -> str:
    """Chapter 11: cuda_graph_rows as a table."""
    columns = [
        ("", "mode", "<"),
        ("eager ms/step", "eager_ms", ".3f"),
        ("CUDA graph ms/step", "graph_ms", ".3f"),
        ("speed-up", "speedup", ".2f"),
    ]
    return table(rows, columns)
