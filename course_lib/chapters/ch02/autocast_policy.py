"""What autocast does on the installed torch, found by running it, not by reading a list.

Chapter 02 is built on this module. autocast is a static, per-op policy registered in the
dispatcher: before an op runs, autocast may cast its floating-point inputs to the
low-precision type ("lower_precision": matmul, linear, conv ...), to fp32 ("fp32": losses,
and on CUDA also softmax, layer_norm, exp, sum ...), or to the widest input type
("promote"); ops it does not know run in whatever dtype their inputs have ("unchanged").
The lists differ between devices and torch versions, so we probe them:

    rows = probe_policy("cpu", torch.bfloat16)     # one PolicyRow per op in OPS
    print(format_policy(rows))
    probe_policy("cuda", torch.float16, fake=True) # the CUDA policy, on a machine without a GPU

How an op is classified (see `_classify`): run it under autocast with fp32 inputs, with
low-precision inputs and with mixed inputs, and record the output dtypes and the casts
autocast inserts (`dispatch_trace`). fp32 in -> low out is "lower_precision"; low in ->
fp32 out is "fp32"; a cast of the low input up to fp32 that plain eager mode does not make
is "promote"; an error under autocast that plain eager mode does not raise is "banned".
`dispatch_trace`, `casts`, `backward_pairs` and `registered_ops` are in autocast_dispatch.

`fake=True` runs CUDA autocast on FakeTensors (shape/dtype-only tensors that claim to be on
CUDA): the dispatcher applies the same AutocastCUDA kernels, so the dtypes are the real
policy, but no kernel runs. The GPU cells of chapter 02 compare it with a real GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import sys
import textwrap
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from course_lib.chapters.ch02.autocast_dispatch import SHORT, DispatchRecorder, casts, short
from course_lib.reference import record
from course_lib.tables import table

__all__ = [
    "LOW_PRECISION",
    "PolicyRow",
    "fake_cuda_available",
    "probe_policy",
    "compare_policies",
    "format_policy",
    "format_by_policy",
]

LOW_PRECISION = (torch.float16, torch.bfloat16)
POLICIES = ("lower_precision", "fp32", "promote", "unchanged", "banned")
WIDTH = 100  # the widest line a table prints: JupyterLab shows it without wrapping


# --------------------------------------------------------------------------- the op table


@dataclass(frozen=True)
class OpSpec:
    """One op to probe. `fn` takes the floating-point inputs (the ones the probe
    varies between fp32 and low precision); parameters such as a linear layer's weight are
    made inside `fn`, in fp32, as a model's parameters would be."""

    name: str
    fn: Callable[..., torch.Tensor]
    shapes: tuple[tuple[int, ...], ...]
    group: str  # "matmul" | "reduction" | "normalization" | "loss" | "pointwise" | "layout" | "attention"


def _w(x: torch.Tensor, *shape: int) -> torch.Tensor:
    # A deterministic fp32 "parameter" on x's device (no RNG: works under FakeTensorMode too).
    return torch.linspace(-0.5, 0.5, math.prod(shape), device=x.device).reshape(shape)


