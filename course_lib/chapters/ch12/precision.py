"""Chapter 12: FSDP2's MixedPrecisionPolicy against autocast, its traps measured, and TP/HSDP on the CPU.

    result = run_precision_experiments(progress=True)   # one torchrun launch of 4 gloo processes
    print(format_dtype_table(result))                    # which dtype every tensor has, FSDP2 vs autocast
    print(format_saved_activations(result))              # bytes saved for backward, per dtype
    print(format_traps(result)); print(format_correctness(result)); print(format_tp_vs_fsdp(result))
    print(format_recorded_fp8())                         # torchtitan's 8xH100 figures, recorded by others

Every rank of the launch runs course_lib.chapters.ch12.precision_worker, which calls the rank-side
functions here (the model, the sharding, the instruments); the notebook calls the launcher and the
formatters. `fsdp_step_cuda` is the same FSDP2 bf16 step on CUDA/NCCL, for a machine with GPUs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.chapters.ch08.ddp_launch import launch
from course_lib.tables import table
from course_lib.timing import time_fn

__all__ = [
    "FLOOR",
    "RECORDED_FP8",
    "PrecisionNet",
    "shard_blocks",
    "avg_factor",
    "saved_tensor_bytes",
    "recorded_reduce_scatters",
    "run_precision_experiments",
    "format_dtype_table",
    "format_saved_activations",
    "format_traps",
    "format_correctness",
    "format_tp_vs_fsdp",
    "format_recorded_fp8",
    "fsdp_step_cuda",
]

# The first torch whose gloo reduce-scatter with ReduceOp.AVG averages (pytorch#162338: it sums on <= 2.8, so
# FSDP2's gradients come out N times too large). Measured right on 2.13 and 2.14; 2.9-2.12 were not run here, and
# the worker measures it on the running torch anyway (avg_factor) rather than trusting this number.
FLOOR = "2.9"
WORKER = "course_lib.chapters.ch12.precision_worker"
RUNS = Path(__file__).resolve().parents[3] / "runs" / "12_sharding"  # git-ignored: /runs/ in .gitignore

RECORDED_FP8 = {
    "source": "https://github.com/pytorch/torchtitan/commit/7a04053a742af65bc76826bbcc57b7bede7be62c",
    "setup": "torchtitan, Llama3-8B, 8x H100, FSDP2 (recorded by others, not by this course)",
    "rows": [
        {"recipe": "bf16 + torch.compile", "tok_per_s": 5760, "mfu_pct": 33.7, "peak_gib": 47.65},
        {"recipe": "float8 rowwise", "tok_per_s": 6412, "mfu_pct": None, "peak_gib": None},
        {"recipe": "float8 tensorwise + fp8 all-gather", "tok_per_s": 7186, "mfu_pct": 42.1, "peak_gib": 47.32},
    ],
}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- the model and its sharding


class Block(nn.Module):
    """x + fc2(gelu(fc1(ln(x)))): a LayerNorm, which autocast runs in fp32, and two Linears, which it runs
    in bf16: the smallest unit where module-level and op-level mixed precision differ."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.ln, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class PrecisionNet(nn.Module):
    """Chapter 12: `depth` residual MLP blocks and a classifier head: each block becomes one FSDP unit, and the
    head stays with the root unit (which is where `output_dtype` on every block breaks it)."""

    def __init__(self, d: int = 32, h: int = 128, depth: int = 2, classes: int = 10, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)  # the same weights in every rank and in the one-process reference
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(depth))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def shard_blocks(model: PrecisionNet, mesh, policy=None, root_policy=None) -> PrecisionNet:
    """Chapter 12: `fully_shard` each block (one unit each: gathered just before it runs, freed after), then
    the root, which owns what is left (the head). `root_policy` defaults to `policy`; both to fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = policy or MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=root_policy or policy)
    return model


# --------------------------------------------------------------------------- instruments, in a rank


def avg_factor(group=None) -> dict[str, float | None]:
    """Chapter 12: what ReduceOp.AVG really does on `group`, found with two tiny collectives: 1.0 where it
    averages, the group's size where it sums (gloo's reduce-scatter up to torch 2.8, pytorch#162338), None
    where this backend refuses AVG. Dividing FSDP2's gradient by it undoes the bug."""
    n = dist.get_world_size(group)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in 2.14
    out: dict[str, float | None] = {}
    for name in ("reduce_scatter", "all_reduce"):
        ones, result = torch.ones(n), torch.zeros(1)
        try:
            if name == "reduce_scatter":  # every rank gives n ones; each gets one element back: 1 averaged, n summed
                scatter(result, ones, op=dist.ReduceOp.AVG, group=group)
            else:
                dist.all_reduce(ones, op=dist.ReduceOp.AVG, group=group)
                result = ones[:1]
            out[name] = result.item()
        except (RuntimeError, ValueError):  # an old backend without AVG
            out[name] = None
    return out


