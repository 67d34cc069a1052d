"""Exercise 08's check accepts a right DDP conversion and rejects the classic mistakes.

The check runs the learner's ddp_train for real, under torchrun in two gloo processes, so every
answer below costs one launch (10-30 s on a 2-core machine): the real launches are the solution
and one answer per kind of failure the launch itself must expose (a hard-coded model, a missing
sampler, no DDP, no cleanup, a rank that raises). Each answer is written to a module
file, as a notebook cell would define it, because the check reads its source. A second group
feeds the judge hand-made results, without launching anything.
"""
from __future__ import annotations

import importlib.util
import random
import textwrap

import pytest
import torch

from course_lib.chapters.distributed import reference_train
from course_lib.tooling.checks import ch08
from course_lib.tooling.grading import CheckFailure, get_check, run_check

HEADER = ch08.HEADER

SOLUTION = '''
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
'''


def variant(*replacements: tuple[str, str]) -> str:
    source = SOLUTION
    for old, new in replacements:
        assert old in source, old
        source = source.replace(old, new)
    return source


NO_SAMPLER = variant(
    ("        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)\n",
     "        loader = DataLoader(dataset, batch_size=batch_size, shuffle=True,\n"
     "                            generator=torch.Generator().manual_seed(seed))\n"))
NO_SET_EPOCH = variant(("            sampler.set_epoch(epoch)\n", ""))
NO_DDP = variant(("        ddp_model = DDP(model)\n", "        ddp_model = model\n"))
NO_CLEANUP = variant(("    finally:\n        dist.destroy_process_group()\n", "    finally:\n        pass\n"))
GLOBAL_BATCH = variant(("batch_size=batch_size, sampler", "batch_size=max(1, batch_size // world_size), sampler"))
HARD_CODED = '''
def ddp_train(rank, world_size, model, dataset, *, epochs, batch_size, lr, seed, amp_dtype=torch.bfloat16):
    return model  # "trained"
'''
RAISES_ON_RANK_1 = variant(("        ddp_model = DDP(model)\n",
                            "        ddp_model = DDP(model)\n        if rank == 1:\n"
                            "            raise ValueError(f'rank {rank} has no data')\n"))
STUB = '''
def ddp_train(rank, world_size, model, dataset, *, epochs, batch_size, lr, seed, amp_dtype=torch.bfloat16):
    raise NotImplementedError("Exercise: write your solution here")
'''


def load(source: str, tmp_path, name: str = "answer"):
    path = tmp_path / f"{name}.py"
    path.write_text(HEADER + textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(f"ch08_{name}_{id(source)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ddp_train


def verdict(fn) -> tuple[str, str]:
    status, message, _ = run_check("08.ddp_train", fn)
    return status, message


# --------------------------------------------------------------------------- real launches

def test_the_solution_passes_on_fresh_inputs_in_fp32_and_bf16(tmp_path):
    status, message = verdict(load(SOLUTION, tmp_path))
    assert status == "passed", message


@pytest.mark.parametrize("source, expected", [
    (NO_SAMPLER, "both ranks read the same samples in the same order"),
    (NO_DDP, "ranks 0 and 1 ended with different parameters"),
    (HARD_CODED, "differ from one process training on the equivalent batch"),
    (NO_CLEANUP, "the process group was still initialized"),
], ids=["no-sampler", "no-ddp", "hard-coded", "no-cleanup"])
def test_a_wrong_answer_fails_with_a_message_that_says_why(source, expected, tmp_path):
    status, message = verdict(load(source, tmp_path))
    assert status == "failed" and expected in message, message


def test_a_rank_that_raises_is_named_in_the_message(tmp_path):
    status, message = verdict(load(RAISES_ON_RANK_1, tmp_path))
    assert status == "failed"
    assert "raised DDPRunError: rank 1 failed first: ValueError: rank 1 has no data" in message, message


def test_the_untouched_exercise_is_not_attempted_without_starting_anything(tmp_path):
    status, message = verdict(load(STUB, tmp_path))
    assert status == "not attempted", message


def test_a_function_without_readable_source_fails_clearly():
    namespace = {"torch": torch}
    exec(textwrap.dedent(HARD_CODED), namespace)  # no file behind it: inspect.getsource cannot read it
    status, message = verdict(namespace["ddp_train"])
    assert status == "failed" and "cannot be read" in message, message


# --------------------------------------------------------------------------- the judge alone

def _reference_result(case: dict, shift: float = 0.0, seen: list | None = None, destroyed: bool = True) -> list:
    model = ch08._model(case)
    dtype = None if case["dtype"] == "float32" else getattr(torch, case["dtype"])
    ref, _ = reference_train(model, torch.tensor(case["x"]), torch.tensor(case["y"]), world_size=2,
                             batch_size=case["batch_size"], epochs=case["epochs"], lr=case["lr"], seed=case["seed"],
                             amp_dtype=dtype)
    params = {k: (v + shift).tolist() for k, v in ref.state_dict().items()}
    orders = ch08._orders(case, True)
    return [{"params": params, "destroyed": destroyed, "seen": seen[r] if seen else orders[r]} for r in range(2)]


def _results(runs: list, **kwargs) -> list:
    """[result]: per rank, one entry per run, as the harness writes them."""
    per_run = [_reference_result(run, **kwargs) for run in runs]
    return [[per_run[i][r] for i in range(len(runs))] for r in range(2)]


def test_the_judge_accepts_the_reference_itself_and_rejects_a_small_shift():
    check = get_check("08.ddp_train")
    cases = check.cases(random.Random(1))
    runs = cases[0]["runs"]
    assert [r["dtype"] for r in runs] == ["float32", "bfloat16"]
    check.judge(cases, [_results(runs)])
    with pytest.raises(CheckFailure, match=r"run 1 \(float32.*differ from one process"):
        check.judge(cases, [_results(runs, shift=1e-2)])


def test_the_judge_reads_the_sample_order_when_there_is_one():
    check = get_check("08.ddp_train")
    cases = check.cases(random.Random(2))
    run = cases[0]["runs"][0]
    one = {"runs": [run]}
    other = [list(reversed(o)) for o in ch08._orders(run, True)]
    with pytest.raises(CheckFailure, match=r"rank 0 read samples \["):
        check.judge([one], [_results([run], seen=other)])
    # no recorded order (a DataLoader with worker processes): judged on the parameters alone
    check.judge([one], [_results([run], seen=[[], []])])
    with pytest.raises(CheckFailure, match="still initialized"):
        check.judge([one], [_results([run], destroyed=False)])
    with pytest.raises(CheckFailure, match="expected from each of 2 ranks one result per run"):
        check.judge([one], [[]])


def test_the_judge_names_a_missing_set_epoch_and_a_global_batch_size():
    """What NO_SET_EPOCH and GLOBAL_BATCH would return, computed without a launch."""
    check = get_check("08.ddp_train")
    cases = check.cases(random.Random(3))
    run = cases[0]["runs"][0]
    one = {"runs": [run]}
    with pytest.raises(CheckFailure, match=r"call sampler.set_epoch\(epoch\)"):
        check.judge([one], [_results([run], seen=ch08._orders(run, False))])
    halved = {**run, "batch_size": max(1, run["batch_size"] // 2)}  # batch_size // world_size per rank
    wrong = _reference_result(halved, seen=[[], []])
    with pytest.raises(CheckFailure, match="differ from one process training on the equivalent batch"):
        check.judge([one], [[[wrong[0]], [wrong[1]]]])
    assert "sampler.set_epoch(epoch)" not in NO_SET_EPOCH and "batch_size // world_size" in GLOBAL_BATCH
