"""What breaks gradient accumulation: update() in the wrong place, BatchNorm, no_sync, a popular article's loop.

Chapter 04. The loop itself, its equivalence with the large batch and its memory are in
course_lib.chapters.ch04.accumulation; here each demonstration runs a loop that gets one thing wrong
and returns what it did: the scale and the skipped steps, the normalization statistics, the
micro-batches that all-reduced, the weight each sample got.

    scale_trajectory("step + update every micro-batch")   # the scale after every micro-batch
    allreduce_calls("no_sync around backward only")       # the micro-batches that all-reduced
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.chapters.ch04.accumulation import accumulated_grad, rel_diff, seeded_batch, seeded_mlp
from course_lib.tables import table
from course_lib.train import TrainConfig, Trainer

__all__ = [
    "LOOP_VARIANTS",
    "scale_trajectory",
    "norm_rows",
    "format_norm_rows",
    "SYNC_PATTERNS",
    "allreduce_calls",
    "article_001_loop",
]


# --------------------------------------------------------------------------- update() in the wrong place

LOOP_VARIANTS = (
    "step + update at the boundary (right)",
    "unscale_ + update every micro-batch",
    "step + update every micro-batch",
)


class _CountingSGD(torch.optim.SGD):
    """SGD that keeps the gradient of every step it really took (GradScaler skips it on inf/NaN)."""

    grads: list[torch.Tensor]

    def step(self, closure=None):
        self.grads.append(torch.cat([p.grad.flatten().double() for g in self.param_groups for p in g["params"]]))
        return super().step(closure)


def scale_trajectory(
    variant: str,
    steps: int = 12,
    accum: int = 4,
    bad: Sequence[int] = (9,),
    init_scale: float = 2.0**10,
    growth_interval: int = 3,
    micro: int = 8,
    lr: float = 0.05,
    seed: int = 0,
) -> dict:
    """Chapter 04: fp16 training on the CPU with torch.amp.GradScaler("cpu"), looped as `variant` says.

    `bad` lists micro-batches with an inf in their input. Returns the scale after every
    micro-batch (`scale`), the micro-batches after which the optimizer stepped (`stepped`) or a
    due step was skipped (`skipped`), and for each step taken the distance of its gradient from
    the large-batch gradient of the first effective batch (`errors`; like for like with lr=0).
    """
    if variant not in LOOP_VARIANTS:
        raise ValueError(f"variant must be one of {LOOP_VARIANTS}")
    x, y = seeded_batch(steps * accum * micro, seed)
    for b in bad:  # a corrupted sample: its loss, and so the gradients, become NaN
        x[b * micro, 0] = float("inf")
    batches = list(zip(x.split(micro), y.split(micro)))
    first = [(x[: accum * micro], y[: accum * micro])]
    large = accumulated_grad(seeded_mlp(seed), first, dtype=torch.float16, scaler=torch.amp.GradScaler("cpu"))
    model = seeded_mlp(seed)
    opt = _CountingSGD(model.parameters(), lr=lr)
    opt.grads = []
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    out: dict = {"scale": [], "stepped": [], "skipped": []}
    for i, (xb, yb) in enumerate(batches):
        if i % accum == 0:
            opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(xb), yb) / accum
        scaler.scale(loss).backward()
        boundary = i % accum == accum - 1  # the last micro-batch of an optimizer step
        taken = len(opt.grads)
        if variant == LOOP_VARIANTS[1]:  # clip every micro-batch; update() silences unscale_'s error
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            if boundary:
                scaler.step(opt)
            scaler.update()
        elif variant == LOOP_VARIANTS[2] or boundary:
            scaler.step(opt)
            scaler.update()
        if variant == LOOP_VARIANTS[2] or boundary:
            (out["stepped"] if len(opt.grads) > taken else out["skipped"]).append(i)
        out["scale"].append(scaler.get_scale())
    return {**out, "errors": [rel_diff(g, large) for g in opt.grads]}


# --------------------------------------------------------------------------- BatchNorm


def norm_rows(
    norms: Sequence[str] = ("BatchNorm", "GroupNorm", "LayerNorm", "BatchNorm, eval mode"),
    batch: int = 64,
    micro_sizes: Sequence[int] = (32, 16, 8, 4),
    seed: int = 0,
) -> list[dict]:
    """Chapter 04: large batch vs accumulated micro-batches for a model with a normalization layer.

    `grad`: relative distance of the accumulated gradient from the large batch's (fp32);
    `running_mean`: the same for BatchNorm's running mean after the forward passes of one step
    (None for layers without one). "BatchNorm, eval mode" normalizes with frozen statistics.
    """
    x, y = seeded_batch(batch, seed)
    rows = []
    for norm in norms:
        kind = norm.split(",")[0]

        def fresh() -> nn.Module:
            m = seeded_mlp(seed, norm=kind)
            return m.eval() if "eval" in norm else m

        big = fresh()
        g_big = accumulated_grad(big, [(x, y)])
        for size in micro_sizes:
            m = fresh()
            g = accumulated_grad(m, list(zip(x.split(size), y.split(size))))
            rm = (
                rel_diff(m[1].running_mean, big[1].running_mean) if kind == "BatchNorm" and "eval" not in norm else None
            )
            rows.append({"norm": norm, "micro_size": size, "grad": rel_diff(g, g_big), "running_mean": rm})
    return rows


def format_norm_rows(rows: Sequence[dict]) -> str:
    """Chapter 04: norm_rows as a table (relative distances from the large batch of len(x))."""
    columns = [("normalization", "norm", ""), ("micro-batch", "micro_size", ""), ("gradient", "grad", ".2e")]
    columns.append(("running mean", "running_mean", ".2e"))  # "-": a norm without running statistics
    return table(rows, columns, missing="-")


# --------------------------------------------------------------------------- DDP: no_sync

SYNC_PATTERNS = (
    "no no_sync",
    "no_sync around forward and backward",
    "no_sync around backward only",
    "flag set between forward and backward",
    "course_lib.train.Trainer.train_step",
)


@contextlib.contextmanager
def _one_process_group() -> Iterator[None]:
    """A gloo group of one process, met through a file (no network); an existing group is used as it is."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
            stack.callback(dist.destroy_process_group)
        yield


