"""Chapter 12: N ranks you do not have, predicted in one process; and the real runs they are checked against.

    real = measure_real()                                  # one torchrun launch: N = 1, 2, 4, every config
    fake = predict_fake([2, 4, 8], model="block")          # one process, a fake process group
    gpt = predict_fake([8, 64, 1024], model="gpt2")        # GPT-2 small, no memory allocated
    print(format_memory_rows(real + fake))

A fake process group (`dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=N)`)
answers every collective at once without sending anything, so one process can play rank r of any
N; under `FakeTensorMode` tensors have shapes and dtypes but no memory, so GPT-2 small costs
nothing. FSDPMemTracker, which counts storages and never reads values, then sees the same
buffers as in a real run: torchtitan's scripts/estimate/estimation.py does this for LLaMA.

A process group must not live in the notebook's kernel (it would outlive the cell, and a second
one cannot be made with another N), so `predict_fake` runs this module as a subprocess: each N
gets its group, which is destroyed before the next. `measure_real` runs the gloo processes through
chapter 08's `launch` (course_lib.chapters.ch12.memory_worker).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.chapters.ch08.ddp_launch import RUNS, launch
from course_lib.chapters.ch12.memory_worker import CONFIGS, REAL_CONFIGS, shard_model, tracked_step
from course_lib.chapters.ch12.shard_memory import BLOCK_UNITS, OPTIMIZERS, BlockMLP, predict_rank_bytes
from course_lib.models import GPT, GPTConfig
from course_lib.tables import table

__all__ = ["GPT2_UNITS", "model_on_meta", "measure_real", "predict_fake", "with_predictions", "format_memory_rows"]

GPT2_UNITS = tuple(f"blocks.{i}" for i in range(GPTConfig().n_layer))  # GPT-2 small: each block a unit
OUT = RUNS.parent / "12_sharding"  # runs/12_sharding/ (git-ignored): measure_real's launches, removed after
_MODELS = ("block", "odd", "gpt2")


def _build(model: str) -> tuple[nn.Module, tuple[str, ...]]:
    if model == "block":
        return BlockMLP(), BLOCK_UNITS
    if model == "odd":  # odd sizes, so that shards are padded, some ranks hold padding only; blocks.0 is the root's
        return BlockMLP(width=37, hidden=101, depth=2, classes=3), ("blocks.1",)
    return GPT(GPTConfig()), GPT2_UNITS  # GPT-2 small: 12 layers, 12 heads, 768 wide, vocab 50,304, 1,024 tokens


def _gpt_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y)[1]


def _optimizer(name: str, net: nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(net.parameters(), lr=1e-3)
    return torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9 if name == "sgd_momentum" else 0.0)


def _fake_run(world: int, rank: int, model: str, config: str, batch: int, seq: int, optimizer: str = "adamw") -> dict:
    """Rank `rank` of `world` on a fake process group, every tensor fake: one tracked step."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        net, units = model_on_meta(model)  # sharded as shapes only: cheap even for N = 1,024 pieces a tensor
        net = shard_model(net, mesh, config, units)
        with FakeTensorMode(allow_non_fake_inputs=True):  # to_empty reads the meta shards
            net.to_empty(device="cpu")  # FSDP2's meta-device start: the shards become (fake) CPU tensors
            opt = _optimizer(optimizer, net)
            if model != "gpt2":  # the real run's shapes: `batch` rows a rank, each input its own storage
                x, y = torch.randn(batch, net.width), torch.randint(0, net.head.out_features, (batch,))
                result = tracked_step(net, opt, x, y)
            else:
                x, y = torch.randint(0, 50257, (batch, seq)), torch.randint(0, 50257, (batch, seq))
                result = tracked_step(net, opt, x, y, _gpt_loss)
        getattr(mesh, "_pg_registry", {}).clear()  # DTensor's caches hold the mesh, the mesh its groups
    finally:
        dist.destroy_process_group()
    row = {"world": world, "rank": rank, "config": config, "model": model, "optimizer": optimizer, "batch": batch}
    return {**row, "source": "fake", **result}


def predict_fake(
    worlds: Sequence[int],
    model: str = "block",
    configs: Sequence[str] = ("fp32", "bf16"),
    *,
    rank: int = 0,
    batch: int = 64,
    seq: int = 1024,
    optimizers: Sequence[str] = ("adamw",),
    timeout: float = 120.0,
    progress: bool = False,
) -> list[dict]:
    """Chapter 12: rank `rank`'s tracked step for each N in `worlds` and each configuration (CONFIGS),
    on a fake process group in a subprocess. `model`: "block" (BlockMLP, `batch` rows a rank), "odd"
    (a small BlockMLP of odd sizes: padded shards) or "gpt2" (GPT-2 small, `batch` sequences of `seq`
    tokens a rank). `rank` beyond N - 1 plays the last rank. `optimizers`: of "adamw", "sgd",
    "sgd_momentum". Rows as `measure_real`'s, with "source": "fake", "optimizer" and "seconds" (the
    wall time of each row's two steps). progress=True prints a line as each row is done."""
    if model not in _MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {_MODELS}")
    unknown = [o for o in optimizers if o not in OPTIMIZERS] + [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown {unknown}: optimizers are {OPTIMIZERS}, configurations {list(CONFIGS)}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fake.json"
        cmd = [sys.executable, "-m", __name__, "--worlds", ",".join(map(str, worlds)), "--model", model]
        cmd += ["--configs", ",".join(configs), "--rank", str(rank), "--batch", str(batch), "--seq", str(seq)]
        cmd += ["--optimizers", ",".join(optimizers)]
        cmd += ["--json", str(path)] + (["--progress"] if progress else [])
        errors = open(Path(tmp) / "stderr.txt", "w+")  # a file: a pipe could fill while stdout is read
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True)
        watchdog = threading.Timer(timeout, proc.kill)  # a process that hangs is stopped, however quiet it is
        watchdog.start()
        try:
            for line in proc.stdout:  # its progress lines, printed here (a notebook shows only this process's)
                if progress:
                    print(line, end="", flush=True)
            proc.wait()
        finally:
            watchdog.cancel()
            proc.kill()  # nothing if it ended; on Ctrl-C, it stops with the cell
            errors.seek(0)
            error = errors.read()
            errors.close()
        if proc.returncode != 0:
            raise RuntimeError(f"the fake-world process failed ({proc.returncode}): {error.strip()[-600:]}")
        return json.loads(path.read_text())


