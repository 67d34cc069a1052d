"""Checks for exercise 08 (DDP). The learner's `ddp_train` runs for real: `run` writes its source
to a file, starts two gloo processes under torchrun (`sys.executable -m torch.distributed.run`, on
loopback: inside the grader's sandbox too) and returns what each rank trained. `judge`, in the
grader's process, trains the same model in one process on the equivalent large batch
(course_lib.chapters.distributed.reference_train) and compares (see course_lib.tooling.grading)."""
from __future__ import annotations

import inspect
import json
import random
import shutil
import tempfile
import textwrap
from pathlib import Path

from ..grading import STUB, Check, CheckFailure, register

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

WORLD = 2
# How far a rank's parameters may be from the single-process reference, as a fraction of how far
# training moved them. fp32: only summation order differs (measured: below 1e-6). bf16: every rank
# rounds its own weight gradient to bf16, the large batch rounds one (measured: up to about 0.1).
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.3}
LAUNCH_TIMEOUT = 150.0  # starting torch in three processes alone takes 10-30 s on a busy 2-core machine
STUB_MESSAGE = "Exercise: write your solution here"

# What the learner's function may use without importing it: the exercise notebook's import cell.
HEADER = """import os
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

"""

# What each of the two ranks runs: for every run of the case, build the model and the data, call
# the learner's ddp_train, and write back what it trained and in which order its DataLoader read
# the samples (so that the judge can say what went wrong, not only that it did). One launch for
# all runs: starting torchrun and two ranks costs far more than training. Each run's process group
# gets a namespace of its own in torchrun's store: a second init_process_group after
# destroy_process_group would otherwise find the first group's addresses, still in the store, and
# could hang (it did, once in a few tries, while this check was written).
HARNESS = '''import json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

out, rank, world = sys.argv[1], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
real_init, agent, current = dist.init_process_group, [], [0]


def init_process_group(backend=None, init_method=None, *args, **kwargs):
    if init_method in (None, "env://") and not args and kwargs.get("store") is None:
        if not agent:
            agent.append(dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False))
        kwargs["store"] = dist.PrefixStore(f"check08/run{current[0]}", agent[0])
        for key, value in (("rank", rank), ("world_size", world)):
            if kwargs.get(key, -1) == -1:
                kwargs[key] = value
        init_method = None
    return real_init(backend, init_method, *args, **kwargs)


dist.init_process_group = init_process_group


class Recorded(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y, self.seen = x, y, []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.seen.append(int(i))
        return self.x[i], self.y[i]


results = []
try:
    from learner_ddp import ddp_train
    for current[0], run in enumerate(json.load(open(os.path.join(out, "case.json")))["runs"]):
        model = nn.Sequential(nn.Linear(run["d"], run["h"]), nn.ReLU(), nn.Linear(run["h"], run["k"]))
        model.load_state_dict({k: torch.tensor(v) for k, v in run["init"].items()})
        data = Recorded(torch.tensor(run["x"]), torch.tensor(run["y"]))
        got = ddp_train(rank, world, model, data, epochs=run["epochs"], batch_size=run["batch_size"],
                        lr=run["lr"], seed=run["seed"], amp_dtype=getattr(torch, run["dtype"]))
        got = model if got is None else got
        got = got.module if isinstance(got, DistributedDataParallel) else got
        results.append({"params": {k: v.detach().float().tolist() for k, v in got.state_dict().items()},
                        "destroyed": not dist.is_initialized(), "seen": data.seen})
        if dist.is_initialized():
            dist.destroy_process_group()  # the judge tells the learner; the next run must be able to start
except BaseException as e:
    failure = {"rank": rank, "time": time.time(), "error": f"{type(e).__name__}: {e}"}
    open(os.path.join(out, f"failed_rank{rank}.json"), "w").write(json.dumps(failure))
    raise
open(os.path.join(out, f"result_rank{rank}.json"), "w").write(json.dumps(results))
print(f"[rank {rank}] done")
'''


def _model(run: dict):
    import torch
    import torch.nn as nn
    model = nn.Sequential(nn.Linear(run["d"], run["h"]), nn.ReLU(), nn.Linear(run["h"], run["k"]))
    model.load_state_dict({k: torch.tensor(v) for k, v in run["init"].items()})
    return model


def _orders(run: dict, set_epoch: bool) -> list[list[int]]:
    """The samples each rank's DataLoader reads over all epochs, in order (DistributedSampler's)."""
    from course_lib.chapters.distributed import sampler_orders
    per_epoch = sampler_orders(run["n"], WORLD, run["epochs"], run["seed"], set_epoch)
    return [[i for order in rank for i in order] for rank in per_epoch]


