"""Exercise 12's checks accept the right count and the right fix, and name each usual mistake.

`12.rank_bytes` is judged against chapter 12's predictor; every wrong answer below is the right one
with one mistake a learner makes (padding forgotten or misplaced, bf16 shards, the reduce dtype, the
step tensors, another split than torch.chunk's, ZeRO's 16Ψ/N). `12.fix_sharding` runs each `shard`
for real in a one-process gloo group (about a second each).
"""

from __future__ import annotations

import math

import pytest
import torch
from checking import fails, judged_cells, passes, verdict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from course_lib.chapters.ch12.precision import FLOOR
from course_lib.device import torch_at_least
from course_lib.tooling.checks import ch12, get_check
from course_lib.tooling.probes import ch12 as probe

# FSDP2 on a CPU, as the task's check asks (its needs_torch): chapter 12's floor
needs_floor = pytest.mark.skipif(not torch_at_least(FLOOR), reason=f"chapter 12 needs torch >= {FLOOR}")

KEYS = ch12.KEYS
SIZE = {"fp32": 4, "bf16": 2}


def counted(units, root, world, rank, param_dtype, reduce_dtype, optimizer, *, mistake: str = "") -> dict:
    """The right count, or the right count with one `mistake`."""
    out = dict.fromkeys(KEYS, 0)
    largest = everything = 0
    for unit in [*units, root]:
        stored_unit = 0
        for shape in unit:
            d0, rest = shape[0], math.prod(shape[1:])
            c = math.ceil(d0 / world)
            held = max(0, min(c, d0 - rank * c))
            if mistake == "floor split":
                held = d0 // world if rank < world - 1 else d0 - (world - 1) * (d0 // world)
            if mistake == "array_split":
                held = d0 // world + (rank < d0 % world)
            stored = held if mistake == "no padding" else c
            moments = c if mistake == "padded optimizer" else held
            stored_unit += stored * rest
            everything += stored * rest
            out["sharded_params"] += (SIZE[param_dtype] if mistake == "bf16 shards" else 4) * stored * rest
            out["gradients"] += 4 * stored * rest
            step = 0 if mistake == "no step" else 4
            if optimizer == "adamw":
                out["optimizer_state"] += 8 * moments * rest + step
            elif optimizer == "sgd_momentum":
                out["optimizer_state"] += 4 * moments * rest
        largest = max(largest, stored_unit)
    if mistake == "all units at once":
        largest = everything
    if world > 1 or mistake == "buffers at world 1":
        reduce = "fp32" if mistake == "reduce None in fp32" and reduce_dtype is None else reduce_dtype
        out["all_gather"] = SIZE[param_dtype] * world * largest
        out["reduce_scatter"] = SIZE[reduce or param_dtype] * world * largest
    return out


def rank_bytes(*args):
    return counted(*args)


def with_mistake(mistake: str):
    def wrong(*args):
        return counted(*args, mistake=mistake)

    return wrong


def zero_style(units, root, world, rank, param_dtype, reduce_dtype, optimizer):
    """The Playbook's ZeRO-3 split, 2Ψ + 2Ψ + 12Ψ over N, with the buffers right."""
    right = counted(units, root, world, rank, param_dtype, reduce_dtype, optimizer)
    psi = sum(math.prod(s) for unit in [*units, root] for s in unit)
    return {
        **right,
        "sharded_params": 2 * psi / world,
        "gradients": 2 * psi / world,
        "optimizer_state": 12 * psi / world,
    }


def test_the_count_passes_on_fresh_models():
    passes("12.rank_bytes", rank_bytes, times=3)


def test_the_cases_cover_what_the_mistakes_need():
    cases = get_check("12.rank_bytes").cases(__import__("random").Random(0))
    assert {c["optimizer"] for c in cases} == {"adamw", "sgd", "sgd_momentum"}
    assert {c["reduce_dtype"] for c in cases} == {None, "fp32", "bf16"} and 1 in {c["world"] for c in cases}
    short = [c for c in cases if ch12._sizes(c)["short"] is not None]  # a rank holding fewer rows than it stores
    assert len(short) >= 3 and any(c["param_dtype"] == "bf16" and c["reduce_dtype"] is None for c in short)


@pytest.mark.parametrize(
    "mistake, named",
    [
        ("no padding", "forgot the padding: every rank stores ceil(d0/N) rows"),
        ("padded optimizer", "padded the optimizer state"),
        ("bf16 shards", "the sharded parameters stay fp32 under a bf16 policy"),
        ("reduce None in fp32", "reduce_dtype=None reduces in the gradients' dtype, which is param_dtype"),
        ("no step", "forgot AdamW's step"),
        ("floor split", "FSDP2 cuts dim 0 as torch.chunk does"),
        ("array_split", "FSDP2 cuts dim 0 as torch.chunk does"),
        ("all units at once", "one unit is gathered at a time"),
        ("buffers at world 1", "with world 1 FSDP2 runs no collective"),
    ],
)
def test_each_usual_mistake_fails_with_its_name(mistake, named):
    for seed in range(3):
        message = fails("12.rank_bytes", with_mistake(mistake), seed=seed)
        assert named in message, message


