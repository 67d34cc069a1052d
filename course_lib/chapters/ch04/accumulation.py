"""Gradient accumulation: one optimizer step over several micro-batches, its equivalence and its memory.

Chapter 04. Weight each micro-batch's mean loss by its share of the samples (loss / N for N
equal micro-batches), backward each, and unscale_, step and update once, at the boundary: the
summed gradient is then the large batch's, up to rounding, while activations are held for one
micro-batch at a time. What breaks it (update() in the wrong place, BatchNorm, no_sync, a
popular article's loop) is in course_lib.chapters.ch04.accumulation_pitfalls; token-level losses, whose
weights count tokens, in course_lib.chapters.ch04.accumulation_tokens.

    accumulation_step(model, optimizer, scaler, micro_batches, dtype=torch.bfloat16)
    python -m course_lib.chapters.ch04.accumulation --json data/reference/accumulation_<gpu>.json
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.chapters.ch02.saved_tensors import StorageOrigins, saved_bytes_by_kind, saved_tensor_bytes
from course_lib.models import build_model
from course_lib.reference import record
from course_lib.tables import table
from course_lib.timing import peak_memory_bytes, time_fn
from course_lib.train import AMP_DTYPES, amp_step

__all__ = [
    "accumulation_step",
    "accumulated_grad",
    "rel_diff",
    "equivalence_rows",
    "format_equivalence_rows",
    "peak_saved_bytes",
    "memory_rows",
    "format_memory_rows",
    "saved_kinds",
    "recount_saved",
    "read_memory_rows",
]
# seeded_mlp and seeded_batch are public for accumulation_pitfalls; no chapter calls them (not in __all__)

Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]
EPS = {name: torch.finfo(dtype or torch.float32).eps for name, dtype in AMP_DTYPES.items()}  # machine epsilon


def accumulation_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    micro_batches: Batches,
    loss_fn: Callable = F.cross_entropy,
    dtype: torch.dtype | None = None,
    clip_grad_norm: float | None = None,
) -> bool:
    """Chapter 04: one optimizer step over `micro_batches`; True if the scaler skipped it.

    This is the core's AMP step (course_lib.train.amp_step), read back at once. `loss_fn` must
    average over its batch (reduction="mean"). Each micro-batch's loss is weighted by
    len(y) / total, so the summed gradient is the gradient of the mean loss over all the samples:
    loss / N when the N micro-batches have the same size. DDP: no_sync() holds the forward AND
    backward of all but the last micro-batch; `unscale_`, `step` and `update` once per step.
    """
    return bool(
        amp_step(
            model, optimizer, scaler, list(micro_batches), dtype, loss_fn=loss_fn, clip_grad_norm=clip_grad_norm
        ).skipped
    )


def accumulated_grad(
    model: nn.Module,
    micro_batches: Batches,
    weights: Sequence[float] | None = None,
    loss_fn: Callable = F.cross_entropy,
    dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> torch.Tensor:
    """Chapter 04: the summed gradient of weight_i * loss(micro-batch i), flattened, in float64.

    `weights` default to each micro-batch's share of the samples (len / total). With a scaler,
    the scaled gradients are divided back by the scale. One micro-batch is the large batch.
    """
    total = sum(len(y) for _, y in micro_batches)
    weights = weights if weights is not None else [len(y) / total for _, y in micro_batches]
    device = next(model.parameters()).device.type
    model.zero_grad(set_to_none=True)
    for (x, y), w in zip(micro_batches, weights):
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model(x), y) * w
        (scaler.scale(loss) if scaler is not None else loss).backward()
    g = torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])
    return g / (scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chapter 04: ||a - b|| / ||b||, the relative distance of a from b."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def seeded_mlp(seed: int, width: int = 64, features: int = 32, classes: int = 10, norm: str | None = None) -> nn.Module:
    """The small MLP of the accumulation experiments, its weights drawn from `seed` (the same seed, the
    same model); `norm` puts a BatchNorm, GroupNorm or LayerNorm after the first layer. A helper of this
    module and of accumulation_pitfalls: no chapter calls it."""
    torch.manual_seed(seed)
    norms = {
        None: nn.Identity,
        "BatchNorm": lambda: nn.BatchNorm1d(width),
        "GroupNorm": lambda: nn.GroupNorm(8, width),
        "LayerNorm": lambda: nn.LayerNorm(width),
    }
    return nn.Sequential(
        nn.Linear(features, width),
        norms[norm](),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, classes),
    )


def seeded_batch(n: int, seed: int, features: int = 32, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): `n` random inputs for seeded_mlp and their class labels, drawn from `seed` by a generator
    of their own (the global random state is left alone)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


def equivalence_rows(
    batch: int = 64,
    splits: Sequence[int] = (2, 4, 8),
    precisions: Sequence[str] = ("fp32", "bf16", "fp16"),
    seed: int = 0,
) -> list[dict]:
    """Chapter 04: accumulated vs large-batch gradients of one MLP, per precision and split.

    `vs_large`: relative distance of the accumulated gradient from the large batch's in the same
    precision; `large_vs_fp64`: of that large-batch gradient from float64's; `eps`: the
    precision's machine epsilon. fp16 runs with torch.amp.GradScaler("cpu").
    """
    x, y = seeded_batch(batch, seed)
    exact = accumulated_grad(seeded_mlp(seed).double(), [(x.double(), y)])
    rows = []
    for p in precisions:
        scaler = (lambda: torch.amp.GradScaler("cpu")) if p == "fp16" else (lambda: None)
        large = accumulated_grad(seeded_mlp(seed), [(x, y)], dtype=AMP_DTYPES[p], scaler=scaler())
        for n in splits:
            micro = list(zip(x.chunk(n), y.chunk(n)))
            acc = accumulated_grad(seeded_mlp(seed), micro, dtype=AMP_DTYPES[p], scaler=scaler())
            rows.append(
                {
                    "precision": p,
                    "micro_batches": n,
                    "micro_size": batch // n,
                    "vs_large": rel_diff(acc, large),
                    "large_vs_fp64": rel_diff(large, exact),
                    "eps": EPS[p],
                }
            )
    return rows


def format_equivalence_rows(rows: Sequence[dict], tolerance: float = 4.0) -> str:
    """Chapter 04: equivalence_rows as a table, with the verdict `vs_large <= tolerance x eps`."""
    columns = [
        ("precision", "precision", ""),
        ("micro-batches", lambda r: f"{r['micro_batches']} x {r['micro_size']}", ""),
        ("accum vs large", "vs_large", ".2e"),
        ("large vs fp64", "large_vs_fp64", ".2e"),
        ("eps", "eps", ".2e"),
        (f"within {tolerance:g} eps", lambda r: "yes" if r["vs_large"] <= tolerance * r["eps"] else "NO", ""),
    ]
    return table(rows, columns)


# --------------------------------------------------------------------------- memory


class _Held:
    """A tensor saved for backward, counted while autograd holds it."""

    __slots__ = ("tensor", "key", "live")

    def __init__(self, tensor: torch.Tensor, key: tuple, live: dict) -> None:
        self.tensor, self.key, self.live = tensor, key, live

    def __del__(self) -> None:
        count = self.live["count"]
        count[self.key] -= 1
        if not count[self.key]:
            del count[self.key]
            self.live["bytes"] -= self.key[1]


def peak_saved_bytes(fn: Callable[[], object]) -> int:
    """Chapter 04: the most bytes autograd held for backward at any one time while `fn` ran.

    Like course_lib.chapters.ch02.saved_tensors.saved_tensor_bytes (each storage counted once; what existed before `fn`,
    the parameters and the input batches, costs nothing and is not counted), but a tensor stops
    counting when autograd lets go of it, after the backward that used it.
    """
    live: dict = {"count": {}, "bytes": 0, "peak": 0}
    origins = StorageOrigins()

    def pack(t: torch.Tensor) -> _Held | torch.Tensor:
        if origins.kind(t) == "existing":
            return t.detach()
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        live["count"][key] = live["count"].get(key, 0) + 1
        if live["count"][key] == 1:
            live["bytes"] += key[1]
            live["peak"] = max(live["peak"], live["bytes"])
        return _Held(t.detach(), key, live)  # not `t`: see course_lib.chapters.ch02.saved_tensors.saved_tensor_bytes

    def unpack(held: _Held | torch.Tensor) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), origins:
        fn()
    return live["peak"]


TIMED_STEPS = 5  # per row of memory_rows, after 2 warm-up steps
SAVED_COUNTS = "activations and weight copies"  # what saved_micro and peak_saved count, stored with each recording
MEMORY_MODELS = {"simplecnn": ((1, 28, 28), {"in_channels": 1}), "small_resnet": ((3, 32, 32), {"in_channels": 3})}


def memory_rows(
    device: str = "cuda",
    model: str = "small_resnet",
    batch: int = 512,
    accum: Sequence[int] = (1, 2, 4, 8),
    precisions: Sequence[str] = ("fp32", "bf16"),
) -> list[dict]:
    """Chapter 04: one optimizer step on an effective batch of `batch`, split into N micro-batches.

    Per precision and N: bytes saved by one micro-batch's forward (`saved_micro`), the most
    held at once over the whole step (`peak_saved`); on CUDA also the step's peak memory
    (`peak`) and time (`ms`, median, and `ms_q`, the middle half), None elsewhere.
    """
    shape, kwargs = MEMORY_MODELS[model]
    kind, cuda = device.split(":")[0], device.startswith("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    x, y = torch.randn(batch, *shape, device=device, generator=g), torch.randint(0, 10, (batch,), device=device)
    rows = []
    for p in precisions:
        torch.manual_seed(0)
        net = build_model(model, **kwargs).to(device)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler(kind, enabled=p == "fp16")
        for n in accum:
            micro = list(zip(x.split(batch // n), y.split(batch // n)))
            step = functools.partial(accumulation_step, net, opt, scaler, micro, dtype=AMP_DTYPES[p])

            def forward(net: nn.Module = net, micro: list = micro, p: str = p) -> None:
                with torch.autocast(kind, dtype=AMP_DTYPES[p], enabled=p != "fp32"):
                    F.cross_entropy(net(micro[0][0]), micro[0][1])

            t = time_fn(step, warmup=2, iters=TIMED_STEPS, device=device) if cuda else None
            rows.append(
                {
                    "precision": p,
                    "micro_batches": n,
                    "micro_size": batch // n,
                    "saved_micro": sum(saved_tensor_bytes(forward).values()),
                    "peak_saved": peak_saved_bytes(step),
                    "peak": peak_memory_bytes(step, device) if cuda else None,
                    "ms": t.median_ms if t else None,
                    "ms_q": list(t.quartiles_ms) if t else None,
                }
            )
        del net, opt
    return rows


def format_memory_rows(rows: Sequence[dict]) -> str:
    """Chapter 04: memory_rows as a table, sizes in MiB (n/a: no CUDA, or not timed)."""
    mib = 2.0**20

    def step_ms(r: dict) -> str | None:
        return None if r["ms"] is None else f"{r['ms']:.1f} ({r['ms_q'][0]:.1f}-{r['ms_q'][1]:.1f})"

    columns = [
        ("precision", "precision", ""),
        ("micro-batches", lambda r: f"{r['micro_batches']} x {r['micro_size']}", ""),
        ("saved/micro", lambda r: r["saved_micro"] / mib, ".1f"),
        ("peak saved", lambda r: r["peak_saved"] / mib, ".1f"),
        ("peak CUDA", lambda r: None if r["peak"] is None else r["peak"] / mib, ".0f"),
        ("step ms (middle half)", step_ms, ""),
    ]
    return table(rows, columns)


def saved_kinds(
    model: str = "small_resnet", batch: int = 512, precision: str = "fp32", probe: int = 2
) -> dict[str, int]:
    """Chapter 04: bytes one forward of `model` saves for backward, by kind (chapter 02's
    saved_bytes_by_kind, summed over dtypes), counted on the CPU with `probe` samples. As in
    memory_rows, the micro-batch is a view of an input batch of `batch` samples, so "existing" is what
    recordings without `saved_counts` also counted in saved_micro and peak_saved: the parameters the
    graph saves and, in fp32, the whole input batch's storage."""
    return dict(_saved_kinds(model, batch, precision, probe))


