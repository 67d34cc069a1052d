"""course_lib.chapters.ch12 (precision, precision_worker): chapter 12's precision experiments, measured.

One real launch for the whole module (torchrun, 4 gloo processes, about 15 s on 2 cores): the dtypes of
FSDP2's bf16 policy against autocast, the bytes saved for backward, the four traps, gradients against one
process (FSDP2 at N = 2 and 4, HSDP 2x2), tensor parallelism. The rest is fast: the instruments on one
process, the formatters, the recorded figures.
"""

from __future__ import annotations

import pytest
import torch

from course_lib.chapters.ch12.precision import (
    FLOOR,
    RECORDED_FP8,
    PrecisionNet,
    format_correctness,
    format_dtype_table,
    format_recorded_fp8,
    format_saved_activations,
    format_tp_vs_fsdp,
    format_traps,
    run_precision_experiments,
    saved_tensor_bytes,
    weight_shapes,
)
from course_lib.device import torch_at_least

pytestmark = [
    pytest.mark.slow,  # a real torchrun launch: left out by make test-fast
    pytest.mark.skipif(not torch_at_least(FLOOR), reason=f"chapter 12 needs torch >= {FLOOR} (gloo's AVG)"),
]


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    return run_precision_experiments(progress=False, out=tmp_path_factory.mktemp("precision"))


# --------------------------------------------------------------------------- the launch


def test_every_rank_reports_and_gloo_avg_averages_on_a_torch_past_the_floor(result):
    assert len(result["fp16_scaler"]["ranks"]) == 4
    if torch_at_least(FLOOR):
        assert result["avg_factor"]["world of 4"]["reduce_scatter"] == 1.0
        assert result["avg_factor"]["pair"]["reduce_scatter"] == 1.0


def test_fsdp2_gradients_equal_one_process_at_two_and_four_ranks_and_under_hsdp(result):
    rows = {(r["layout"], r["ranks"]): r for r in result["correctness"]["rows"]}
    for key in (("FSDP2 fp32", 2), ("FSDP2 fp32", 4), ("HSDP 2x2", 4)):
        assert rows[key]["rel_diff"] < 1e-5, (key, rows[key])
    assert "Replicate()" in rows[("HSDP 2x2", 4)]["what"]


def test_tensor_parallel_block_output_equals_one_process(result):
    tp = next(r for r in result["correctness"]["rows"] if r["layout"].startswith("TP"))
    assert tp["rel_diff"] < 1e-5


def test_the_bf16_policy_keeps_fp32_master_shards_and_computes_in_bf16(result):
    rows = {r["tensor"]: r for r in result["dtypes"]["rows"]}
    assert rows["fc1 weight in forward"]["fsdp2"] == "bfloat16"
    assert rows["fc1 weight in forward"]["autocast"] == "float32"
    assert rows["LayerNorm input"] == {"tensor": "LayerNorm input", "fsdp2": "bfloat16", "autocast": "float32"}
    assert rows["parameter the optimizer updates"]["fsdp2"].startswith("float32 (DTensor shard")
    assert rows["gradient the optimizer reads"]["fsdp2"].startswith("float32")
    assert rows["gradient reduce-scatter buffer"]["fsdp2"] == "float32"
    assert rows["AdamW exp_avg"]["fsdp2"] == "float32"
    assert rows["model output"]["fsdp2"] == "float32"  # output_dtype on the root


def test_the_bf16_policy_saves_smaller_activations_than_autocast_which_keeps_fp32_ones(result):
    saved = {r["mode"]: r["bytes"] for r in result["saved"]["rows"]}
    fsdp, auto = saved["FSDP2 bf16 policy, per rank"], saved["autocast bf16, one process"]
    assert auto.get("float32", 0) > 0 and fsdp.get("float32", 0) == 0
    assert sum(fsdp.values()) < sum(auto.values()) < sum(saved["fp32, one process"].values())


def test_reduce_dtype_none_reduces_in_half_the_bytes_on_this_torch(result):
    runs = result["reduce_dtype"]["runs"]
    assert runs["float32"]["dtype"] == "float32"
    # what None means is read from the installed torch: the compute dtype here, fp32 where it follows grad_dtype
    if runs["None"]["dtype"] == "bfloat16":
        assert runs["None"]["bytes"] * 2 == runs["float32"]["bytes"]
    assert "reduce_dtype" in result["reduce_dtype"]["docstring"]


def test_a_model_cast_to_bf16_before_sharding_freezes_most_weights_and_fp32_shards_freeze_none(result):
    runs = result["frozen"]["runs"]
    assert runs["bf16 model, then fully_shard"]["unchanged"] > 0.5
    assert runs["bf16 model, then fully_shard"]["shard_dtype"] == "bfloat16"
    assert runs["fp32 model, bf16 policy"]["unchanged"] == 0.0


def test_output_dtype_on_every_block_breaks_the_root_head_and_on_the_root_works(result):
    trap = result["output_dtype"]
    assert "mat1 and mat2 must have the same dtype" in trap["on every block"]["error"]
    assert trap["on the root only"] == {"error": None, "output": "float32"}


def test_one_inf_on_one_rank_makes_every_rank_skip_and_halve_its_scale(result):
    ranks = result["fp16_scaler"]["ranks"]
    assert sum(r["inf_written"] for r in ranks) == 2  # pair-rank 1 of each pair: ranks 1 and 3
    for r in ranks:
        assert r["unchanged"], r
        assert (r["scale_before"], r["scale_after"]) == (1024.0, 512.0), r


def test_tp_divides_the_hidden_activations_per_rank_where_fsdp_divides_only_the_parameters(result):
    rows = {r["layout"]: r for r in result["tp_vs_fsdp"]["rows"]}
    one, fsdp, tp = rows["one process"], rows["FSDP2, 2 ranks"], rows["TP, 2 ranks"]
    assert fsdp["activation_bytes"] == one["activation_bytes"]
    assert tp["activation_bytes"] < one["activation_bytes"]
    assert tp["fc1_out"][1] * 2 == one["fc1_out"][1]
    assert fsdp["param_bytes"] < one["param_bytes"] and tp["param_bytes"] < one["param_bytes"]


def test_the_formatters_print_every_experiment(result):
    texts = [
        format_dtype_table(result),
        format_saved_activations(result),
        format_traps(result),
        format_correctness(result),
        format_tp_vs_fsdp(result),
    ]
    assert "LayerNorm input" in texts[0] and "autocast" in texts[1] and "mat1 and mat2" in texts[2]
    assert "HSDP 2x2" in texts[3] and "TP, 2 ranks" in texts[4]
    assert all(len(line) <= 100 for text in texts for line in text.splitlines())


# --------------------------------------------------------------------------- fast: one process


def test_saved_tensor_bytes_leaves_weights_out_and_counts_activations_per_dtype():
    model = PrecisionNet()
    x = torch.randn(12, 32)
    with saved_tensor_bytes(weight_shapes(model)) as found:
        model(x)
    # per block: LayerNorm's input, mean and rstd, fc1's input, GELU's input, fc2's input; then the head's input
    per_block = 4 * (12 * 32 + 12 + 12 + 12 * 32 + 12 * 128 + 12 * 128)
    assert found == {"float32": 2 * per_block + 4 * 12 * 32}


def test_the_recorded_fp8_figures_are_labelled_with_their_source():
    text = format_recorded_fp8()
    assert "recorded by others" in text and RECORDED_FP8["source"] in text
    assert "7,186" in text and "42.1" in text and "47.65" in text
