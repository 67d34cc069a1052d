"""Chapter 12: one rank of chapter 12's precision runs: the program torchrun starts in each of 4 processes.

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m course_lib.chapters.ch12.precision_worker OUT

course_lib.chapters.ch12.precision.run_precision_experiments starts it (with chapter 08's `launch`). The 4 ranks
make a 1-D mesh (N = 4) and a 2x2 mesh ("replicate", "shard"); the "shard" rows, ranks {0, 1} and {2, 3}, are
two independent N = 2 meshes that run the same 2-rank experiments side by side. Every rank computes the same
one-process reference on the global batch itself (same seed), so nothing but the results crosses processes.
Each rank writes OUT/rank<r>.json; rank 0's holds every experiment, the others add their GradScaler outcome.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# Before any process group exists (chapter 08's ddp_worker says why): its functions take group.WORLD as defaults.
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
import torch.nn.functional as F

from course_lib.chapters.ch08.distributed import max_rel_diff
from course_lib.chapters.ch12.precision import (
    Block,
    PrecisionNet,
    avg_factor,
    recorded_reduce_scatters,
    saved_tensor_bytes,
    shard_blocks,
    weight_shapes,
)

__all__: list[str] = []

B, D, H = 12, 32, 128  # micro-batch per rank (12 is no weight's dimension: saved_tensor_bytes tells them apart)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def batch(n_ranks: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of n_ranks micro-batches, the same in every process."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_ranks * B, D, generator=g), torch.randint(0, 10, (n_ranks * B,), generator=g)


def mine(t: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's micro-batch of a global batch."""
    return t[rank * B : (rank + 1) * B]


