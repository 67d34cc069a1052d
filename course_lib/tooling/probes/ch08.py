"""Task side of exercise 08's check (see course_lib.tooling.probes).

The learner's `ddp_train` runs for real: the probe writes its source to a file, starts two gloo
processes under torchrun (`sys.executable -m torch.distributed.run`, on loopback: inside the
grader's sandbox too) and returns what each rank trained and what it saw while it trained. The
harness that runs in every rank watches the run, not only its outcome: the process group and the
DDP wrapper around every forward, the dtype each forward computed in, the gradient all-reduces,
the optimizer steps that ran and the GradScaler's scale, and the samples its DataLoader asked for.
In a float16 run it makes rank 0's first gradient overflow, as fp16 gradients do now and then, so
that a GradScaler has to skip that step on every rank and back off. The grader judges all of it
(course_lib/tooling/checks/ch08.py)."""

from __future__ import annotations

import inspect
import json
import shutil
import tempfile
import textwrap
from pathlib import Path
from typing import Callable

__all__ = ["ddp_train"]

WORLD = 2
LAUNCH_TIMEOUT = 150.0  # starting torch in three processes alone takes 10-30 s on a busy 2-core machine
STUB = 'raise NotImplementedError("Exercise: write your solution here")'  # the exercise's untouched cell
STUB_MESSAGE = "Exercise: write your solution here"
MAX_FORWARDS = 500  # per rank and run: more is a runaway loop, and the log need not grow with it

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
# the learner's ddp_train, and write back what it trained and what the run did (so that the judge
# can say what went wrong, not only that it did). One launch for all runs: starting torchrun and
# two ranks costs far more than training. Each run's process group gets a namespace of its own in
# torchrun's store: a second init_process_group after destroy_process_group would otherwise find
# the first group's addresses, still in the store, and could hang (it did, once in a few tries,
# while this check was written). The originals of what is patched are kept before the learner's
# module is imported, so that what it replaces does not change what is recorded.
HARNESS = """import json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
import torch.distributed.nn  # before any group: imported later (by DDP) its defaults would keep the group alive
import torch.nn as nn
from torch.amp.grad_scaler import GradScaler
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import dataloader

out, rank, world = sys.argv[1], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
real_init, agent, current = dist.init_process_group, [], [0]
is_initialized, get_world_size, autocast_on = dist.is_initialized, dist.get_world_size, torch.is_autocast_enabled
ddp_init, ddp_forward = DistributedDataParallel.__init__, DistributedDataParallel.forward
scaler_update, next_index = GradScaler.update, dataloader._BaseDataLoaderIter._next_index
log, inside_ddp = {}, [0]  # log: what this rank saw during the current run


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


def counted_allreduce(state, bucket):  # DDP's own all-reduce of one gradient bucket, counted
    log["allreduces"] += 1
    return allreduce_hook(state, bucket)


def wrapped_init(self, module, *args, **kwargs):
    ddp_init(self, module, *args, **kwargs)
    if any(m is log.get("model") for m in module.modules()):
        self.register_comm_hook(None, counted_allreduce)
        # Kept until the run is over. Freed as the learner's function returns, right after the last all-reduce,
        # DDP's reducer frees the group while gloo's thread may still drop this hook's Python objects: torch 2.6
        # joins that thread holding the GIL, which the thread waits for, and the rank hangs (the ch08 tests did).
        log["wrappers"].append(self)


def wrapped_forward(self, *args, **kwargs):
    inside_ddp[0] += 1
    try:
        return ddp_forward(self, *args, **kwargs)
    finally:
        inside_ddp[0] -= 1


def counted_update(self, new_scale=None):
    before = self.get_scale() if self.is_enabled() else None
    scaler_update(self, new_scale)
    if self.is_enabled():
        log["scales"].append([before, self.get_scale()])


def recorded_next_index(self):  # in this process, whether or not the loader has worker processes
    index = next_index(self)
    if self._dataset is log.get("data"):
        log["asked"].extend(int(i) for i in (index if isinstance(index, (list, tuple)) else [index]))
    return index


def after_forward(module, inputs, output):
    if len(log["forwards"]) < MAX_FORWARDS:
        log["forwards"].append({
            "world": get_world_size() if is_initialized() else 0, "ddp": inside_ddp[0] > 0,
            "autocast": autocast_on("cpu"), "grad": torch.is_grad_enabled(),
            "dtype": str(getattr(output, "dtype", None)).removeprefix("torch."),
            "params": sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters()})})


def after_step(optimizer, args, kwargs):
    if any(id(p) in log["param_ids"] for group in optimizer.param_groups for p in group["params"]):
        log["steps"] += 1


def overflow_once(grad):  # rank 0's first gradient of the run overflows, as fp16 gradients do now and then
    if log["injected"]:
        return grad
    log["injected"] = True
    return torch.full_like(grad, float("inf"))


dist.init_process_group = init_process_group
DistributedDataParallel.__init__, DistributedDataParallel.forward = wrapped_init, wrapped_forward
GradScaler.update, dataloader._BaseDataLoaderIter._next_index = counted_update, recorded_next_index
register_optimizer_step_post_hook(after_step)
MAX_FORWARDS = %(max_forwards)d


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
        log.clear()
        log.update(model=model, data=data, param_ids={id(p) for p in model.parameters()}, forwards=[], asked=[],
                   allreduces=0, steps=0, scales=[], injected=False, wrappers=[])
        model.register_forward_hook(after_forward)
        if run.get("overflow") and rank == 0:
            model[2].weight.register_hook(overflow_once)
        got = ddp_train(rank, world, model, data, epochs=run["epochs"], batch_size=run["batch_size"],
                        lr=run["lr"], seed=run["seed"], amp_dtype=getattr(torch, run["dtype"]))
        got = model if got is None else got
        got = got.module if isinstance(got, DistributedDataParallel) else got
        results.append({"params": {k: v.detach().float().tolist() for k, v in got.state_dict().items()},
                        "destroyed": not is_initialized(), "seen": log["asked"] or data.seen,
                        **{k: log[k] for k in ("forwards", "allreduces", "steps", "scales", "injected")}})
        if is_initialized():
            dist.destroy_process_group()  # the judge tells the learner; the next run must be able to start
        time.sleep(0.1)  # the GIL released: gloo's threads drop what they hold (see wrapped_init) ...
        log["wrappers"].clear()  # ... before the DDP wrappers, and with them the group, are freed
except BaseException as e:
    failure = {"rank": rank, "time": time.time(), "error": f"{type(e).__name__}: {e}"}
    open(os.path.join(out, f"failed_rank{rank}.json"), "w").write(json.dumps(failure))
    raise
open(os.path.join(out, f"result_rank{rank}.json"), "w").write(json.dumps(results))
print(f"[rank {rank}] done")
""" % {"max_forwards": MAX_FORWARDS}


def ddp_train(case: dict, ddp_train_fn: Callable) -> list:
    """Both ranks' results, [rank][run], from one torchrun launch of the learner's ddp_train."""
    from course_lib.chapters.ch08.ddp_launch import DDPRunError, launch

    try:
        source = textwrap.dedent(inspect.getsource(ddp_train_fn))
    except (OSError, TypeError) as e:
        raise RuntimeError(f"the source of ddp_train cannot be read ({e}): define it with def in a cell") from e
    if STUB in source:
        raise NotImplementedError(STUB_MESSAGE)  # untouched: no need to start two processes to find out
    folder = Path(tempfile.mkdtemp(prefix="check08-"))
    try:
        (folder / "learner_ddp.py").write_text(f"{HEADER}{source}\n\nddp_train = {ddp_train_fn.__name__}\n")
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
