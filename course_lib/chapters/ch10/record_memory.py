"""Records the memory of training steps on a GPU, phase by phase: what chapter 10's model is checked against.

    python -m course_lib.chapters.ch10.record_memory --json data/reference/memory_<gpu>.json

Each row is one steady-state step of the core's `amp_step`, measured with the CUDA caching
allocator's own counters (`measure_memory` says the protocol); course_lib.chapters.ch10.recorded
predicts every row and sets the measurement beside it. The rows: GPT-2 small in fp32, bf16 and fp16
at batches 1 to 8, with checkpointing, without SDPA, with foreach AdamW, in pure bf16 and with fp32
master weights (`MasterWeightsAdamW`); chapter 02's MLP (forward and backward only); the course's
SimpleCNN and ResNet-50 with SGD. On a CPU the same code runs at toy size (every count 0), to test
it, not to record.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from course_lib.chapters.ch02.saved_tensors import saved_tensor_bytes
from course_lib.chapters.ch10.master_weights import MasterWeightsAdamW
from course_lib.device import pick_device
from course_lib.models import GPT, MLP, GPTConfig, SimpleCNN, resnet50
from course_lib.reference import record
from course_lib.tables import table
from course_lib.timing import synchronize
from course_lib.train import AMP_DTYPES, amp_step

__all__: list[str] = []  # a recorder: the chapter reads its file through recorded


class _PhaseScaler(torch.amp.GradScaler):
    """The GradScaler amp_step is given, calling `mark(phase)` where the step passes from one phase
    to the next: `scale()` comes after the forward and loss (autocast has exited), `step()` after the
    backward."""

    def __init__(self, device: str, enabled: bool) -> None:
        super().__init__(device, enabled=enabled)
        self.mark: Callable[[str], None] = lambda phase: None

    def scale(self, outputs):  # type: ignore[override]
        self.mark("forward")
        return super().scale(outputs)

    def step(self, optimizer, *args, **kwargs):  # type: ignore[override]
        self.mark("backward")
        return super().step(optimizer, *args, **kwargs)


class _NoUpdate(torch.optim.Optimizer):
    """An optimizer that steps nothing: chapter 02's MLP is measured over forward and backward only."""

    def __init__(self, params) -> None:
        super().__init__(params, {})

    def step(self, closure=None) -> None:  # type: ignore[override]
        return None


def _optimizer(kind: str | None, params: list, precision: str) -> torch.optim.Optimizer:
    if kind is None:
        return _NoUpdate(params)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    implementation = {"fused": {"fused": True}, "foreach": {"foreach": True}}[kind]
    if precision == "bf16-master":  # fp32 masters, made here: they count as the optimizer's
        return MasterWeightsAdamW(params, lr=1e-4, **implementation)
    return torch.optim.AdamW(params, lr=1e-4, **implementation)


