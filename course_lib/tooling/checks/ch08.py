"""Checks for exercise 08 (DDP). The learner's `ddp_train` runs for real, under torchrun in two gloo
processes: the probe (course_lib/tooling/probes/ch08.py) launches it and returns, per rank and run,
what it trained and what the run did. `judge`, in the grader's process, inspects the run (a process
group of two around every forward, the model wrapped in DistributedDataParallel, its gradients
all-reduced, the forward computed in the run's autocast dtype, the optimizer steps that ran, the
GradScaler's skip and back-off at the overflow the harness causes in fp16, the samples each rank
asked for), then trains the same model in one process on the equivalent large batch and compares
the parameters (see course_lib.tooling.checkbase)."""

from __future__ import annotations

import math
import random

from ..checkbase import Check, CheckFailure, expect_dict, expect_list, expect_number, register
from ..probes.ch08 import WORLD

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

# How far a rank's parameters may be from the single-process reference, as a fraction of how far
# training moved them. fp32: only summation order differs (measured: below 1e-6). bf16 and fp16: every
# rank rounds its own weight gradient, the large batch rounds one (measured: bf16 up to about 0.1;
# fp16, with its 3 more bits, below 0.001 over 100 draws emulated in one process).
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.3, "float16": 0.02}
KEYS = ("params", "destroyed", "seen", "forwards", "allreduces", "steps", "scales", "injected")
AUTOCAST = (
    "run the forward and the loss under torch.autocast('cpu', dtype=amp_dtype, "
    "enabled=amp_dtype != torch.float32), as train_single does"
)


def _model(run: dict):
    import torch
    import torch.nn as nn

    model = nn.Sequential(nn.Linear(run["d"], run["h"]), nn.ReLU(), nn.Linear(run["h"], run["k"]))
    model.load_state_dict({k: torch.tensor(v) for k, v in run["init"].items()})
    return model


def _orders(run: dict, set_epoch: bool) -> list[list[int]]:
    """The samples each rank's DataLoader reads over all epochs, in order (DistributedSampler's)."""
    from course_lib.chapters.ch08.distributed import sampler_orders

    per_epoch = sampler_orders(run["n"], WORLD, run["epochs"], run["seed"], set_epoch)
    return [[i for order in rank for i in order] for rank in per_epoch]


def _global_steps(run: dict) -> list[list[int]]:
    """The samples of every optimizer step, all ranks together: each rank's next batch_size samples."""
    from course_lib.chapters.ch08.distributed import sampler_orders

    orders, b = sampler_orders(run["n"], WORLD, run["epochs"], run["seed"]), run["batch_size"]
    return [
        [i for rank in orders for i in rank[epoch][start : start + b]]
        for epoch in range(run["epochs"])
        for start in range(0, len(orders[0][epoch]), b)
    ]


def steps_of(run: dict) -> int:
    """Optimizer steps of one run: each rank's share of an epoch in batches of batch_size, every epoch."""
    return len(_global_steps(run))


def reference(run: dict):
    """What the DDP run should train, in one process: one SGD (momentum) step per global batch under CPU
    autocast in the run's dtype; in a run where the harness made the first gradient overflow, that
    step is skipped, as a GradScaler skips it (course_lib.chapters.ch08.distributed.reference_train, and
    the skip)."""
    import torch
    import torch.nn.functional as F

    model = _model(run)
    x, y = torch.tensor(run["x"]), torch.tensor(run["y"])
    dtype = getattr(torch, run["dtype"])
    opt = torch.optim.SGD(model.parameters(), lr=run["lr"], momentum=0.9)
    for i, idx in enumerate(_global_steps(run)):
        if i == 0 and run.get("overflow"):
            continue
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
    return model


