"""Reading a Chrome trace of torch.profiler with nothing but `json`: one step's numbers, a diagnosis, a picture.

Chapter 06. `torch.profiler` (course_lib.chapters.ch06.profiling.profile_steps) writes each recorded
cycle as a Chrome trace: a JSON list of events, each with a name, a category (`cpu_op`,
`user_annotation`, `kernel`, `cuda_runtime`, ...), a thread, a start `ts` and a duration `dur`
in microseconds. Perfetto (https://ui.perfetto.dev) shows it; this module reads it:

    trace = load_trace(path)
    summary = trace_summary(trace)     # one step: its time, and each top-level op's CPU and kernel time
    diagnose_trace(summary)            # ('data', 'more_workers'), ('overhead', ...), ('compute', ...)
    plot_timeline(trace)               # the profiled steps as a picture
"""

from __future__ import annotations

import gzip
import json
import os
import re
import statistics

from course_lib.tables import table

__all__ = [
    "DIAGNOSES",
    "FIXES",
    "load_trace",
    "trace_summary",
    "diagnose_trace",
    "format_summary",
    "matmul_share",
    "plot_timeline",
]

# Each bottleneck diagnose_trace() can name, in words (diagnose_trace() returns the key).
DIAGNOSES = {
    "data": "waiting for data",
    "overhead": "per-op overhead (many small ops)",
    "compute": "compute (the kernels are the step)",
}
# What to do about each diagnosis (diagnose_trace() returns the key).
FIXES = {
    "more_workers": "load and transform batches in DataLoader workers (num_workers > 0; chapter 07)",
    "fewer_launches": "fewer, larger ops: bigger batches, foreach/fused optimizers, torch.compile, CUDA graphs",
    "amp": "run the big matmuls and convolutions in bf16/fp16 under autocast (chapter 02)",
    "fewer_flops": "already busy in low precision: fewer FLOPs (smaller model or batch) or a faster GPU",
}
PHASE_COLORS = {"data": "tab:gray", "forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}
_KERNELS = ("kernel", "gpu_memcpy", "gpu_memset")  # what runs on the GPU
_LAUNCHES = ("cuda_runtime", "cuda_driver")  # the CPU-side calls that queue it (cudaLaunchKernel, ...)


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def load_trace(path: str | os.PathLike) -> dict:
    """Chapter 06: a Chrome trace file (.json or .json.gz) as the dict torch.profiler wrote."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _phase(e: dict, first_backward: float) -> str:
    name = e["name"]
    if name.startswith("enumerate(DataLoader)"):
        return "data"
    if name.startswith("Optimizer.step"):
        return "optimizer"
    return "backward" if e["ts"] >= first_backward else "forward"


def _parse(trace: dict) -> dict:
    """The profiled steps, the top-level CPU events (with their step and phase), the kernels as
    (ts, dur, the op that ran it, its top-level op), and the memory samples."""
    evs = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = sorted(
        (e for e in evs if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")),
        key=lambda e: e["ts"],
    )
    if not steps:
        raise ValueError("no ProfilerStep# events: profile with a schedule and call prof.step() after each step")
    t0, t_end = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    nest = sorted(
        (
            e
            for e in evs
            if e.get("cat") in ("cpu_op", "user_annotation") + _LAUNCHES
            and not e["name"].startswith("ProfilerStep#")
            and t0 <= e["ts"] < t_end
        ),
        key=lambda e: (e.get("tid"), e["ts"], -e["dur"]),
    )
    stack: list[dict] = []
    for e in nest:  # parent = the innermost event still open on the same thread; _inner = time in children
        end = e["ts"] + 1e-3
        while stack and (stack[-1].get("tid") != e.get("tid") or stack[-1]["ts"] + stack[-1]["dur"] <= end):
            stack.pop()
        e["_parent"], e["_inner"] = (stack[-1] if stack else None), 0.0
        if stack and e.get("cat") not in _LAUNCHES:
            stack[-1]["_inner"] += e["dur"]
        stack.append(e)

    def up(e: dict, to_top: bool) -> dict:  # to the op around a launch, or to the top-level event
        while e["_parent"] is not None and (to_top or e.get("cat") in _LAUNCHES):
            e = e["_parent"]
        return e

    launches = {e["args"].get("correlation"): e for e in nest if e.get("cat") in _LAUNCHES and "args" in e}
    kernels = []
    for k in (e for e in evs if e.get("cat") in _KERNELS):
        launch = launches.get(k.get("args", {}).get("correlation"))
        if launch is not None:
            kernels.append((k["ts"], k["dur"], up(launch, False), up(launch, True)))
    gpu = bool(kernels)
    if not gpu:  # on a CPU, the ops that do their own work (self time >= half their time) are the kernels
        kernels = [
            (e["ts"], e["dur"] - e["_inner"], e, up(e, True))
            for e in nest
            if e.get("cat") == "cpu_op" and e["dur"] - e["_inner"] >= 0.5 * e["dur"]
        ]
    tops = [e for e in nest if e["_parent"] is None and e.get("cat") not in _LAUNCHES]
    for i, s in enumerate(steps):  # backward starts at the step's first autograd function
        inside = [e for e in tops if s["ts"] <= e["ts"] < s["ts"] + s["dur"]]
        first_backward = min((e["ts"] for e in inside if e["name"].startswith("autograd::engine")), default=t_end)
        for e in inside:
            e["_step"], e["_phase"] = i, _phase(e, first_backward)
    memory = [
        (e["ts"], e["args"]) for e in trace["traceEvents"] if e.get("name") == "[memory]" and t0 <= e["ts"] < t_end
    ]
    return {"steps": steps, "t0": t0, "tops": tops, "kernels": kernels, "memory": memory, "gpu": gpu}


def trace_summary(trace: dict) -> dict:
    """Chapter 06: one profiled step from a Chrome trace, each number the median over the profiled
    steps (robust to one step slowed by another program): step_ms, and `ops`, the top-level ops
    (what your Python code called: aten::conv2d, Optimizer.step#AdamW.step, enumerate(DataLoader)...,
    autograd's backward functions), each with calls, cpu_ms (inclusive CPU time), device_ms and
    kernels (time and number of the kernels it caused: GPU kernels, or on a CPU the ops that do
    the work) and input_types (the dtypes its heaviest kernel worked on, from record_shapes:
    'float' is fp32, 'c10::BFloat16' bf16, 'c10::Half' fp16).
    """
    p = _parse(trace)
    n = len(p["steps"])
    rows = {}

    def row(name: str) -> dict:
        per_step = {f: [0.0] * n for f in ("calls", "cpu_ms", "device_ms", "kernels")}
        return rows.setdefault(name, {"name": name, **per_step, "by": {}})

    for e in p["tops"]:
        r = row(e["name"])
        r["calls"][e["_step"]] += 1
        r["cpu_ms"][e["_step"]] += e["dur"] / 1e3
    for _, dur, op, top in p["kernels"]:
        if "_step" in top:
            r = row(top["name"])
            r["device_ms"][top["_step"]] += dur / 1e3
            r["kernels"][top["_step"]] += 1
            key = tuple(op.get("args", {}).get("Input type", []))
            r["by"][key] = r["by"].get(key, 0.0) + dur
    for r in rows.values():
        by = r.pop("by")
        r["input_types"] = [t for t in max(by, key=by.get) if t] if by else []
        for f in ("calls", "cpu_ms", "device_ms", "kernels"):
            r[f] = statistics.median(r[f])
    return {
        "device": "cuda" if p["gpu"] else "cpu",
        "steps": n,
        "step_ms": statistics.median(s["dur"] for s in p["steps"]) / 1e3,
        "ops": sorted(rows.values(), key=lambda r: -max(r["cpu_ms"], r["device_ms"])),
    }


def _stats(summary: dict) -> dict:
    step, ops = summary["step_ms"], summary["ops"]
    data = sum(r["cpu_ms"] for r in ops if r["name"].startswith("enumerate(DataLoader)"))
    busy, kernels = sum(r["device_ms"] for r in ops), sum(r["kernels"] for r in ops)
    return {"data": data / step, "busy": busy / step, "kernels": kernels, "kernel_us": 1e3 * busy / max(kernels, 1)}


def diagnose_trace(summary: dict) -> tuple[str, str]:
    """Chapter 06: (bottleneck, fix) for a trace_summary, by the chapter's three questions.

    1. Is >= 30% of the step spent in the DataLoader? -> ("data", "more_workers").
    2. On a GPU: do kernels run < 50% of the step (device_ms summed)? The GPU idles while the CPU
       issues many small ops. On a CPU, which issues and runs them: do the ops doing the work take
       < 50 µs each on average, so fixed per-op costs dominate? -> ("overhead", "fewer_launches").
    3. Otherwise the kernels are the step -> ("compute", "fewer_flops") if the op with the most
       kernel time ran them in bf16 or fp16 already, else ("compute", "amp").
    """
    s = _stats(summary)
    if s["data"] >= 0.3:
        return "data", "more_workers"
    if s["busy"] < 0.5 if summary["device"] == "cuda" else s["kernel_us"] < 50:
        return "overhead", "fewer_launches"
    types = max(summary["ops"], key=lambda r: r["device_ms"])["input_types"]
    return "compute", ("fewer_flops" if any(t in ("c10::BFloat16", "c10::Half") for t in types) else "amp")


def matmul_share(summary: dict) -> float:
    """Chapter 06: the share of the step spent in convolutions and matmuls, forward and backward:
    the part that autocast runs in 16 bits (and Tensor Cores speed up)."""
    hit = [r for r in summary["ops"] if re.search(r"conv|linear|addmm|\bmm", r["name"], re.IGNORECASE)]
    return sum(max(r["cpu_ms"], r["device_ms"]) for r in hit) / summary["step_ms"]


def format_summary(summaries: dict[str, dict], width: int = 100) -> str:
    """Chapter 06: one line per trace_summary: step time, shares of data and kernels, kernels per step
    and their mean length, and the heaviest top-level op with its share of the step."""
    rows = []
    for label, summ in summaries.items():
        top = max(summ["ops"], key=lambda r: max(r["cpu_ms"], r["device_ms"]))
        share = max(top["cpu_ms"], top["device_ms"]) / summ["step_ms"]
        heaviest = f"{_cut(top['name'], width - 55)} ({share:.0%})"
        rows.append({"step": label, "ms": summ["step_ms"], **_stats(summ), "heaviest": heaviest})
    columns = [
        ("step", "step", ""),
        ("ms", "ms", ".1f"),
        ("data", "data", ".0%"),
        ("busy", "busy", ".0%"),
        ("kernels", "kernels", ".0f"),
        ("µs each", "kernel_us", ".1f"),
        ("heaviest op (share of step)", "heaviest", "<"),
    ]
    return table(rows, columns)


def plot_timeline(trace: dict, title: str = ""):
    """Chapter 06: the trace's profiled steps as a picture: top-level CPU ops and kernels coloured by
    phase and, if the trace has memory samples, memory allocated over time. Returns the figure."""
    import matplotlib.pyplot as plt

    p = _parse(trace)
    mem = p["memory"]
    fig, axes = plt.subplots(
        2 if mem else 1,
        1,
        figsize=(10, 4.4 if mem else 2.6),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [1.3, 1] if mem else [1]},
    )
    ax = axes[0][0]

    def ms(ts: float) -> float:  # a trace timestamp (µs) as ms since the step began
        return (ts - p["t0"]) / 1e3

    lanes = {
        "CPU: ops your code called": [(ms(e["ts"]), e["dur"] / 1e3, e["_phase"]) for e in p["tops"]],
        "GPU: kernels" if p["gpu"] else "CPU: ops doing the work": [
            (ms(ts), dur / 1e3, top.get("_phase", "forward")) for ts, dur, _, top in p["kernels"]
        ],
    }
    present = {q for bars in lanes.values() for *_, q in bars}
    for y, bars in enumerate(lanes.values()):
        for ph, color in PHASE_COLORS.items():
            ax.broken_barh(
                [(a, w) for a, w, q in bars if q == ph],
                (y - 0.3, 0.6),
                color=color,
                label=ph if y == 0 and ph in present else None,
            )
    for s in p["steps"]:
        ax.axvline(ms(s["ts"]), color="k", lw=0.8, ls="--")
        ax.text(ms(s["ts"]), -0.45, f" {s['name'].replace('ProfilerStep#', 'step ')}", fontsize=8, va="bottom")
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.set_ylim(len(lanes) + 0.2, -0.8)
    ax.legend(loc="lower right", ncol=4, fontsize=8, framealpha=0.9)
    ax.set_title(title or f"{len(p['steps'])} profiled steps")
    for dev, label in ((0, "CPU"), (1, "CUDA")):
        pts = sorted((ms(ts), a["Total Allocated"] / 2**20) for ts, a in mem if a.get("Device Type") == dev)
        if pts:
            axes[1][0].step(*zip(*pts), where="post", label=f"{label} memory allocated")
            axes[1][0].set(ylabel="MiB")
            axes[1][0].legend(loc="best", fontsize=8)
    axes[-1][0].set_xlabel("time since the first profiled step started (ms)")
    fig.tight_layout()
    return fig