def measure_memory(
    build: Callable, batch_fn: Callable, precision: str, optimizer: str | None, device: torch.device, note: str = ""
) -> dict:
    """The bytes of one steady-state training step, phase by phase (CUDA allocator counts; 0 elsewhere).

    Protocol: model built and moved, optimizer made, batch made; two full steps (the optimizer's state
    exists after the first); then the third step phase by phase, each phase's peak absolute
    (reset_peak_memory_stats at its start): the start of the step; zero_grad and forward and loss under
    autocast (allocated after it, peak during it); the scaled backward; scaler.step(opt) and update().
    The step is the core's amp_step; its scaler marks the phases as amp_step passes them.
    precision "bf16-pure": the model's parameters in bf16, autocast off, AdamW on the bf16 parameters.
    precision "bf16-master": parameters in bf16, fp32 master copies in MasterWeightsAdamW, whose step
    copies the bf16 gradients into the masters' .grad (fp32), steps, and copies the masters back.
    optimizer None: forward and backward only (an optimizer that steps nothing).
    """
    cuda = device.type == "cuda"

    def allocated() -> int:
        return torch.cuda.memory_allocated(device) if cuda else 0

    def peak() -> int:
        return torch.cuda.max_memory_allocated(device) if cuda else 0

    def peak_reset() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    base = allocated()
    torch.manual_seed(0)
    model, fwd = build()
    pure = precision.startswith("bf16-")
    if pure:
        model = model.to(torch.bfloat16)
    after_model = allocated() - base
    params = list(model.parameters())
    opt = _optimizer(optimizer, params, precision)
    after_opt = allocated() - base
    x, y = batch_fn()
    after_data = allocated() - base
    dtype = None if pure else AMP_DTYPES[precision]
    scaler = _PhaseScaler(device.type, enabled=precision == "fp16")
    phases: dict = {}

    def mark(name: str) -> None:
        synchronize(device)
        phases[name] = {"allocated": allocated() - base, "peak": peak() - base}
        peak_reset()

    def step() -> None:
        amp_step(model, opt, scaler, [(x, y)], dtype, forward=lambda a, b: fwd(model, a, b))

    for _ in range(2):
        step()
    synchronize(device)
    phases["start"] = {"allocated": allocated() - base}
    peak_reset()
    scaler.mark = mark
    step()
    mark("optimizer")
    scaler.mark = lambda phase: None
    with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        saved = saved_tensor_bytes(lambda: fwd(model, x, y))
    return {
        "precision": precision,
        "optimizer": optimizer,
        "note": note,
        "model_bytes": after_model,
        "optimizer_made_bytes": after_opt - after_model,
        "batch_bytes": after_data - after_opt,
        "phases": phases,
        "peak_bytes": max(v.get("peak", 0) for v in phases.values()),
        "saved_by_dtype": {str(k).replace("torch.", ""): v for k, v in saved.items()},
        "param_count": sum(p.numel() for p in params),
    }


