"""course_lib.chapters.ch12 (shard_memory, memory_worker, fake_world): FSDP2's bytes per rank, predicted and measured.

One real launch for the whole module (4 gloo processes: N = 4, 2 and 1 in sub-groups, three
configurations, FSDPMemTracker in every rank, about 20 s on 2 cores) and three fake-world
subprocesses (the chapter's model at N = 2 and 4; an odd-sized model at N = 3 and 8, played by its
last rank, whose shards are partly or wholly padding, with every optimizer and reduction; GPT-2
small at N = 8). The predictor must equal FSDPMemTracker to the byte in every one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.chapters.ch12.fake_world import (
    format_memory_rows,
    measure_real,
    model_on_meta,
    predict_fake,
    with_predictions,
)
from course_lib.chapters.ch12.memory_worker import REAL_CONFIGS
from course_lib.chapters.ch12.precision import FLOOR
from course_lib.chapters.ch12.shard_memory import (
    BLOCK_UNITS,
    BlockMLP,
    ddp_rank_bytes,
    predict_rank_bytes,
    shard_rows,
    unit_params,
    zero_rank_bytes,
)
from course_lib.device import torch_at_least

MEASURED = ("fp32", "bf16", "bf16-none")  # of REAL_CONFIGS
pytestmark = [
    pytest.mark.slow,  # a real torchrun launch and three fake-world processes: left out by make test-fast
    pytest.mark.skipif(not torch_at_least(FLOOR), reason=f"chapter 12 needs torch >= {FLOOR} (gloo's AVG)"),
]


@pytest.fixture(scope="module")
def real() -> list[dict]:
    # the configurations whose state or buffers differ (reshard_after_forward=False changes the peak only;
    # the notebook measures it)
    return with_predictions(measure_real(batch=64, nproc=4, configs=MEASURED))


@pytest.fixture(scope="module")
def fake() -> list[dict]:
    return with_predictions(predict_fake([2, 4], "block", configs=("fp32", "bf16"), batch=64))


def _find(rows: list[dict], **keys) -> list[dict]:
    return [r for r in rows if all(r[k] == v for k, v in keys.items())]


# --------------------------------------------------------------------------- arithmetic


def test_the_chapter_model_has_the_research_notes_sizes():
    model = BlockMLP()
    assert sum(p.numel() for p in model.parameters()) == 2_106_890
    assert sum(p.numel() for _, p in unit_params(model, BLOCK_UNITS)["blocks.0"]) == 526_080


def test_predictions_reproduce_the_research_notes_table():
    model = BlockMLP()
    one = predict_rank_bytes(model, 1, units=BLOCK_UNITS)
    assert (one["sharded_params"], one["optimizer_state"]) == (8_427_560, 16_855_224)
    assert (one["all_gather"], one["reduce_scatter"]) == (0, 0)  # one rank: FSDP2 runs no collective
    two = predict_rank_bytes(model, 2, units=BLOCK_UNITS, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert (two["sharded_params"], two["optimizer_state"]) == (4_213_780, 8_427_664)
    assert (two["all_gather"], two["reduce_scatter"]) == (1_052_160, 2_104_320)
    none = predict_rank_bytes(model, 2, units=BLOCK_UNITS, param_dtype=torch.bfloat16)
    assert none["reduce_scatter"] == 1_052_160  # reduce_dtype=None reduces in bf16 here
    last = predict_rank_bytes(model, 4, 3, units=BLOCK_UNITS)
    assert (last["sharded_params"], last["optimizer_state"]) == (2_107_404, 4_210_800)  # padded / unpadded


def test_shard_rows_follows_torch_chunk_and_pads_every_rank():
    assert [shard_rows(5, 4, r) for r in range(4)] == [(2, 2), (2, 2), (1, 2), (0, 2)]
    for d0, world in ((37, 8), (10, 4), (3, 8), (1024, 4)):
        chunks = torch.arange(d0).chunk(world)
        held = [shard_rows(d0, world, r)[0] for r in range(world)]
        assert held == [len(chunks[r]) if r < len(chunks) else 0 for r in range(world)]


def test_units_take_their_parameters_and_the_root_the_rest():
    owned = unit_params(BlockMLP(width=8, hidden=4, depth=2, classes=3), ["blocks.1"])
    assert [n for n, _ in owned[""]][0].startswith("blocks.0.") and owned[""][-1][0] == "head.bias"
    assert all(n.startswith("blocks.1.") for n, _ in owned["blocks.1"])


def test_ddp_holds_the_whole_state_on_every_rank():
    model = BlockMLP()
    ddp = ddp_rank_bytes(model)
    assert ddp["sharded_params"] == ddp["gradients"] == 4 * 2_106_890
    assert ddp["optimizer_state"] == 8 * 2_106_890 + 4 * len(list(model.parameters()))


def test_zero3_and_fsdp2_hold_sixteen_bytes_a_parameter_split_differently():
    psi = 1_000_000
    for n in (1, 8, 1024):
        z = zero_rank_bytes(psi, n)
        assert z["zero3"] == z["fsdp2"] == 16 * psi / n
        assert z["zero1"] >= z["zero2"] >= z["zero3"]
    assert zero_rank_bytes(psi, 1)["zero1"] == zero_rank_bytes(psi, 1)["ddp"] == 16 * psi


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"world": 2, "optimizer": "adam"}, "unknown optimizer"),
        ({"world": 2, "units": ["blocks.9"]}, "not a submodule"),
        ({"world": 2, "rank": 2}, "rank must be"),
        ({"world": 0}, "world >= 1"),
    ],
)
def test_bad_input_raises_a_clear_value_error(kwargs, says):
    with pytest.raises(ValueError, match=says):
        predict_rank_bytes(BlockMLP(), **kwargs)


def test_predict_fake_refuses_unknown_models_configs_and_optimizers():
    with pytest.raises(ValueError, match="unknown model"):
        predict_fake([2], "resnet")
    with pytest.raises(ValueError, match="unknown"):
        predict_fake([2], configs=("fp8",))
    with pytest.raises(ValueError, match="unknown"):
        predict_fake([2], optimizers=("lion",))


# --------------------------------------------------------------------------- measured


def test_every_rank_of_the_real_run_holds_what_was_predicted_to_the_byte(real):
    assert sorted({(r["world"], r["rank"]) for r in real}) == [(1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]
    assert {r["config"] for r in real} == set(MEASURED) and set(MEASURED) <= set(REAL_CONFIGS)
    for r in real:
        assert r["measured"] == r["predicted"], (r["world"], r["rank"], r["config"])


def test_the_real_peak_falls_with_n_and_its_moment_is_named(real):
    peaks = [_find(real, world=n, rank=0, config="fp32")[0]["peak"] for n in (1, 2, 4)]
    assert peaks[0] > peaks[1] > peaks[2]
    assert all(r["moment"].split(",")[0] in ("forward", "backward", "optimizer step") for r in real)
    for r in real:  # the peak is the sum of the tracker's categories then
        assert r["at_peak"]["Total"] == r["peak"] == sum(v for k, v in r["at_peak"].items() if k != "Total")


def test_the_fake_world_reproduces_the_real_runs(real, fake):
    """State and buffers to the byte; the peak a lower bound of every real rank's, and close to it.

    A real rank's peak can be higher than the schedule's own: a gloo collective that finishes late
    holds its buffers a little longer while the next unit computes (seen: up to 9% in bf16, and 2.4%
    in fp32, on a loaded machine). A fake collective returns at once, so no real rank holding what
    the fake rank holds peaks lower than the fake world (the last rank at N = 4 holds 4,112 B less
    optimizer state, and may); how much higher depends on the machine's load, so only a wide band is
    asserted (the notebook prints the gaps)."""
    for f in fake:
        reals = _find(real, world=f["world"], config=f["config"])
        assert f["measured"] == _find(reals, rank=0)[0]["measured"] == f["predicted"]
        lowest = min(r["peak"] for r in reals if r["measured"] == f["measured"])
        assert 0.8 * lowest <= f["peak"] <= lowest, (f["world"], f["config"], f["peak"], lowest)


def test_the_fake_world_matches_predictions_where_shards_are_padded():
    rows = predict_fake(
        [3, 8],
        "odd",
        configs=("fp32", "bf16-none", "fp32-reduce-bf16"),  # every dtype a buffer can have
        rank=7,
        batch=4,
        optimizers=("adamw", "sgd", "sgd_momentum"),
    )
    assert len(rows) == 2 * 3 * 3 and {r["rank"] for r in rows} == {2, 7}
    for r in with_predictions(rows):
        assert r["measured"] == r["predicted"], (r["world"], r["config"], r["optimizer"])
    assert not dist.is_initialized()  # the fake group lived in the subprocess only


def test_gpt2_small_predicted_for_eight_ranks_equals_the_fake_world():
    (row,) = with_predictions(predict_fake([8], "gpt2", configs=("bf16",), batch=1, seq=64))
    assert row["measured"] == row["predicted"]
    model, _ = model_on_meta("gpt2")
    assert row["measured"]["sharded_params"] * 8 >= 4 * sum(p.numel() for p in model.parameters())


def test_the_table_shows_each_row_and_whether_prediction_equals_measurement(fake):
    text = format_memory_rows(fake)
    assert len(text.splitlines()) == 1 + len(fake)
    assert " pred " in text.splitlines()[0] and "True" in text


def test_a_model_that_is_not_the_chapters_is_predicted_too():
    model = nn.Sequential(nn.Linear(37, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    got = predict_rank_bytes(model, 8, 7, units=["0"], optimizer="sgd_momentum")
    # "0": weight (5, 37) and bias (5): chunks of 1 row, rank 7 holds none; the root: 5, 5, 3x5, 3
    assert got["sharded_params"] == 4 * (37 + 1) + 4 * (1 + 1 + 5 + 1)
    assert got["optimizer_state"] == 0
    assert got["all_gather"] == 4 * 8 * (37 + 1) and got["reduce_scatter"] == got["all_gather"]
