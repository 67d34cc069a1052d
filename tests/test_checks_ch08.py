"""Exercise 08's check accepts a right DDP conversion and rejects the classic mistakes.

The check runs the learner's ddp_train for real, under torchrun in two gloo processes, and inspects
the run: so every answer below costs one launch (20-40 s on a busy 2-core machine). The real
launches are the solution (one module-wide run, whose results the judge-only tests then alter) and
one answer per kind of failure that only a run can expose: a fake "DDP" with no process group that
matches the reference, a process group but no DDP wrapper, no autocast, no GradScaler, a rank that
raises. Each answer is written to a module file, as a notebook cell would define it, because the
probe reads its source. The judge-only tests feed the solution's results, changed the way a wrong
answer would change them, without launching anything.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import random
import textwrap

import pytest
import torch
from checking import verdict

from course_lib.tooling import probes
from course_lib.tooling.checkbase import CheckFailure
from course_lib.tooling.checks import ch08, get_check
from course_lib.tooling.probes.ch08 import HEADER

pytestmark = pytest.mark.slow  # each answer trained in a real two-process group: left out by make test-fast

SOLUTION = """
def ddp_train(rank, world_size, model, dataset, *, epochs, batch_size, lr, seed, amp_dtype=torch.bfloat16):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        ddp_model = DDP(model)
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", enabled=amp_dtype == torch.float16)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype != torch.float32):
                    loss = F.cross_entropy(ddp_model(x), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
        return model
    finally:
        dist.destroy_process_group()
"""


def variant(*replacements: tuple[str, str]) -> str:
    source = SOLUTION
    for old, new in replacements:
        assert old in source, old
        source = source.replace(old, new)
    return source


NO_DDP = variant(("        ddp_model = DDP(model)\n", "        ddp_model = model\n"))
AUTOCAST_LINES = (
    '                with torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype != torch.float32):\n'
    "                    loss = F.cross_entropy(ddp_model(x), y)\n"
)
NO_AUTOCAST = variant((AUTOCAST_LINES, "                loss = F.cross_entropy(ddp_model(x), y)\n"))
SCALER_LINES = (
    "                scaler.scale(loss).backward()\n                scaler.step(optimizer)\n"
    "                scaler.update()\n"
)
NO_SCALER = variant((SCALER_LINES, "                loss.backward()\n                optimizer.step()\n"))
RAISES_ON_RANK_1 = variant(
    (
        "        ddp_model = DDP(model)\n",
        "        ddp_model = DDP(model)\n        if rank == 1:\n"
        "            raise ValueError(f'rank {rank} has no data')\n",
    )
)
# No process group at all: every rank trains on all ranks' batches itself, so both end with the
# reference's parameters. Its DataLoaders read in worker processes, where the dataset's own log of
# reads stays empty: the sample order was not checked then, and this fake passed.
FAKE_DDP = """
def ddp_train(rank, world_size, model, dataset, *, epochs, batch_size, lr, seed, amp_dtype=torch.bfloat16):
    samplers = [DistributedSampler(dataset, num_replicas=world_size, rank=r, shuffle=True, seed=seed)
                for r in range(world_size)]
    loaders = [DataLoader(dataset, batch_size=batch_size, sampler=s, num_workers=1) for s in samplers]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=amp_dtype == torch.float16)
    for epoch in range(epochs):
        for s in samplers:
            s.set_epoch(epoch)
        for batches in zip(*loaders):
            x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype != torch.float32):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    return model
"""
HARD_CODED = """
def ddp_train(rank, world_size, model, dataset, *, epochs, batch_size, lr, seed, amp_dtype=torch.bfloat16):
    return model  # "trained"
"""
STUB = """
def ddp_train(rank, world_size, model, dataset, *, epochs, batch_size, lr, seed, amp_dtype=torch.bfloat16):
    raise NotImplementedError("Exercise: write your solution here")