class _Checkpointed(torch.nn.Module):
    """A GPT block whose forward is recomputed in backward (torch.utils.checkpoint, non-reentrant)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, h, use_reentrant=False)


def gpt_build(config: GPTConfig, ckpt: bool, device: torch.device) -> Callable:
    """A builder of the GPT (each block checkpointed, if asked) and its forward that returns the loss."""

    def build():
        model = GPT(config).to(device)
        if ckpt:
            model.blocks = torch.nn.ModuleList(_Checkpointed(b) for b in model.blocks)
        return model, lambda m, a, b: m(a, b)[1]

    return build


def _gpt_rows(device: torch.device) -> list[dict]:
    cuda = device.type == "cuda"
    # GPT-2 small on a GPU; off it, a toy GPT that tests the code in seconds
    gcfg = GPTConfig() if cuda else GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64)
    seq = 1024 if cuda else 64
    configs = []
    for precision in ("fp32", "bf16", "fp16"):
        for batch in (1, 2, 4, 8) if cuda else (1, 2):
            configs.append((batch, precision, "fused", False, True))
    for precision, batch in (("bf16", 4), ("bf16", 8), ("fp32", 4)):
        configs.append((batch, precision, "fused", True, True))
    configs += [(4, "fp32", "fused", False, False), (4, "bf16", "fused", False, False)]
    configs += [(4, "bf16", "foreach", False, True)]
    configs += [(4, "bf16-pure", "fused", False, True), (4, "bf16-master", "fused", False, True)]
    rows = []
    for batch, precision, opt, ckpt, sdpa in configs:
        c = GPTConfig(**{**gcfg.__dict__, "sdpa": sdpa})

        def batch_fn(b=batch, c=c):
            g = torch.Generator(device=device).manual_seed(0)
            return (torch.randint(0, c.vocab_size, (b, seq), device=device, generator=g),) * 2

        try:
            r = measure_memory(gpt_build(c, ckpt, device), batch_fn, precision, opt, device)
        except torch.cuda.OutOfMemoryError as e:
            r = {"precision": precision, "optimizer": opt, "error": str(e)[:200]}
        r.update({"model": "gpt2", "batch": batch, "seq": seq, "checkpointing": ckpt, "sdpa": sdpa})
        r["config"] = c.__dict__
        rows.append(r)
    return rows


def _small_model_rows(device: torch.device) -> list[dict]:
    cuda, rows = device.type == "cuda", []
    # chapter 02's MLP (3 x 4096, batch 512): forward + backward, no optimizer (as chapter 02 measures)
    width, mb = (4096, 512) if cuda else (256, 64)
    for precision in ("fp32", "bf16", "fp16"):
        r = measure_memory(
            lambda: (
                MLP(in_features=width, hidden=width, depth=3).to(device),
                lambda m, a, b: F.cross_entropy(m(a), b),
            ),
            lambda: (torch.randn(mb, width, device=device), torch.randint(0, 10, (mb,), device=device)),
            precision,
            None,
            device,
        )
        r.update({"model": "mlp", "batch": mb, "width": width, "depth": 3})
        rows.append(r)
    # the course's SimpleCNN and ResNet-50 (cuDNN heuristics, no autotuning), SGD with momentum
    for model_name, batches, shape in (("simplecnn", (256,), (1, 28, 28)), ("resnet50", (32, 64), (3, 224, 224))):
        if model_name == "resnet50" and not cuda:
            batches, shape = (2,), (3, 64, 64)
        for batch in batches:
            for precision in ("fp32", "bf16", "fp16"):

                def build(n=model_name):
                    m = SimpleCNN() if n == "simplecnn" else resnet50()
                    return m.to(device), lambda mm, a, b: F.cross_entropy(mm(a), b)

                def batch_fn(b=batch, s=shape, n=model_name):
                    classes = 10 if n == "simplecnn" else 1000
                    return torch.randn(b, *s, device=device), torch.randint(0, classes, (b,), device=device)

                r = measure_memory(build, batch_fn, precision, "sgd", device)
                r.update({"model": model_name, "batch": batch, "shape": list(shape)})
                rows.append(r)
    return rows


def workspaces(device: torch.device) -> dict[str, int]:
    """The CUDA libraries' workspaces, allocated through the caching allocator at a first matmul, per
    dtype, in bytes ({} off CUDA)."""
    ws: dict[str, int] = {}
    if device.type == "cuda":
        for dt in (torch.float32, torch.bfloat16):
            a0 = torch.cuda.memory_allocated(device)
            a = torch.randn(256, 256, device=device, dtype=dt)
            (a @ a).sum().item()
            del a
            synchronize(device)
            ws[str(dt)] = torch.cuda.memory_allocated(device) - a0
    return ws


def format_memory_rows(rows: list[dict]) -> str:
    """The recorded rows as a table: the step's peak and each phase's, in MiB (a row that ran out of
    memory: its error)."""
    mib = 2.0**20

    def phase(name: str) -> Callable[[dict], float]:
        return lambda r: r["phases"][name]["peak"] / mib

    columns = [
        ("model", "model", "<"),
        ("b", "batch", ""),
        ("precision", "precision", "<"),
        ("opt", lambda r: str(r["optimizer"]), "<"),
        ("ckpt", lambda r: str(r.get("checkpointing", "")), "<"),
        ("sdpa", lambda r: str(r.get("sdpa", "")), "<"),
        ("peak MiB", lambda r: r["peak_bytes"] / mib, ".1f"),
        ("forward", phase("forward"), ".0f"),
        ("backward", phase("backward"), ".0f"),
        ("optimizer", phase("optimizer"), ".0f"),
    ]
    return table(rows, columns, skipped=lambda r: r.get("error", "")[:60] if "phases" not in r else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m course_lib.chapters.ch10.record_memory", description=__doc__.split("\n")[0]
    )
    p.add_argument("--json", help="also write the rows with their provenance (data/reference/memory_<gpu>.json)")
    p.add_argument("--device", default="auto")
    p.add_argument("--deadline", type=float, help="accepted as the other recorders take it; every row here is kept")
    args = p.parse_args(argv)
    device = pick_device(args.device)
    payload = {"workspace_bytes": workspaces(device), "rows": _gpt_rows(device) + _small_model_rows(device)}
    words = " ".join(argv if argv is not None else sys.argv[1:])
    text = format_memory_rows(payload["rows"])
    record(f"python -m course_lib.chapters.ch10.record_memory {words}", text, args.json, **payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