@register
class DDPTrain(Check):
    name, args, points = "08.ddp_train", ("ddp_train",), 4
    hint = ("In ddp_train: dist.init_process_group('gloo', rank=rank, world_size=world_size); wrap the model in "
            "DDP; DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed) as the "
            "DataLoader's sampler with batch_size; sampler.set_epoch(epoch) at the start of every epoch; the same "
            "autocast + GradScaler step as train_single; dist.destroy_process_group() in a finally: block.")
    time_limit = 200.0

    def cases(self, rng: random.Random) -> list:
        runs = []
        for dtype in ("float32", "bfloat16"):
            d, h, k, n = 6, rng.choice([8, 12, 16]), rng.choice([3, 4, 5]), rng.choice([40, 48, 56])
            scale = (1 / d) ** 0.5, (1 / h) ** 0.5
            init = {"0.weight": [[rng.uniform(-scale[0], scale[0]) for _ in range(d)] for _ in range(h)],
                    "0.bias": [rng.uniform(-scale[0], scale[0]) for _ in range(h)],
                    "2.weight": [[rng.uniform(-scale[1], scale[1]) for _ in range(h)] for _ in range(k)],
                    "2.bias": [rng.uniform(-scale[1], scale[1]) for _ in range(k)]}
            runs.append({"dtype": dtype, "d": d, "h": h, "k": k, "n": n, "init": init,
                         "x": [[round(rng.gauss(0, 1), 4) for _ in range(d)] for _ in range(n)],
                         "y": [rng.randrange(k) for _ in range(n)], "epochs": 2, "batch_size": rng.choice([4, 6, 8]),
                         "lr": round(rng.uniform(0.05, 0.15), 3), "seed": rng.randrange(10_000)})
        return [{"runs": runs}]

    def describe(self, case: dict) -> str:
        return "ddp_train under torchrun (2 gloo processes)"

    def run(self, case: dict, ddp_train) -> list:
        from course_lib.chapters.distributed import DDPRunError, launch
        try:
            source = textwrap.dedent(inspect.getsource(ddp_train))
        except (OSError, TypeError) as e:
            raise RuntimeError(f"the source of ddp_train cannot be read ({e}): define it with def in a cell") from e
        if STUB in source:
            raise NotImplementedError(STUB_MESSAGE)  # untouched: no need to start two processes to find out
        folder = Path(tempfile.mkdtemp(prefix="check08-"))
        try:
            (folder / "learner_ddp.py").write_text(f"{HEADER}{source}\n\nddp_train = {ddp_train.__name__}\n")
            (folder / "harness.py").write_text(HARNESS)
            (folder / "case.json").write_text(json.dumps(case))
            try:
                launch([], WORLD, script=folder / "harness.py", out=folder, timeout=LAUNCH_TIMEOUT)
            except DDPRunError as e:
                if f"NotImplementedError: {STUB_MESSAGE}" in str(e):
                    raise NotImplementedError(STUB_MESSAGE) from None
                raise
            return [json.loads((folder / f"result_rank{r}.json").read_text()) for r in range(WORLD)]
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def judge(self, cases: list, results: list) -> None:
        import torch

        from course_lib.chapters.distributed import reference_train
        runs, ranks = cases[0]["runs"], results[0]
        shaped = isinstance(ranks, list) and len(ranks) == WORLD and all(
            isinstance(r, list) and len(r) == len(runs) and all(isinstance(g, dict) for g in r) for r in ranks)
        if not shaped:
            raise CheckFailure(f"expected from each of {WORLD} ranks one result per run ({len(runs)}), "
                               f"got {ranks!r:.200}")
        for i, run in enumerate(runs):
            what = (f"run {i + 1} ({run['dtype']}, {run['n']} samples, batch_size={run['batch_size']} per rank, "
                    f"{run['epochs']} epochs)")
            got = [ranks[r][i] for r in range(WORLD)]
            seen = [g.get("seen") or [] for g in got]
            if all(seen):  # empty when the learner's DataLoader read the data in worker processes
                if seen[0] == seen[1]:
                    raise CheckFailure(f"{what}: both ranks read the same samples in the same order, so the two "
                                       "processes did the same work: give the DataLoader a DistributedSampler")
                right, repeated = _orders(run, True), _orders(run, False)
                for r in range(WORLD):
                    if seen[r] == repeated[r] != right[r]:
                        raise CheckFailure(f"{what}: rank {r} read every epoch in the same order: call "
                                           "sampler.set_epoch(epoch) at the start of each epoch")
                    if seen[r] != right[r]:
                        raise CheckFailure(f"{what}: rank {r} read samples {seen[r][:6]}..., expected "
                                           f"{right[r][:6]}... (DistributedSampler(dataset, num_replicas=world_size, "
                                           "rank=rank, shuffle=True, seed=seed) and batch_size per rank)")
            params = [{k: torch.tensor(v) for k, v in g["params"].items()} for g in got]
            model = _model(run)
            init = {k: v.detach() for k, v in model.state_dict().items()}
            if any(set(p) != set(init) or any(p[k].shape != init[k].shape for k in init) for p in params):
                raise CheckFailure(f"{what}: the returned model has parameters {sorted(params[0])}, expected the "
                                   f"model passed in, {sorted(init)}")
            apart = max((params[0][k] - params[1][k]).abs().max().item() for k in init)
            if apart > 1e-6:
                raise CheckFailure(f"{what}: ranks 0 and 1 ended with different parameters (max difference "
                                   f"{apart:.3g}): their gradients were not averaged; wrap the model in DDP")
            x, y = torch.tensor(run["x"]), torch.tensor(run["y"])
            dtype = None if run["dtype"] == "float32" else getattr(torch, run["dtype"])
            ref, _ = reference_train(model, x, y, world_size=WORLD, batch_size=run["batch_size"], epochs=run["epochs"],
                                     lr=run["lr"], seed=run["seed"], amp_dtype=dtype)
            want = ref.state_dict()
            moved = max((want[k] - init[k]).abs().max().item() for k in init)
            off = max((params[0][k] - want[k]).abs().max().item() for k in init) / moved
            if off > TOLERANCE[run["dtype"]]:
                raise CheckFailure(f"{what}: the parameters differ from one process training on the equivalent "
                                   f"batch of {WORLD * run['batch_size']} by {off:.3g} of how far training moved them "
                                   f"(allowed: {TOLERANCE[run['dtype']]:g})")
            if not all(g.get("destroyed") for g in got):
                raise CheckFailure(f"{what}: the process group was still initialized when ddp_train returned: "
                                   "call dist.destroy_process_group() (in a finally: block)")