@functools.lru_cache(maxsize=8)
def _saved_kinds(model: str, batch: int, precision: str, probe: int) -> tuple[tuple[str, int], ...]:
    shape, kwargs = MEMORY_MODELS[model]
    with torch.random.fork_rng():  # the values do not matter here; the caller's random state stays as it was
        net = build_model(model, **kwargs)
        x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))

    def forward() -> None:
        with torch.autocast("cpu", dtype=AMP_DTYPES[precision], enabled=precision != "fp32"):
            F.cross_entropy(net(x[:probe]), y[:probe])

    return tuple((kind, sum(by_dtype.values())) for kind, by_dtype in saved_bytes_by_kind(forward).items())


def recount_saved(ref: dict) -> tuple[list[dict], dict[str, int]]:
    """Chapter 04: a recording's rows with saved_micro and peak_saved counted as memory_rows counts them now
    (activations and weight copies), and the bytes taken off per precision: for a file recorded before
    `saved_counts` existed, the "existing" bytes of saved_kinds (measured here, on the CPU); none for a newer file."""
    if ref.get("saved_counts") == SAVED_COUNTS:
        return list(ref["rows"]), {}
    kw = {"model": ref.get("model", "small_resnet"), "batch": ref.get("batch", 512)}
    extra = {p: saved_kinds(precision=p, **kw)["existing"] for p in dict.fromkeys(r["precision"] for r in ref["rows"])}
    fix = {"saved_micro", "peak_saved"}
    return [{k: v - extra[r["precision"]] if k in fix else v for k, v in r.items()} for r in ref["rows"]], extra