def allreduce_calls(pattern: str, accum: int = 4, micro: int = 8, seed: int = 0) -> list[int]:
    """Chapter 04: the micro-batches whose backward all-reduced gradients, in a 1-process DDP run.

    A communication hook on the DDP model records the micro-batch index each time a gradient
    bucket is all-reduced. Right: only the last one. `pattern` is one of SYNC_PATTERNS.
    """
    if pattern not in SYNC_PATTERNS:
        raise ValueError(f"pattern must be one of {SYNC_PATTERNS}")
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    x, y = seeded_batch(accum * micro, seed)
    batches = list(zip(x.split(micro), y.split(micro)))
    state: dict = {"micro": -1, "calls": []}

    def hook(st, bucket):  # no annotations: DDP checks them, and here they would be strings
        st["calls"].append(st["micro"])
        return allreduce_hook(None, bucket)

    with _one_process_group():
        net = seeded_mlp(seed)
        net.register_forward_pre_hook(lambda module, args: state.update(micro=state["micro"] + 1))
        ddp = nn.parallel.DistributedDataParallel(net)
        ddp.register_comm_hook(state, hook)
        if pattern == SYNC_PATTERNS[4]:
            cfg = TrainConfig(precision="fp32", device="cpu", progress=False)
            Trainer(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), cfg).train_step(batches)
            return state["calls"]
        for i, (xb, yb) in enumerate(batches):
            last = i == len(batches) - 1
            off = ddp.no_sync() if not last else contextlib.nullcontext()
            if pattern == SYNC_PATTERNS[0]:
                F.cross_entropy(ddp(xb), yb).div(accum).backward()
            elif pattern == SYNC_PATTERNS[1]:
                with off:
                    F.cross_entropy(ddp(xb), yb).div(accum).backward()
            elif pattern == SYNC_PATTERNS[2]:
                loss = F.cross_entropy(ddp(xb), yb).div(accum)
                with off:
                    loss.backward()
            else:  # the flag no_sync sets, switched after the forward (build-nanogpt before its PR #30)
                loss = F.cross_entropy(ddp(xb), yb).div(accum)
                ddp.require_backward_grad_sync = last
                loss.backward()
    return state["calls"]


# --------------------------------------------------------------------------- a popular article's loop


def article_001_loop(
    batch_sizes: Sequence[int], epochs: int, iters_to_accumulate: int, gradient_accumulation_steps: int
) -> list[dict]:
    """Chapter 04: the accumulation loop of popular article 001, run on a tiny model.

    Its two names for one number are kept. Each batch of `batch_sizes` is one loader batch.
    For every optimizer step: the epoch, the (epoch, batch) pairs whose gradients it summed,
    and the weight each of their samples got, relative to the mean over those samples (1.0
    is right). Batches still waiting when the loop ends are returned as a last row, `stepped` False.
    """
    model = seeded_mlp(0, width=8, features=4, classes=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # the article's scaler, off: fp32 on a CPU
    data = [seeded_batch(n, seed=b, features=4, classes=2) for b, n in enumerate(batch_sizes)]
    log, pending = [], []
    for epoch in range(epochs):
        for i, (input, target) in enumerate(data):
            with torch.autocast("cpu", enabled=False):
                output = model(input)
                loss = F.cross_entropy(output, target)
                loss = loss / iters_to_accumulate
            scaler.scale(loss).backward()
            pending.append((epoch, i))
            if (i + 1) % gradient_accumulation_steps == 0:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                log.append({"epoch": epoch, "batches": pending, "stepped": True})
                pending = []
    log += [{"epoch": epochs - 1, "batches": pending, "stepped": False}] if pending else []
    for step in log:  # a sample's weight is 1 / (iters_to_accumulate * its batch size); right: 1 / samples
        step["samples"] = n = sum(batch_sizes[b] for _, b in step["batches"])
        rel = [n / (iters_to_accumulate * batch_sizes[b]) for _, b in step["batches"]]
        step["min_weight"], step["max_weight"] = min(rel), max(rel)
    return log