@contextlib.contextmanager
def saved_tensor_bytes(weight_shapes: set[tuple[int, ...]]) -> Iterator[dict[str, int]]:
    """Chapter 12: bytes that autograd saves for backward inside the block, per dtype name, filled in as the
    forward runs. A tensor with a weight's shape (or its transpose) in `weight_shapes` counts as a weight,
    not an activation, and is left out: FSDP's unsharded bf16 weights and autocast's bf16 weight copies alike."""
    found: dict[str, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if tuple(t.shape) not in weight_shapes:
            found[_name(t.dtype)] = found.get(_name(t.dtype), 0) + t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield found


def weight_shapes(model: nn.Module) -> set[tuple[int, ...]]:
    """Every parameter's full shape and its transpose (a DTensor's `shape` is the full one)."""
    shapes = {tuple(p.shape) for p in model.parameters()}
    return shapes | {s[::-1] for s in shapes}


@contextlib.contextmanager
def recorded_reduce_scatters() -> Iterator[list[dict]]:
    """Chapter 12: every reduce-scatter FSDP2 starts meanwhile, as {"dtype", "bytes"} of its input buffer
    (the unsharded gradients of one unit, cast to `reduce_dtype`). It wraps the one function FSDP2 calls:
    dist.reduce_scatter_single from torch 2.14, dist.reduce_scatter_tensor before."""
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    original = getattr(dist, name)
    calls: list[dict] = []

    def recorder(*args, **kwargs):
        buffer = kwargs["input"] if "input" in kwargs else args[1]
        calls.append({"dtype": _name(buffer.dtype), "bytes": buffer.numel() * buffer.element_size()})
        return original(*args, **kwargs)

    setattr(dist, name, recorder)
    try:
        yield calls
    finally:
        setattr(dist, name, original)


# --------------------------------------------------------------------------- launching, from the notebook


def run_precision_experiments(progress: bool = True, timeout: float = 150.0, out: str | Path | None = None) -> dict:
    """Chapter 12: every precision experiment of the chapter in one torchrun launch of 4 gloo processes.

    The 4 ranks form a 1-D mesh (N = 4) and a 2x2 mesh ("replicate", "shard") whose "shard" rows,
    ranks {0, 1} and {2, 3}, are the N = 2 meshes. Returns plain data (numbers, dtype names, error text):
    rank 0's results, with each rank's GradScaler outcome under "fp16_scaler"/"ranks"."""
    if out is None:
        out = RUNS / "precision"
        if out.is_dir():
            shutil.rmtree(out)
    out = Path(out)
    run = launch([], nproc=4, module=WORKER, timeout=timeout, out=out, name="precision", progress=progress)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    result = ranks[0]
    result["fp16_scaler"]["ranks"] = [r["fp16_scaler"]["this_rank"] for r in ranks]
    result["seconds"] = run.seconds
    return result


# --------------------------------------------------------------------------- formatting


def format_dtype_table(result: dict) -> str:
    """Chapter 12: the dtype of every tensor of one step, FSDP2 with a bf16 policy beside one process under
    autocast (bf16), as measured in the ranks."""
    return table(
        result["dtypes"]["rows"],
        [("tensor", "tensor", ""), ("FSDP2 bf16 policy", "fsdp2", "<"), ("autocast bf16", "autocast", "<")],
    )


def format_saved_activations(result: dict) -> str:
    """Chapter 12: bytes saved for backward by the same model and batch, per dtype (weights left out)."""
    rows = result["saved"]["rows"]
    return table(
        rows,
        [
            ("forward", "mode", ""),
            ("fp32 B", lambda r: r["bytes"].get("float32", 0), ","),
            ("bf16 B", lambda r: r["bytes"].get("bfloat16", 0), ","),
            ("total B", lambda r: sum(r["bytes"].values()), ","),
        ],
    )


def format_traps(result: dict) -> str:
    """Chapter 12: the four precision traps, each as measured, one small table each: reduce_dtype=None, the
    model cast to bf16 before sharding, output_dtype on every block, fp16 with the plain GradScaler."""
    red = [{"case": f"reduce_dtype={k}"} | v for k, v in result["reduce_dtype"]["runs"].items()]
    frozen = result["frozen"]
    master = [{"case": k} | v for k, v in frozen["runs"].items()]
    out = [{"case": k, "what": v["error"] or f"output {v['output']}"} for k, v in result["output_dtype"].items()]
    return "\n\n".join(
        [
            table(
                red,
                [
                    ("param_dtype=bf16", "case", ""),
                    ("reduce-scatter dtype", "dtype", ">"),
                    ("bytes", "bytes", ","),
                    ("grad max rel diff", "grad_rel_diff", ".2e"),
                ],
            ),
            table(
                master,
                [
                    (f"AdamW lr {frozen['lr']:g}, {frozen['steps']} steps", "case", ""),
                    ("shard dtype", "shard_dtype", ">"),
                    ("weights unchanged", "unchanged", ".1%"),
                ],
            ),
            table(out, [("output_dtype=fp32", "case", ""), ("result", "what", "<")]),
            table(
                result["fp16_scaler"]["ranks"],
                [
                    ("fp16 + GradScaler: rank", "rank", ""),
                    ("inf written here", "inf_written", ""),
                    ("weights unchanged", "unchanged", ""),
                    ("scale before", "scale_before", "g"),
                    ("scale after", "scale_after", "g"),
                ],
            ),
        ]
    )


def format_correctness(result: dict) -> str:
    """Chapter 12: FSDP2 (fp32), HSDP and tensor parallelism against one process on the global batch."""
    rows = [dict(r) for r in result["correctness"]["rows"]]
    return table(
        rows,
        [
            ("layout", "layout", ""),
            ("ranks", "ranks", ""),
            ("AVG factor", "factor", "g"),
            ("compared", "what", "<"),
            ("max rel diff", "rel_diff", ".1e"),
        ],
    )


def format_tp_vs_fsdp(result: dict) -> str:
    """Chapter 12: bytes per rank of one block's parameters and of its layer outputs (the activations), for the
    same micro-batch per model replica: one process, FSDP2 on 2 ranks, tensor parallel on 2 ranks."""
    return table(
        result["tp_vs_fsdp"]["rows"],
        [
            ("layout", "layout", ""),
            ("parameters B/rank", "param_bytes", ","),
            ("activations B/rank", "activation_bytes", ","),
            ("fc1 output shape/rank", lambda r: " x ".join(map(str, r["fc1_out"])), ">"),
        ],
    )


def format_recorded_fp8(recorded: dict = RECORDED_FP8) -> str:
    """Chapter 12: torchtitan's FSDP2 float8 figures (Llama3-8B, 8x H100), labelled as recorded by others."""
    body = table(
        recorded["rows"],
        [
            ("recipe", "recipe", ""),
            ("tok/s (as reported)", "tok_per_s", ","),
            ("MFU %", "mfu_pct", ".1f"),
            ("peak GiB", "peak_gib", ".2f"),
        ],
    )
    return f"{recorded['setup']}\n{body}\nsource: {recorded['source']}"


# --------------------------------------------------------------------------- the GPU row


def fsdp_step_cuda(steps: int = 20, d: int = 1024, h: int = 4096, depth: int = 8, batch: int = 64) -> dict:
    """Chapter 12: the chapter's FSDP2 bf16 step on CUDA/NCCL: the world torchrun set up (one GPU per rank),
    or, started alone, a world of one GPU. Returns ms per step (median) and the peak bytes of this rank.

    bf16 parameters for compute and all-gather, fp32 gradient reduction, fp32 output from the root only; the
    sharded fp32 parameters are what AdamW updates. Where it made the process group, it destroys it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not torch.cuda.is_available():
        raise RuntimeError("fsdp_step_cuda needs a CUDA GPU; on a CPU the chapter's gloo launch is the measurement")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)  # one GPU per process, before NCCL touches any
    made = not dist.is_initialized()
    if made:  # started alone: a world of one, on this machine
        for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29512")):
            os.environ.setdefault(k, v)
        dist.init_process_group("nccl", device_id=device)
    try:
        mesh = init_device_mesh("cuda", (dist.get_world_size(),))
        bf16, fp32 = torch.bfloat16, torch.float32
        model = PrecisionNet(d, h, depth, classes=d).to(device)
        shard_blocks(
            model,
            mesh,
            MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32),
            MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32, output_dtype=fp32),
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(batch, d, device=device)
        y = torch.randint(0, d, (batch,), device=device)
        losses = []

        def step() -> None:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())

        torch.cuda.reset_peak_memory_stats(device)  # this step's peak, not an earlier cell's
        timing = time_fn(step, warmup=3, iters=steps, device=device)  # CUDA events, after 3 warm-up steps
        result = {
            "world": dist.get_world_size(),
            "gpu": torch.cuda.get_device_name(device),
            "ms_per_step": timing.median_ms,
            "timing": str(timing),
            "peak_bytes": torch.cuda.max_memory_allocated(device),
            "loss": losses[-1].item(),
            "params": sum(p.numel() for p in model.parameters()),
            "sharded_param_dtype": _name(next(model.parameters()).to_local().dtype),
        }
        getattr(mesh, "_pg_registry", {}).clear()  # the mesh's groups must not outlive the process group
        return result
    finally:
        if made:
            dist.destroy_process_group()