def _versus(a: dict, b: dict) -> str:
    """a's step time against b's, in words: the medians' ratio, judged against the middle halves."""
    ratio = a["ms"] / b["ms"]
    apart = max(a["ms_q"][0], b["ms_q"][0]) > min(a["ms_q"][1], b["ms_q"][1])
    word = "faster" if ratio < 1 else "slower"
    if apart:
        return f"{ratio:.2f}, {word} (the middle halves do not overlap)"
    if abs(ratio - 1) <= 0.1:
        return f"{ratio:.2f}, the same within the spread"
    return f"{ratio:.2f}, {word} by the medians, but the middle halves overlap"


def read_memory_rows(rows: Sequence[dict]) -> str:
    """Chapter 04: memory_rows in words, computed from the numbers. Per precision, from one micro-batch to the most: how
    much the peaks fell and the step slowed, and the time per micro-batch; then the mixed precision's step time
    against fp32's at each split, with the spread of the timed steps."""
    out = []
    by = {p: [r for r in rows if r["precision"] == p] for p in dict.fromkeys(r["precision"] for r in rows)}
    for p, mine in by.items():
        a, b = mine[0], mine[-1]
        saved = a["peak_saved"] / b["peak_saved"]
        peak = a["peak"] / b["peak"] if a["peak"] and b["peak"] else None  # None: not measured (a CPU)
        line = f"{p}, {a['micro_batches']} -> {b['micro_batches']} micro-batches: peak saved {saved:.1f}x smaller"
        out.append(
            line
            + (f", peak CUDA {peak:.2f}x smaller" if peak else "")
            + (f", step {b['ms'] / a['ms']:.1f}x longer" if a["ms"] and b["ms"] else "")
        )
        if peak and peak < 1 + (saved - 1) / 4:
            out.append("    the peak hardly moved: the saved activations do not set it in this step")
    timed = {p: mine for p, mine in by.items() if all(r["ms"] for r in mine)}
    if not timed:
        return "\n".join(out)
    per = {p: [(r["micro_size"], r["ms"] / r["micro_batches"]) for r in mine] for p, mine in timed.items()}
    out.append("ms per micro-batch, at " + ", ".join(str(n) for n, _ in next(iter(per.values()))) + " samples:")
    out += [f"  {p:<6}" + "".join(f"{ms:>7.1f}" for _, ms in mine) for p, mine in per.items()]
    stalls = [f"{p} {a[0]} -> {b[0]}" for p, mine in per.items() for a, b in zip(mine, mine[1:]) if b[1] > 0.75 * a[1]]
    if stalls:
        out.append("a micro-batch half as large, less than 25% quicker: " + ", ".join(stalls))
    for p in [q for q in timed if q != "fp32" and "fp32" in timed]:
        fp32 = {r["micro_batches"]: r for r in timed["fp32"]}
        out.append(f"{p} step time / fp32's (below 1: {p} is faster):")
        out += [
            f"  {r['micro_batches']:>3} x {r['micro_size']:<4} {_versus(r, fp32[r['micro_batches']])}"
            for r in timed[p]
            if r["micro_batches"] in fp32
        ]
    widest = max((r for mine in timed.values() for r in mine), key=lambda r: (r["ms_q"][1] - r["ms_q"][0]) / r["ms"])
    out.append(
        f"{TIMED_STEPS} timed steps per row; the widest middle half spans "
        f"{(widest['ms_q'][1] - widest['ms_q'][0]) / widest['ms']:.0%} of its median "
        f"({widest['precision']}, {widest['micro_batches']} x {widest['micro_size']})"
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m course_lib.chapters.ch04.accumulation",
        description="memory and time of one optimizer step vs the number of micro-batches",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="small_resnet", choices=sorted(MEMORY_MODELS))
    p.add_argument("--batch", type=int, default=512, help="effective batch (use less on a CPU)")
    p.add_argument("--accum", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=sorted(AMP_DTYPES))
    p.add_argument("--json", help="also write the rows with provenance (data/reference/accumulation_<gpu>.json)")
    args = p.parse_args(argv)
    rows = memory_rows(args.device, args.model, args.batch, args.accum, args.precisions)
    command = "python -m course_lib.chapters.ch04.accumulation " + " ".join(argv if argv is not None else sys.argv[1:])
    text = format_memory_rows(rows) + "\n" + read_memory_rows(rows)
    record(command, text, args.json, rows=rows, model=args.model, batch=args.batch, saved_counts=SAVED_COUNTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