def test_the_gradients_padding_is_named_when_only_the_gradients_forget_it():
    def unpadded_grads(units, root, world, rank, *rest):
        right = counted(units, root, world, rank, *rest)
        return {**right, "gradients": counted(units, root, world, rank, *rest, mistake="no padding")["gradients"]}

    assert "view of its unit's padded reduce-scatter output" in fails("12.rank_bytes", unpadded_grads, seed=1)


def test_zero_style_16_psi_over_n_is_named():
    message = fails("12.rank_bytes", zero_style, seed=0)
    assert "ZeRO's split" in message and "16Ψ/N, ZeRO-3's total" in message, message


def test_a_hard_coded_answer_and_answers_of_the_wrong_shape_fail():
    assert "the rank holds" in fails("12.rank_bytes", lambda *a: dict.fromkeys(KEYS, 4096))
    assert "expected a dict with keys" in fails("12.rank_bytes", lambda *a: 4096)
    assert "lacks ['reduce_scatter']" in fails("12.rank_bytes", lambda *a: dict.fromkeys(KEYS[:4], 0))
    assert "expected a number" in fails("12.rank_bytes", lambda *a: dict.fromkeys(KEYS, "many"))


def test_the_untouched_exercise_is_not_attempted():
    def stub(*args):
        raise NotImplementedError("Exercise: write your solution here")

    assert verdict("12.rank_bytes", stub)[0] == "not attempted"
    # below the chapter's floor the check says first that it needs a newer torch
    assert verdict("12.fix_sharding", stub)[0] == ("not attempted" if torch_at_least(FLOOR) else "not graded")


def test_calling_the_chapters_predictor_is_refused_in_the_task_process():
    status, message = judged_cells(
        "12.rank_bytes",
        "from course_lib.chapters.ch12.shard_memory import predict_rank_bytes",
        "def rank_bytes(units, root, world, rank, param_dtype, reduce_dtype, optimizer):\n"
        "    return predict_rank_bytes(None, world, rank)",
    )
    assert status == "failed" and "course_lib.chapters.ch12" in message and "count it yourself" in message, message


# --------------------------------------------------------------------------- 12.fix_sharding

BF16, FP32 = torch.bfloat16, torch.float32


def sharded(model, mesh, *, cast=False, every=None, root=None, blocks=True):
    """fully_shard each block with policy `every` (if `blocks`), then the root with `root`."""
    if cast:
        model = model.to(BF16)
    for block in model.blocks if blocks else []:
        fully_shard(block, mesh=mesh, mp_policy=every or MixedPrecisionPolicy())
    fully_shard(model, mesh=mesh, mp_policy=root or MixedPrecisionPolicy())
    return model


BLOCKS = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
ROOT = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, output_dtype=FP32)
EVERYWHERE = MixedPrecisionPolicy(param_dtype=BF16, output_dtype=FP32)


def shard(model, mesh):
    return sharded(model, mesh, every=BLOCKS, root=ROOT)


@needs_floor
def test_the_fix_passes_and_the_probe_reports_what_it_made():
    case = get_check("12.fix_sharding").cases(__import__("random").Random(3))[0]
    report = probe.fix_sharding(case, shard)
    assert report["units"] == ["", *(f"blocks.{i}" for i in range(case["blocks"]))]
    assert {v["dtype"] for v in report["params"].values()} == {"float32"}
    assert all(v["sharded"] for v in report["params"].values()) and report["output"] == "float32"
    assert {v["weight"] for v in report["linears"].values()} == {"bfloat16"} and report["error"] is None
    assert max(report["unchanged"].values()) < 0.05  # the fp32 master took every small step
    assert not torch.distributed.is_initialized()  # the probe let its group go
    passes("12.fix_sharding", shard, times=1)


GIVEN = (  # the exercise's script: cast before sharding, output_dtype on every block
    lambda m, mesh: sharded(m, mesh, cast=True, every=EVERYWHERE, root=EVERYWHERE),
    ("no fp32 master", "set output_dtype only on the root's policy"),
)


@needs_floor
@pytest.mark.parametrize(
    "wrong, named",
    [
        GIVEN,
        (lambda m, mesh: sharded(m, mesh, cast=True, every=BLOCKS, root=ROOT), ("no fp32 master", "had not moved")),
        (lambda m, mesh: sharded(m, mesh, every=EVERYWHERE, root=EVERYWHERE), ("set output_dtype only on the root",)),
        (lambda m, mesh: sharded(m, mesh), ("the fix dropped mixed precision",)),
        (lambda m, mesh: sharded(m, mesh, root=ROOT, blocks=False), ("only the root was sharded",)),
        (lambda m, mesh: sharded(m, mesh, every=BLOCKS, root=BLOCKS), ("the model's output is bfloat16",)),
        (lambda m, mesh: sharded(m, mesh, every=BLOCKS, root=ROOT).to(BF16), ("cast before (or after) sharding",)),
    ],
    ids=["given", "cast-only", "output-everywhere", "no-mixed-precision", "root-only", "bf16-output", "cast-after"],
)
def test_each_wrong_fix_fails_with_its_name(wrong, named):
    status, message = verdict("12.fix_sharding", wrong)
    assert status == "failed" and all(n in message for n in named), message


@needs_floor
def test_a_shard_that_raises_fails_and_leaves_no_process_group():
    def broken(model, mesh):
        raise ValueError("no mesh for me")

    status, message = verdict("12.fix_sharding", broken)
    assert status == "failed" and "raised ValueError: no mesh for me" in message, message
    assert not torch.distributed.is_initialized()