def _target(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros(x.shape[0], dtype=torch.long, device=x.device)


_M = (8, 16)  # every probe is tiny: the dtype policy does not depend on the size

OPS: dict[str, OpSpec] = {
    s.name: s
    for s in [
        # -- matmul-like: the ops Tensor Cores accelerate
        OpSpec("matmul", lambda a, b: a @ b.T, (_M, _M), "matmul"),
        OpSpec("mm", lambda a, b: torch.mm(a, b.T), (_M, _M), "matmul"),
        OpSpec("linear", lambda x: F.linear(x, _w(x, 4, 16), _w(x, 4)), (_M,), "matmul"),
        OpSpec("conv2d", lambda x: F.conv2d(x, _w(x, 4, 3, 3, 3)), ((2, 3, 8, 8),), "matmul"),
        OpSpec("conv1d", lambda x: F.conv1d(x, _w(x, 4, 3, 3)), ((2, 3, 8),), "matmul"),
        OpSpec("bmm", lambda a, b: torch.bmm(a, b.transpose(1, 2)), ((2, 4, 8), (2, 4, 8)), "matmul"),
        OpSpec("addmm", lambda c, a, b: torch.addmm(c, a, b.T), ((8, 8), _M, _M), "matmul"),
        OpSpec(
            "baddbmm",
            lambda c, a, b: torch.baddbmm(c, a, b.transpose(1, 2)),
            ((2, 4, 4), (2, 4, 8), (2, 4, 8)),
            "matmul",
        ),
        OpSpec("einsum", lambda a, b: torch.einsum("ij,kj->ik", a, b), (_M, _M), "matmul"),
        OpSpec(
            "scaled_dot_product_attention",
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
            ((1, 2, 4, 8),) * 3,
            "attention",
        ),
        # -- normalizations
        OpSpec("softmax", lambda x: F.softmax(x, -1), (_M,), "normalization"),
        OpSpec("log_softmax", lambda x: F.log_softmax(x, -1), (_M,), "normalization"),
        OpSpec("layer_norm", lambda x: F.layer_norm(x, (16,), _w(x, 16) + 1, _w(x, 16)), (_M,), "normalization"),
        OpSpec("group_norm", lambda x: F.group_norm(x, 2, _w(x, 4) + 1, _w(x, 4)), ((2, 4, 8),), "normalization"),
        OpSpec(
            "batch_norm",
            lambda x: F.batch_norm(
                x,
                torch.zeros(4, device=x.device),
                torch.ones(4, device=x.device),
                _w(x, 4) + 1,
                _w(x, 4),
                training=True,
            ),
            ((8, 4),),
            "normalization",
        ),
        OpSpec("rms_norm", lambda x: F.rms_norm(x, (16,), _w(x, 16) + 1), (_M,), "normalization"),
        # -- reductions and range-hungry pointwise math
        OpSpec("sum", lambda x: x.sum(), (_M,), "reduction"),
        OpSpec("mean", lambda x: x.mean(), (_M,), "reduction"),
        OpSpec("prod", lambda x: x.prod(), (_M,), "reduction"),
        OpSpec("cumsum", lambda x: x.cumsum(0), (_M,), "reduction"),
        OpSpec("norm", lambda x: x.norm(), (_M,), "reduction"),
        OpSpec("logsumexp", lambda x: x.logsumexp(-1), (_M,), "reduction"),
        OpSpec("exp", torch.exp, (_M,), "pointwise"),
        OpSpec("log", lambda x: torch.log(x.abs() + 1), (_M,), "pointwise"),
        OpSpec("pow", lambda x: x.pow(2), (_M,), "pointwise"),
        OpSpec("rsqrt", lambda x: torch.rsqrt(x.abs() + 1), (_M,), "pointwise"),
        # -- losses
        OpSpec("mse_loss", F.mse_loss, (_M, _M), "loss"),
        OpSpec("l1_loss", F.l1_loss, (_M, _M), "loss"),
        OpSpec("cross_entropy", lambda x: F.cross_entropy(x, _target(x)), (_M,), "loss"),
        OpSpec("nll_loss", lambda x: F.nll_loss(x, _target(x)), (_M,), "loss"),
        OpSpec("binary_cross_entropy_with_logits", F.binary_cross_entropy_with_logits, (_M, _M), "loss"),
        OpSpec(
            "binary_cross_entropy",
            lambda x, y: F.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(y)),
            (_M, _M),
            "loss",
        ),
        # -- cheap pointwise ops and layout ops
        OpSpec("relu", torch.relu, (_M,), "pointwise"),
        OpSpec("gelu", F.gelu, (_M,), "pointwise"),
        OpSpec("sigmoid", torch.sigmoid, (_M,), "pointwise"),
        OpSpec("dropout", lambda x: F.dropout(x, 0.5), (_M,), "pointwise"),
        OpSpec("add", torch.add, (_M, _M), "pointwise"),
        OpSpec("mul", torch.mul, (_M, _M), "pointwise"),
        OpSpec("addcmul", torch.addcmul, (_M, _M, _M), "pointwise"),
        OpSpec("atan2", torch.atan2, (_M, _M), "pointwise"),
        OpSpec("cat", lambda a, b: torch.cat([a, b]), (_M, _M), "layout"),
        OpSpec("stack", lambda a, b: torch.stack([a, b]), (_M, _M), "layout"),
        OpSpec("index_put", lambda x, v: x.index_put((torch.arange(8, device=x.device),), v), (_M, _M), "layout"),
        OpSpec("max_pool2d", lambda x: F.max_pool2d(x, 2), ((2, 3, 8, 8),), "layout"),
        OpSpec("interpolate", lambda x: F.interpolate(x, scale_factor=2), ((2, 3, 8, 8),), "layout"),
    ]
}