def reference_grads(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """One process, fp32, the whole global batch: what every data-parallel layout must reproduce."""
    model = PrecisionNet()
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def full_grads(model: nn.Module, factor: float) -> dict[str, torch.Tensor]:
    """The sharded gradients gathered whole (a collective), divided by what AVG really did (avg_factor)."""
    return {n: p.grad.full_tensor() / factor for n, p in model.named_parameters()}


def policy(param=None, reduce=None, output=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=output)


def watch(model: PrecisionNet, seen: dict) -> None:
    """Hooks that note the dtypes inside block 0 and at the head as the forward passes (a hook that returned
    something would replace the module's input or output: these return None)."""

    def note(key: str, tensor: torch.Tensor) -> None:
        seen.setdefault(key, _name(tensor.dtype))

    block = model.blocks[0]
    block.ln.register_forward_pre_hook(lambda m, a: note("LayerNorm input", a[0]))
    block.ln.register_forward_hook(lambda m, a, o: note("LayerNorm output", o))
    block.fc1.register_forward_pre_hook(lambda m, a: note("fc1 weight in forward", m.weight))
    block.fc1.register_forward_hook(lambda m, a, o: note("fc1 output", o))
    model.head.register_forward_pre_hook(lambda m, a: note("head input (last block's output)", a[0]))


def dtypes_and_saved(pair, prank: int) -> dict:
    """Item 2: each tensor's dtype, and the bytes saved for backward, FSDP2 bf16 policy against autocast."""
    x, y = (mine(t, prank) for t in batch(2))
    fsdp, auto = {}, {}
    model = shard_blocks(PrecisionNet(), pair, policy(BF16, FP32), policy(BF16, FP32, FP32))
    watch(model, fsdp)
    with saved_tensor_bytes(weight_shapes(model)) as saved_fsdp:
        out = model(x)
    fsdp["model output"] = _name(out.dtype)
    with recorded_reduce_scatters() as calls:
        F.cross_entropy(out, y).backward()
    fsdp["gradient reduce-scatter buffer"] = calls[0]["dtype"]
    w = model.blocks[0].fc1.weight
    fsdp["parameter the optimizer updates"] = (
        f"{_name(w.to_local().dtype)} ({type(w).__name__} shard {w.to_local().numel()}/{w.numel()})"
    )
    fsdp["gradient the optimizer reads"] = f"{_name(w.grad.to_local().dtype)} ({type(w.grad).__name__} shard)"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    fsdp["AdamW exp_avg"] = _name(opt.state[w]["exp_avg"].to_local().dtype)

    plain = PrecisionNet()
    watch(plain, auto)
    with saved_tensor_bytes(weight_shapes(plain)) as saved_auto, torch.autocast("cpu", dtype=BF16):
        out = plain(x)
    auto["model output"] = _name(out.dtype)
    F.cross_entropy(out, y).backward()
    w = plain.blocks[0].fc1.weight
    auto["gradient reduce-scatter buffer"] = "none (one process)"
    auto["parameter the optimizer updates"] = f"{_name(w.dtype)} (whole)"
    auto["gradient the optimizer reads"] = f"{_name(w.grad.dtype)} (whole)"
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    opt.step()
    auto["AdamW exp_avg"] = _name(opt.state[w]["exp_avg"].dtype)
    fp32 = PrecisionNet()
    with saved_tensor_bytes(weight_shapes(fp32)) as saved_fp32:
        fp32(x)
    rows = [{"tensor": k, "fsdp2": v, "autocast": auto[k]} for k, v in fsdp.items()]
    saved = [
        {"mode": "fp32, one process", "bytes": saved_fp32},
        {"mode": "autocast bf16, one process", "bytes": saved_auto},
        {"mode": "FSDP2 bf16 policy, per rank", "bytes": saved_fsdp},
    ]
    return {"dtypes": {"rows": rows}, "saved": {"rows": saved, "batch": B}}


def reduce_dtype_none(pair, prank: int, factor: float) -> dict:
    """Trap 1: reduce_dtype=None next to fp32, with param_dtype=bf16: the reduce-scatter buffers' dtype and
    bytes, and the gradient's distance from one fp32 process; and what the installed docstring says."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    x, y = batch(2)
    ref = reference_grads(x, y)
    runs = {}
    for name, reduce in (("float32", FP32), ("None", None)):
        model = shard_blocks(PrecisionNet(), pair, policy(BF16, reduce))
        with recorded_reduce_scatters() as calls:
            F.cross_entropy(model(mine(x, prank)), mine(y, prank)).backward()
        runs[name] = {
            "dtype": "/".join(sorted({c["dtype"] for c in calls})),
            "bytes": sum(c["bytes"] for c in calls),
            "grad_rel_diff": max_rel_diff(full_grads(model, factor), ref),
        }
    doc = " ".join((MixedPrecisionPolicy.__doc__ or "").split())
    start = doc.find("reduce_dtype (")
    return {"runs": runs, "docstring": doc[start : doc.find("output_dtype (", start)].strip()}


def frozen_weights(pair, prank: int, steps: int = 10, lr: float = 1e-5) -> dict:
    """Trap 2: a model cast to bf16 before fully_shard has bf16 shards, so AdamW's small updates round away;
    fp32 shards with a bf16 policy keep them. The fraction of block 0's fc1 weights that never moved."""
    x, y = (mine(t, prank) for t in batch(2))
    runs = {}
    for name in ("bf16 model, then fully_shard", "fp32 model, bf16 policy"):
        if name.startswith("bf16"):
            model, inputs = shard_blocks(PrecisionNet().to(BF16), pair), x.to(BF16)
        else:
            model, inputs = shard_blocks(PrecisionNet(), pair, policy(BF16, FP32)), x
        w = model.blocks[0].fc1.weight
        before = w.full_tensor().clone()
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        for _ in range(steps):
            F.cross_entropy(model(inputs).float(), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        after = w.full_tensor()
        runs[name] = {"unchanged": (after == before).float().mean().item(), "shard_dtype": _name(w.to_local().dtype)}
    return {"runs": runs, "steps": steps, "lr": lr}


def fp16_scaler(pair, prank: int, rank: int) -> dict:
    """Trap 4: fp16 with the plain torch.amp.GradScaler("cpu"); one inf written into one element of pair-rank
    1's gradient shard. The gradients are DTensors, and DTensor dispatch all-reduces found_inf
    (pytorch#132816), so every rank of the mesh skips the step and halves the scale."""
    x, y = (mine(t, prank) for t in batch(2))
    model = shard_blocks(PrecisionNet(), pair, policy(FP16, FP32), policy(FP16, FP32, FP32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    if prank == 1:
        with torch.no_grad():
            model.blocks[0].fc1.weight.grad.to_local().view(-1)[0] = float("inf")
    before = [p.to_local().clone() for p in model.parameters()]
    scale_before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
    mine_ = {"rank": rank, "inf_written": prank == 1, "unchanged": unchanged}
    return {"this_rank": mine_ | {"scale_before": scale_before, "scale_after": scaler.get_scale()}}


def output_dtype_trap(pair, prank: int) -> dict:
    """Trap 3: output_dtype=fp32 on every block feeds an fp32 tensor to the root's bf16 head (cast_forward_inputs
    casts only a unit's own inputs); on the root only, it casts the model's output. The error text, or the dtype."""
    x = mine(batch(2)[0], prank)
    out = {}
    for name, blocks, root in (
        ("on every block", policy(BF16, FP32, FP32), policy(BF16, FP32)),
        ("on the root only", policy(BF16, FP32), policy(BF16, FP32, FP32)),
    ):
        model = shard_blocks(PrecisionNet(), pair, blocks, root)
        try:
            out[name] = {"error": None, "output": _name(model(x).dtype)}
        except RuntimeError as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}", "output": None}
    return out


def gradients(mesh, n: int, rank: int, factor: float, layout: str) -> dict:
    """Correctness: FSDP2 (fp32) gradients on `mesh` against one process on the global batch."""
    x, y = batch(n)
    ref = reference_grads(x, y)
    model = shard_blocks(PrecisionNet(), mesh)
    F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
    return {
        "layout": layout,
        "ranks": n,
        "factor": factor,
        "what": f"grads, {model.head.weight.grad.placements}".replace("Shard(dim=0)", "Shard(0)"),
        "rel_diff": max_rel_diff(full_grads(model, factor), ref),
        "raw_rel_diff": max_rel_diff(full_grads(model, 1.0), ref),
    }


def layer_outputs(block: nn.Module, x: torch.Tensor) -> tuple[int, list[int], torch.Tensor]:
    """Bytes of the outputs of ln, fc1, act and fc2 this rank holds (a DTensor's local part), fc1's output shape,
    and the block's output."""
    found, shapes = [], {}

    def hook(m, a, o):
        o = o.to_local() if hasattr(o, "to_local") else o
        found.append(o.numel() * o.element_size())
        shapes.setdefault(m, list(o.shape))

    handles = [m.register_forward_hook(hook) for m in (block.ln, block.fc1, block.act, block.fc2)]
    with torch.no_grad():
        out = block(x)
    for h in handles:
        h.remove()
    return sum(found), shapes[block.fc1], out


def tensor_parallel(pair, prank: int) -> dict:
    """TP: fc1 ColwiseParallel, fc2 RowwiseParallel on one block, against one process (both ranks see the same
    micro-batch); and the bytes per rank of parameters and activations: one process, FSDP2, TP."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    x = mine(batch(2)[0], 0)  # TP: the same micro-batch on both ranks of the pair
    rows = []

    def local_bytes(m: nn.Module) -> int:
        return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in m.parameters())

    outs = {}
    for layout, inputs in (("one process", x), ("FSDP2, 2 ranks", mine(batch(2)[0], prank)), ("TP, 2 ranks", x)):
        torch.manual_seed(0)  # the same block each time; FSDP: each rank its own micro-batch, TP: a shared one
        block = Block(D, H)
        if layout.startswith("FSDP2"):
            fully_shard(block, mesh=pair)
        elif layout.startswith("TP"):
            parallelize_module(block, pair, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        held = local_bytes(block)  # before the forward: a root FSDP unit stays gathered after it
        act, shape, outs[layout] = layer_outputs(block, inputs)
        rows.append({"layout": layout, "param_bytes": held, "activation_bytes": act, "fc1_out": shape})
    out, ref = outs["TP, 2 ranks"], outs["one process"]
    row = {"layout": "TP (Colwise fc1, Rowwise fc2)", "ranks": 2, "factor": 1.0, "what": "output (one block)"}
    return {"rows": rows, "correctness": row | {"rel_diff": max_rel_diff({"out": out}, {"out": ref})}}


def experiments(out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    meshes = []
    try:
        world = init_device_mesh("cpu", (dist.get_world_size(),))
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        pair, replicate = mesh2d["shard"], mesh2d["replicate"]
        meshes = [world, mesh2d, pair, replicate]
        prank = pair.get_local_rank()
        f_world, f_pair = avg_factor(world.get_group()), avg_factor(pair.get_group())
        f_rep = avg_factor(replicate.get_group())
        result = {"torch": torch.__version__, "avg_factor": {"world of 4": f_world, "pair": f_pair}}
        result |= dtypes_and_saved(pair, prank)
        result["reduce_dtype"] = reduce_dtype_none(pair, prank, f_pair["reduce_scatter"])
        result["frozen"] = frozen_weights(pair, prank)
        result["fp16_scaler"] = fp16_scaler(pair, prank, rank)
        rows = [
            gradients(pair, 2, prank, f_pair["reduce_scatter"], "FSDP2 fp32"),
            gradients(world, 4, rank, f_world["reduce_scatter"], "FSDP2 fp32"),
            gradients(mesh2d, 4, rank, f_pair["reduce_scatter"] * f_rep["all_reduce"], "HSDP 2x2"),
        ]
        tp = tensor_parallel(pair, prank)
        result["correctness"] = {"rows": rows + [tp["correctness"]]}
        result["tp_vs_fsdp"] = {"rows": tp["rows"], "batch": B}
        result["output_dtype"] = output_dtype_trap(pair, prank)  # last: it leaves a failed forward behind
        (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
        print(f"[rank {rank}] done", flush=True)
    finally:
        for mesh in meshes:  # every mesh, sub-meshes too: their groups must not outlive the process group
            getattr(mesh, "_pg_registry", {}).clear()
        dist.destroy_process_group()


def main() -> None:
    """Run the experiments, then make sure no process-group thread is left to abort the interpreter's exit."""
    experiments(Path(sys.argv[1]))
    gc.collect()  # FSDP's modules sit in reference cycles that hold the destroyed groups
    threads = [(t / "comm").read_text().strip() for t in Path("/proc/self/task").glob("*") if (t / "comm").exists()]
    if any(n.startswith(("gloo", "pt_gloo", "pt_tcpstore")) for n in threads):
        sys.stdout.flush()  # every output is written: leave without an interpreter shutdown beside those threads
        os._exit(0)


if __name__ == "__main__":
    main()