"""


def load(source: str, tmp_path, name: str = "answer"):
    path = tmp_path / f"{name}.py"
    path.write_text(HEADER + textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(f"ch08_{name}_{id(source)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ddp_train


# --------------------------------------------------------------------------- real launches


@pytest.fixture(scope="module")
def solution_run(tmp_path_factory) -> tuple[list, list]:
    """The solution, launched once as the grader runs it (public cases, probe, JSON): (cases, results)."""
    check = get_check("08.ddp_train")
    cases = check.cases(random.Random(0))
    fn = load(SOLUTION, tmp_path_factory.mktemp("solution"), "solution")
    results = [probes.find("08.ddp_train")(check.public(case), fn) for case in cases]
    return cases, json.loads(json.dumps(results))


def test_the_solution_passes_in_fp32_bf16_and_an_overflowing_fp16(solution_run):
    cases, results = solution_run
    assert [run["dtype"] for run in cases[0]["runs"]] == ["float32", "bfloat16", "float16"]
    get_check("08.ddp_train").judge(cases, results)
    fp16 = [results[0][r][2] for r in range(ch08.WORLD)]
    assert fp16[0]["injected"] and [g["scales"][0] for g in fp16] == [[65536.0, 32768.0]] * 2  # both backed off


@pytest.mark.parametrize(
    "source, expected",
    [
        (FAKE_DDP, "forwards without a process group of 2"),
        (NO_DDP, "outside DistributedDataParallel"),
        (NO_AUTOCAST, "the model's forward computed in float32 without autocast, expected bfloat16"),
        (NO_SCALER, "optimizer.step() ran 10 times on rank 0, expected 9 of 10"),
    ],
    ids=["fake-no-process-group", "no-ddp", "no-autocast", "no-scaler"],
)
def test_a_wrong_answer_fails_with_a_message_that_says_why(source, expected, tmp_path, monkeypatch):
    # a fixed draw, so that the fp16 run's number of steps in the message is known
    real_cases = ch08.DDPTrain.cases
    monkeypatch.setattr(ch08.DDPTrain, "cases", lambda self, rng: real_cases(self, random.Random(0)))
    status, message = verdict("08.ddp_train", load(source, tmp_path))
    assert status == "failed" and expected in message, message


def test_a_rank_that_raises_is_named_in_the_message(tmp_path):
    status, message = verdict("08.ddp_train", load(RAISES_ON_RANK_1, tmp_path))
    assert status == "failed"
    assert "raised DDPRunError: rank 1 failed first: ValueError: rank 1 has no data" in message, message


def test_the_untouched_exercise_is_not_attempted_without_starting_anything(tmp_path):
    status, message = verdict("08.ddp_train", load(STUB, tmp_path))
    assert status == "not attempted", message


def test_a_function_without_readable_source_fails_clearly():
    namespace = {"torch": torch}
    exec(textwrap.dedent(HARD_CODED), namespace)  # no file behind it: inspect.getsource cannot read it
    status, message = verdict("08.ddp_train", namespace["ddp_train"])
    assert status == "failed" and "cannot be read" in message, message


# --------------------------------------------------------------------------- the judge alone


def judged(solution_run, change) -> str:
    """The judge's message on the solution's results after change(results) (must fail)."""
    cases, results = solution_run
    altered = copy.deepcopy(results)
    change(altered[0])
    with pytest.raises(CheckFailure) as e:
        get_check("08.ddp_train").judge(cases, altered)
    return str(e.value)


def each(ranks: list, run: int, **values) -> None:
    for r in range(ch08.WORLD):
        ranks[r][run].update(values)


def test_an_empty_sample_log_fails_the_order_checks(solution_run):
    """A rank whose DataLoader asked for nothing (the learner read dataset.x directly) fails: no skip."""
    msg = judged(solution_run, lambda ranks: ranks[1][0].update(seen=[]))
    assert "rank 1 read no samples from the dataset it was given" in msg
    assert "read no samples" in judged(solution_run, lambda ranks: each(ranks, 1, seen=[]))


def test_the_sample_order_names_a_missing_sampler_and_set_epoch(solution_run):
    cases, _ = solution_run
    run = cases[0]["runs"][0]
    msg = judged(solution_run, lambda ranks: ranks[1][0].update(seen=list(ranks[0][0]["seen"])))
    assert "both ranks read the same samples" in msg
    repeated = ch08._orders(run, False)
    msg = judged(solution_run, lambda ranks: [ranks[r][0].update(seen=repeated[r]) for r in range(2)])
    assert "call sampler.set_epoch(epoch)" in msg
    msg = judged(solution_run, lambda ranks: ranks[0][0].update(seen=list(reversed(ranks[0][0]["seen"]))))
    assert "rank 0 read samples [" in msg


def test_the_process_group_and_the_ddp_wrapper_are_read_from_every_forward(solution_run):
    def alone(ranks):  # each rank trained by itself: dist.is_initialized() was False in every forward
        for r in range(2):
            for f in ranks[r][0]["forwards"]:
                f["world"] = 0

    assert "without a process group of 2" in judged(solution_run, alone)

    def unwrapped(ranks):  # a process group, but the model called directly once
        ranks[0][1]["forwards"][-1]["ddp"] = False

    n = len(solution_run[1][0][0][1]["forwards"])
    assert f"1 of its {n} forwards of the model outside DistributedDataParallel" in judged(solution_run, unwrapped)
    assert "never ran the model it was given" in judged(solution_run, lambda ranks: each(ranks, 0, forwards=[]))
    msg = judged(solution_run, lambda ranks: each(ranks, 0, allreduces=0))
    assert "DDP all-reduced gradients 0 times on rank 0" in msg


def test_autocast_is_read_from_the_dtype_each_forward_computed_in(solution_run):
    def in_fp32(ranks):
        for f in ranks[0][1]["forwards"]:
            f.update(dtype="float32", autocast=False)

    assert "computed in float32 without autocast, expected bfloat16" in judged(solution_run, in_fp32)

    def converted(ranks):  # model.to(torch.bfloat16) instead of autocast
        for f in ranks[0][1]["forwards"]:
            f.update(autocast=False, params=["bfloat16"])

    assert "parameters were ['bfloat16'] during a forward" in judged(solution_run, converted)

    def autocast_in_fp32_run(ranks):
        for f in ranks[1][0]["forwards"]:
            f.update(dtype="bfloat16", autocast=True)

    assert "computed in bfloat16 under autocast, expected float32" in judged(solution_run, autocast_in_fp32_run)


def test_the_grad_scaler_must_skip_the_overflow_and_back_off(solution_run):
    cases, _ = solution_run
    steps = ch08.steps_of(cases[0]["runs"][2])
    msg = judged(solution_run, lambda ranks: each(ranks, 2, steps=steps))
    assert f"ran {steps} times on rank 0, expected {steps - 1} of {steps}" in msg and "GradScaler" in msg
    msg = judged(solution_run, lambda ranks: ranks[1][2].update(scales=[[65536.0, 65536.0]]))
    assert "rank 1's GradScaler did not back off" in msg and "65536 -> 65536" in msg
    assert "it was never updated" in judged(solution_run, lambda ranks: each(ranks, 2, scales=[]))
    msg = judged(solution_run, lambda ranks: each(ranks, 0, steps=steps - 1))  # a step skipped in fp32
    assert "one optimizer step per batch of batch_size samples per rank" in msg


def test_the_parameters_are_compared_with_one_process_on_the_large_batch(solution_run):
    cases, _ = solution_run

    def shifted(ranks):
        for r in range(2):
            ranks[r][0]["params"] = {k: (torch.tensor(v) + 1e-2).tolist() for k, v in ranks[r][0]["params"].items()}

    assert "differ from one process training on the equivalent batch" in judged(solution_run, shifted)

    def apart(ranks):
        ranks[1][1]["params"]["2.bias"][0] += 0.5

    assert "ranks 0 and 1 ended with different parameters" in judged(solution_run, apart)

    def not_finite(ranks):
        for r in range(2):
            ranks[r][2]["params"]["0.bias"][0] = float("nan")

    assert "holds inf or nan" in judged(solution_run, not_finite)
    # batch_size // world_size per rank: twice the steps, on other batches
    run = cases[0]["runs"][0]
    halved = {**run, "batch_size": max(1, run["batch_size"] // 2)}
    msg = judged(
        solution_run, lambda ranks: each(ranks, 0, steps=ch08.steps_of(halved), allreduces=ch08.steps_of(halved))
    )
    assert f"optimizer.step() ran {ch08.steps_of(halved)} times" in msg
    msg = judged(solution_run, lambda ranks: each(ranks, 0, destroyed=False))
    assert "the process group was still initialized" in msg


def test_results_of_the_wrong_shape_fail_with_what_was_expected(solution_run):
    cases, _ = solution_run
    with pytest.raises(CheckFailure, match="expected a list of 2, got a list of 0"):
        get_check("08.ddp_train").judge(cases, [[]])
    msg = judged(solution_run, lambda ranks: ranks[1].pop())
    assert "rank 1's results, one per run: expected a list of 3, got a list of 2" in msg
    msg = judged(solution_run, lambda ranks: ranks[0][1].pop("forwards"))
    assert "lacks ['forwards']" in msg
    msg = judged(solution_run, lambda ranks: ranks[0][1].update(steps="10"))
    assert "steps: expected an integer" in msg


def test_the_check_runs_in_the_probe_and_the_probe_needs_no_check_module():
    from course_lib.tooling.probes import ch08 as probe

    assert "run" not in vars(ch08.DDPTrain) and probes.find("08.ddp_train") is probe.ddp_train
    assert "tooling.checks" not in inspect.getsource(probe) and "..checks" not in inspect.getsource(probe)