# --------------------------------------------------------------------------- running ops under autocast


@contextlib.contextmanager
def _fake_cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    # torch.autocast("cuda") switches itself off when no GPU is present, so set the same
    # thread-local state it sets (and restore it) by hand.
    prev = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", prev[0])
        torch.set_autocast_dtype("cuda", prev[1])


def _autocast(device: str, dtype: torch.dtype, enabled: bool, fake: bool) -> contextlib.AbstractContextManager:
    if not enabled:
        return contextlib.nullcontext()
    if fake:
        return _fake_cuda_autocast(dtype)
    return torch.autocast(device, dtype=dtype)


def _inputs(spec: OpSpec, device: str, dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    # Positive, moderate values: log/rsqrt/prod behave, nothing overflows in fp16.
    return [
        torch.linspace(0.1, 1.0 + 0.1 * i, math.prod(shape), device=device).reshape(shape).to(dt)
        for i, (shape, dt) in enumerate(zip(spec.shapes, dtypes))
    ]


@dataclass(frozen=True)
class Outcome:
    """What one call did: the output dtype (or the error) and the casts made."""

    out_dtype: torch.dtype | None
    error: str | None
    casts: Counter


def run_op(
    spec: OpSpec,
    device: str,
    dtype: torch.dtype,
    in_dtypes: Sequence[torch.dtype],
    autocast: bool = True,
    fake: bool = False,
) -> Outcome:
    """Run `spec` once on inputs of `in_dtypes`, with or without autocast."""
    mode = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
    with mode:
        xs = _inputs(spec, device, in_dtypes)
        try:
            # Silence warnings about slow paths for mixed dtypes (e.g. rms_norm's "Mismatch dtype"):
            # the probe is about dtypes, and the same warning printed 4 times per op hides the table.
            with warnings.catch_warnings(), _autocast(device, dtype, autocast, fake):
                warnings.simplefilter("ignore")
                rec = DispatchRecorder()
                with rec:
                    out = spec.fn(*xs)
            return Outcome(out.dtype, None, casts(rec.entries))
        except Exception as e:  # the op refused these inputs: that is a result too
            return Outcome(None, f"{type(e).__name__}: {str(e).splitlines()[0]}", Counter())


@dataclass(frozen=True)
class PolicyRow:
    """Chapter 02: what autocast did to one op, for fp32, low-precision and mixed inputs."""

    op: str
    group: str
    device: str
    dtype: torch.dtype  # the autocast (low-precision) dtype
    from_fp32: torch.dtype | None  # output dtype when every input is fp32
    from_low: torch.dtype | None  # ... when every input is `dtype`
    from_mixed: torch.dtype | None  # ... when the first input is `dtype`, the others fp32 (None: one input only)
    policy: str  # one of POLICIES
    note: str = ""

    def as_dict(self) -> dict:
        """A JSON-friendly record (dtypes as 'fp32' / 'bf16' / 'fp16', '-' for an error)."""
        return {
            "op": self.op,
            "group": self.group,
            "device": self.device,
            "dtype": short(self.dtype),
            "from_fp32": short(self.from_fp32),
            "from_low": short(self.from_low),
            "from_mixed": short(self.from_mixed) if self.n_inputs > 1 else "",
            "policy": self.policy,
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "PolicyRow":
        """The inverse of as_dict (for tables recorded on a GPU in data/reference/)."""
        back = {v: k for k, v in SHORT.items()}
        f32, low, mixed = (back.get(d[k]) if d[k] else None for k in ("from_fp32", "from_low", "from_mixed"))
        return cls(d["op"], d["group"], d["device"], back[d["dtype"]], f32, low, mixed, d["policy"], d.get("note", ""))

    @property
    def n_inputs(self) -> int:
        if self.op in OPS:
            return len(OPS[self.op].shapes)
        return 2 if self.from_mixed is not None else 1  # a row read back from a file: mixed inputs need two


def _classify(spec: OpSpec, device: str, dtype: torch.dtype, fake: bool) -> PolicyRow:
    n = len(spec.shapes)
    f32, low = [torch.float32] * n, [dtype] * n
    a32, alow = run_op(spec, device, dtype, f32, True, fake), run_op(spec, device, dtype, low, True, fake)
    amix = run_op(spec, device, dtype, [dtype] + [torch.float32] * (n - 1), True, fake) if n > 1 else None
    row = dict(
        op=spec.name,
        group=spec.group,
        device=device,
        dtype=dtype,
        from_fp32=a32.out_dtype,
        from_low=alow.out_dtype,
        from_mixed=amix.out_dtype if amix else None,
    )
    if a32.error:
        plain = run_op(spec, device, dtype, f32, False, fake)
        if plain.error is None:
            return PolicyRow(**row, policy="banned", note=a32.error)
        return PolicyRow(**row, policy="unchanged", note=f"fails even without autocast: {a32.error}")
    if a32.out_dtype == dtype:
        return PolicyRow(**row, policy="lower_precision")
    if alow.out_dtype == torch.float32:
        return PolicyRow(**row, policy="fp32")
    if amix is not None:
        pmix = run_op(spec, device, dtype, [dtype] + [torch.float32] * (n - 1), False, fake)
        up = (short(dtype), "fp32")
        if amix.error is None and (pmix.error is not None or amix.casts[up] > pmix.casts[up]):
            return PolicyRow(**row, policy="promote", note="autocast casts low input up")
        note = ""
        if amix.error:
            note = "mixed inputs raise " + amix.error
        elif amix.out_dtype == torch.float32:
            note = "mixed: ordinary promotion"
        return PolicyRow(**row, policy="unchanged", note=note)
    return PolicyRow(**row, policy="unchanged")


@functools.lru_cache(maxsize=None)  # a property of the torch build: ask once
def fake_cuda_available() -> bool:
    """Chapter 02: can this torch build show the CUDA autocast policy without a GPU?"""
    try:
        return run_op(OPS["mm"], "cuda", torch.float16, [torch.float32] * 2, True, True).out_dtype == torch.float16
    except Exception:
        return False


def probe_policy(
    device: str = "cpu", dtype: torch.dtype | None = None, ops: Sequence[str] | None = None, fake: bool = False
) -> list[PolicyRow]:
    """Chapter 02: classify every op in OPS (or `ops`) under autocast(device, dtype).

    dtype defaults to torch.get_autocast_dtype(device): bf16 on CPU, fp16 on CUDA.
    fake=True probes CUDA with FakeTensors, for machines without a GPU.
    """
    dtype = dtype or torch.get_autocast_dtype(device)
    if fake and device != "cuda":
        raise ValueError("fake=True is for device='cuda' (a real CPU is always available)")
    return [_classify(OPS[name], device, dtype, fake) for name in (ops or OPS)]


def compare_policies(a: Sequence[PolicyRow], b: Sequence[PolicyRow]) -> list[tuple[str, str, str]]:
    """Chapter 02: the ops whose policy differs between two probes, as (op, policy_a, policy_b)."""
    pb = {r.op: r.policy for r in b}
    return [(r.op, r.policy, pb[r.op]) for r in a if r.op in pb and pb[r.op] != r.policy]


def format_policy(rows: Sequence[PolicyRow], group_by_policy: bool = True, width: int = WIDTH) -> str:
    """Chapter 02: a probe as a fixed-width table (output dtype for fp32 / low / mixed inputs).

    No line is wider than `width`: a note that does not fit its column is printed in full,
    wrapped, under the table and referred to by number.
    """
    if not rows:
        return "(no rows)"
    low = short(rows[0].dtype)
    order = {p: i for i, p in enumerate(POLICIES)}
    rows = sorted(rows, key=lambda r: (order[r.policy], r.group, r.op)) if group_by_policy else list(rows)
    columns = [
        ("op", "op", ""),
        ("fp32", lambda r: r.as_dict()["from_fp32"], ""),
        (low, lambda r: r.as_dict()["from_low"], ""),
        ("mixed", lambda r: r.as_dict()["from_mixed"], ""),
        ("policy", "policy", "<"),
    ]
    room = width - max(len(line) for line in table(rows, columns).splitlines()) - 2  # the note column's width
    notes: list[str] = []
    shown = {}  # id(row) -> its note, or where to find it under the table
    for r in rows:
        if len(r.note) > room:
            notes.append(r.note)
        shown[id(r)] = f"(see note {len(notes)})" if len(r.note) > room else r.note
    out = [f"autocast({rows[0].device!r}, {low}): output dtype for inputs that are"]
    out.append(table(rows, [*columns, ("note", lambda r: shown[id(r)], "<")]))
    for i, note in enumerate(notes, 1):
        out += textwrap.wrap(f"note {i}: {note}", width, subsequent_indent="  ")
    return "\n".join(out)


def format_by_policy(rows: Sequence[PolicyRow], width: int = WIDTH) -> str:
    """Chapter 02: the ops of a probe listed under each policy, wrapped at `width` characters."""
    if not rows:
        return "(no rows)"
    head = f"autocast({rows[0].device!r}, {short(rows[0].dtype)})"
    out = []
    for policy in POLICIES:
        ops = [r.op for r in rows if r.policy == policy]
        if ops:
            out += textwrap.wrap(f"{head} {policy}: {', '.join(ops)}", width, subsequent_indent="    ")
    return "\n".join(out)


def output_dtype(
    op: str, device: str, dtype: torch.dtype, in_dtypes: Sequence[torch.dtype], fake: bool = False
) -> torch.dtype | None:
    """The output dtype of OPS[op] under autocast(device, dtype) for inputs of
    `in_dtypes` (None if it raises). The live answer exercise 02.1 is checked against."""
    return run_op(OPS[op], device, dtype, in_dtypes, True, fake).out_dtype


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m course_lib.chapters.ch02.autocast_policy",
        description="probe the autocast op policy of the installed torch on this machine",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--fake", action="store_true", help="probe CUDA with FakeTensors (no GPU needed)")
    p.add_argument("--json", help="also write the tables with provenance (data/reference/autocast_policy_<gpu>.json)")
    args = p.parse_args(argv)
    probes = {short(dt): probe_policy(args.device, dt, fake=args.fake) for dt in (torch.float16, torch.bfloat16)}
    command = "python -m course_lib.chapters.ch02.autocast_policy " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    record(
        command,
        "\n\n".join(format_policy(rows) for rows in probes.values()),
        args.json,
        fake=args.fake,
        policy={k: [r.as_dict() for r in rows] for k, rows in probes.items()},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