def measure_real(
    batch: int = 64,
    nproc: int = 4,
    configs: Sequence[str] = REAL_CONFIGS,
    *,
    timeout: float = 150.0,
    progress: bool = False,
) -> list[dict]:
    """Chapter 12: one torchrun launch of `nproc` gloo processes measuring N = 1, 2 and `nproc`, every
    configuration: a row per (N, rank, configuration) with "measured" (predict_rank_bytes' five
    keys, by FSDPMemTracker), "peak", its "moment", "at_peak" (the tracker's categories then) and
    "most" (each category's largest total). `batch` rows a rank: activations do not shrink with N.
    progress=True prints rank 0's newest line about once a second (chapter 08's `launch`)."""
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="memory-", dir=OUT) as out:  # a folder per call: runs may overlap
        run = launch(
            ["--batch", batch, "--configs", ",".join(configs)],
            nproc=nproc,
            module="course_lib.chapters.ch12.memory_worker",
            timeout=timeout,
            out=Path(out),
            progress=progress,
        )
        rows = [row for r in range(nproc) for row in json.loads((run.out / f"memory_rank{r}.json").read_text())]
    return [{**row, "model": "block", "source": "real", "seconds": run.seconds} for row in rows]


def with_predictions(rows: Sequence[dict]) -> list[dict]:
    """Chapter 12: `rows` with "predicted": predict_rank_bytes for each row's model, N, rank and config."""
    out = []
    for row in rows:
        net, units = model_on_meta(row.get("model", "block"))
        param_dtype, reduce_dtype, _ = CONFIGS[row["config"]]
        predicted = predict_rank_bytes(
            net,
            row["world"],
            row["rank"],
            units=units,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            optimizer=row.get("optimizer", "adamw"),
        )
        out.append({**row, "predicted": predicted})
    return out


def model_on_meta(model: str = "block") -> tuple[nn.Module, tuple[str, ...]]:
    """Chapter 12: ("block": BlockMLP, "gpt2": GPT-2 small) on the meta device, with its FSDP units: the
    shapes `predict_rank_bytes` needs, GPT-2 small's 124M parameters in no memory."""
    if model not in _MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {_MODELS}")
    with torch.device("meta"):
        return _build(model)


def format_memory_rows(rows: Sequence[dict]) -> str:
    """Chapter 12: rows of `measure_real`/`predict_fake` as a table, in MB (10^6 bytes), at most 100
    characters wide: N, rank, configuration, the state (sharded parameters, optimizer, gradients),
    the largest all-gather (AG) and reduce-scatter (RS) buffer, whether `with_predictions`' bytes
    equal the measured ones ("pred": True/False, where added), the peak and its moment."""

    def mb(key: str):
        return lambda r: r["measured"][key] / 1e6

    columns = [
        ("N", "world", "d"),
        ("rank", "rank", "d"),
        ("config", "config", "<"),
        ("params", mb("sharded_params"), ".2f"),
        ("optim", mb("optimizer_state"), ".2f"),
        ("grads", mb("gradients"), ".2f"),
        ("AG", mb("all_gather"), ".2f"),
        ("RS", mb("reduce_scatter"), ".2f"),
        ("peak", lambda r: r["peak"] / 1e6, ".2f"),
        ("peak's moment", "moment", "<"),
    ]
    if rows and "predicted" in rows[0]:
        columns.insert(8, ("pred", lambda r: r["predicted"] == r["measured"], ""))
    return table(rows, columns)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m course_lib.chapters.ch12.fake_world", description=__doc__.split("\n")[0]
    )
    p.add_argument("--worlds", default="2,4,8", help="comma-separated N")
    p.add_argument("--model", choices=_MODELS, default="block")
    p.add_argument("--configs", default="fp32,bf16")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--optimizers", default="adamw", help=f"comma-separated, of {OPTIMIZERS}")
    p.add_argument("--json", type=Path, help="write the rows here (else print a table)")
    p.add_argument("--progress", action="store_true", help="print a line as each row is done")
    args = p.parse_args(argv)
    import time

    rows = []
    for world in map(int, args.worlds.split(",")):
        for optimizer in args.optimizers.split(","):
            for config in args.configs.split(","):
                t0 = time.perf_counter()
                rank = min(args.rank, world - 1)
                row = _fake_run(world, rank, args.model, config, args.batch, args.seq, optimizer)
                rows.append({**row, "seconds": time.perf_counter() - t0})
                if args.progress:
                    seconds = rows[-1]["seconds"]
                    print(f"   N={world:,} {config} {optimizer}: peak {row['peak']:,} B ({seconds:.1f} s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows))
    else:
        print(format_memory_rows(with_predictions(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