def _shaped(ranks: object, runs: list) -> list[list[dict]]:
    """The results as [rank][run] dicts with every key the harness writes, or CheckFailure saying what came."""
    expect_list(ranks, f"the results of {WORLD} ranks", WORLD)
    for r, per_run in enumerate(ranks):
        expect_list(per_run, f"rank {r}'s results, one per run", len(runs))
        for i, got in enumerate(per_run):
            where = f"rank {r}, run {i + 1}"
            expect_dict(got, where, KEYS)
            expect_dict(got["params"], f"{where}: the parameters", ())
            expect_list(got["seen"], f"{where}: the samples read")
            expect_list(got["forwards"], f"{where}: the forwards")
            for f in got["forwards"]:
                expect_dict(f, f"{where}: a forward", ("world", "ddp", "autocast", "dtype", "params"))
            expect_list(got["scales"], f"{where}: the GradScaler's scales")
            for pair in got["scales"]:
                expect_list(pair, f"{where}: a GradScaler update (scale before, after)", 2)
            for key in ("allreduces", "steps"):
                expect_number(got[key], f"{where}: {key}", integer=True)
    return ranks


@register
class DDPTrain(Check):
    name, args, points = "08.ddp_train", ("ddp_train",), 4
    hint = (
        "In ddp_train: dist.init_process_group('gloo', rank=rank, world_size=world_size); wrap the model in "
        "DDP and run every forward through the wrapper; DistributedSampler(dataset, num_replicas=world_size, "
        "rank=rank, shuffle=True, seed=seed) as the DataLoader's sampler with batch_size; "
        "sampler.set_epoch(epoch) at the start of every epoch; the same autocast + GradScaler step as "
        "train_single (the fp16 run overflows once: the scaler must skip that step); "
        "dist.destroy_process_group() in a finally: block."
    )
    time_limit = 200.0

    def cases(self, rng: random.Random) -> list:
        runs = []
        for dtype in ("float32", "bfloat16", "float16"):
            d, h, k, n = 6, rng.choice([8, 12, 16]), rng.choice([3, 4, 5]), rng.choice([40, 48, 56])
            scale = (1 / d) ** 0.5, (1 / h) ** 0.5
            init = {
                "0.weight": [[rng.uniform(-scale[0], scale[0]) for _ in range(d)] for _ in range(h)],
                "0.bias": [rng.uniform(-scale[0], scale[0]) for _ in range(h)],
                "2.weight": [[rng.uniform(-scale[1], scale[1]) for _ in range(h)] for _ in range(k)],
                "2.bias": [rng.uniform(-scale[1], scale[1]) for _ in range(k)],
            }
            # fp16: inputs of half the spread, so that no gradient overflows by itself at the scale the
            # GradScaler backs off to, 2**15 (measured over 300 draws: the largest scaled gradient of a
            # rank stayed below 29,000, under half of fp16's largest number, 65,504)
            spread = 0.5 if dtype == "float16" else 1.0
            x = [
                [round(max(-3 * spread, min(3 * spread, rng.gauss(0, spread))), 4) for _ in range(d)] for _ in range(n)
            ]
            runs.append(
                {
                    "dtype": dtype,
                    "d": d,
                    "h": h,
                    "k": k,
                    "n": n,
                    "init": init,
                    "x": x,
                    "y": [rng.randrange(k) for _ in range(n)],
                    "epochs": 2,
                    "batch_size": rng.choice([4, 6, 8]),
                    "lr": round(rng.uniform(0.05, 0.15), 3),
                    "seed": rng.randrange(10_000),
                    "overflow": dtype == "float16",
                }
            )
        return [{"runs": runs}]

    def describe(self, case: dict) -> str:
        return "ddp_train under torchrun (2 gloo processes)"

    def judge(self, cases: list, results: list) -> None:
        expect_list(results, "the results", len(cases))
        runs = cases[0]["runs"]
        ranks = _shaped(results[0], runs)
        for i, run in enumerate(runs):
            what = (
                f"run {i + 1} ({run['dtype']}, {run['n']} samples, batch_size={run['batch_size']} per rank, "
                f"{run['epochs']} epochs)"
            )
            got = [ranks[r][i] for r in range(WORLD)]
            for r in range(WORLD):
                self._process_group(what, r, got[r])
            self._samples(what, run, got)
            for r in range(WORLD):
                self._steps(what, run, r, got[r])
            self._parameters(what, run, got)
            if not all(g["destroyed"] is True for g in got):
                raise CheckFailure(
                    f"{what}: the process group was still initialized when ddp_train returned: "
                    "call dist.destroy_process_group() (in a finally: block)"
                )

    @staticmethod
    def _process_group(what: str, r: int, got: dict) -> None:
        """Every forward of the model ran in a process group of WORLD, through a DDP wrapper, in the run's dtype."""
        forwards = got["forwards"]
        if not forwards:
            raise CheckFailure(f"{what}: rank {r} never ran the model it was given: train it (through DDP)")
        alone = [f for f in forwards if f["world"] != WORLD]
        if alone:
            raise CheckFailure(
                f"{what}: rank {r} ran {len(alone)} of its {len(forwards)} forwards without a process "
                f"group of {WORLD} (dist.is_initialized() was False, or the group had "
                f"{alone[0]['world']} processes): call dist.init_process_group('gloo', rank=rank, "
                "world_size=world_size) first; training each rank alone is not DDP"
            )
        outside = [f for f in forwards if f["ddp"] is not True]
        if outside:
            raise CheckFailure(
                f"{what}: rank {r} ran {len(outside)} of its {len(forwards)} forwards of the model "
                "outside DistributedDataParallel, so nothing all-reduced their gradients: wrap the "
                "model, ddp_model = DDP(model), and train ddp_model"
            )

    @staticmethod
    def _dtypes(what: str, run: dict, r: int, got: dict) -> None:
        for f in got["forwards"]:
            if f["params"] != ["float32"]:
                raise CheckFailure(
                    f"{what}: on rank {r} the model's parameters were {f['params']} during a forward; "
                    "autocast keeps them in float32 (do not convert the model): " + AUTOCAST
                )
            if f["dtype"] != run["dtype"] or (run["dtype"] != "float32" and f["autocast"] is not True):
                state = "under autocast" if f["autocast"] else "without autocast"
                raise CheckFailure(
                    f"{what}: on rank {r} the model's forward computed in {f['dtype']} {state}, "
                    f"expected {run['dtype']}: {AUTOCAST}"
                )

    def _samples(self, what: str, run: dict, got: list[dict]) -> None:
        """Which samples each rank's DataLoader asked for: never skipped, an empty log fails."""
        seen = [[int(expect_number(i, f"{what}: a sample index", integer=True)) for i in g["seen"]] for g in got]
        for r in range(WORLD):
            if not seen[r]:
                raise CheckFailure(
                    f"{what}: rank {r} read no samples from the dataset it was given: iterate over "
                    "DataLoader(dataset, batch_size=batch_size, sampler=sampler)"
                )
        if seen[0] == seen[1]:
            raise CheckFailure(
                f"{what}: both ranks read the same samples in the same order, so the two "
                "processes did the same work: give the DataLoader a DistributedSampler"
            )
        right, repeated = _orders(run, True), _orders(run, False)
        for r in range(WORLD):
            if seen[r] == repeated[r] != right[r]:
                raise CheckFailure(
                    f"{what}: rank {r} read every epoch in the same order: call "
                    "sampler.set_epoch(epoch) at the start of each epoch"
                )
            if seen[r] != right[r]:
                raise CheckFailure(
                    f"{what}: rank {r} read samples {seen[r][:6]}..., expected "
                    f"{right[r][:6]}... (DistributedSampler(dataset, num_replicas=world_size, "
                    "rank=rank, shuffle=True, seed=seed) and batch_size per rank)"
                )

    def _steps(self, what: str, run: dict, r: int, got: dict) -> None:
        """Forwards in the run's dtype, all-reduces, optimizer steps, and in fp16 the scaler's skip and back-off."""
        self._dtypes(what, run, r, got)
        steps = steps_of(run)
        if got["allreduces"] < steps:
            raise CheckFailure(
                f"{what}: DDP all-reduced gradients {got['allreduces']} times on rank {r} over {steps} "
                "steps: call backward on the loss of ddp_model's output"
            )
        overflow = bool(run.get("overflow"))
        if overflow and got["injected"] is not True and r == 0:
            raise CheckFailure(f"{what}: rank 0 computed no gradient of the model it was given")
        want = steps - overflow
        if got["steps"] != want:
            why = (
                "the first step's gradients overflowed (the check made them inf on rank 0, and DDP's all-reduce "
                "carried that to every rank): a GradScaler, scaler = torch.amp.GradScaler('cpu', "
                "enabled=amp_dtype == torch.float16), with scaler.step(optimizer) and scaler.update(), skips "
                "that step"
                if overflow
                else "one optimizer step per batch of batch_size samples per rank, from DataLoader(dataset, "
                "batch_size=batch_size, sampler=sampler)"
            )
            raise CheckFailure(
                f"{what}: optimizer.step() ran {got['steps']} times on rank {r}, expected {want} of {steps}: {why}"
            )
        if overflow:
            scales = [[expect_number(v, f"{what}: a scale", finite=False) for v in pair] for pair in got["scales"]]
            if not scales or not scales[0][1] < scales[0][0]:
                first = f"it went {scales[0][0]:g} -> {scales[0][1]:g}" if scales else "it was never updated"
                raise CheckFailure(
                    f"{what}: rank {r}'s GradScaler did not back off at the overflowing first step "
                    f"({first}): call scaler.update() after every scaler.step(optimizer)"
                )

    def _parameters(self, what: str, run: dict, got: list[dict]) -> None:
        import torch

        model = _model(run)
        init = {k: v.detach() for k, v in model.state_dict().items()}
        params = []
        for r, g in enumerate(got):
            if set(g["params"]) != set(init):
                raise CheckFailure(
                    f"{what}: the returned model has parameters {sorted(g['params'])}, expected the "
                    f"model passed in, {sorted(init)}"
                )
            p = {}
            for k in init:
                values = g["params"][k]
                try:
                    p[k] = torch.tensor(values, dtype=torch.float32)
                except (TypeError, ValueError, RuntimeError):
                    raise CheckFailure(f"{what}: rank {r}'s parameter {k} is not a list of numbers") from None
                if p[k].shape != init[k].shape:
                    raise CheckFailure(
                        f"{what}: rank {r}'s parameter {k} has shape {list(p[k].shape)}, expected {list(init[k].shape)}"
                    )
                if not torch.isfinite(p[k]).all():
                    raise CheckFailure(f"{what}: rank {r}'s parameter {k} holds inf or nan after training")
            params.append(p)
        apart = max((params[0][k] - params[1][k]).abs().max().item() for k in init)
        if apart > 1e-6:
            raise CheckFailure(
                f"{what}: ranks 0 and 1 ended with different parameters (max difference "
                f"{apart:.3g}): their gradients were not averaged; wrap the model in DDP"
            )
        want = reference(run).state_dict()
        moved = max((want[k] - init[k]).abs().max().item() for k in init)
        off = max((params[0][k] - want[k]).abs().max().item() for k in init) / max(moved, 1e-12)
        if not math.isfinite(off) or off > TOLERANCE[run["dtype"]]:
            raise CheckFailure(
                f"{what}: the parameters differ from one process training on the equivalent "
                f"batch of {WORLD * run['batch_size']} by {off:.3g} of how far training moved them "
                f"(allowed: {TOLERANCE[run['dtype']]:g})"
            )
