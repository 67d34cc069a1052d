"""course_lib.chapters.ch09.recorded_profiles: the recorded GPU profiles read in words computed from their numbers."""

import pytest
import torch

from course_lib.chapters.ch09 import recorded_profiles as rp
from course_lib.reference import load_references


def _step(ms, gpu_us, kernels, **by_class):
    return {
        "ms_per_step": ms,
        "kernels": {"gpu_us_per_step": gpu_us, "kernels_per_step": kernels, "by_class_us": by_class},
    }


def test_a_host_bound_step_is_read_from_its_kernel_time_and_launches():
    text = " ".join(rp.read_host_bound({"fp32": _step(2.0, 1500, 50), "bf16": _step(3.0, 900, 70)}).split())
    assert "from 1.50 to 0.90 ms, yet the step went from 2.00 to 3.00 ms" in text
    assert "70 kernels instead of 50" in text and "not made faster by faster arithmetic" in text
    faster = " ".join(rp.read_host_bound({"fp32": _step(2.0, 1500, 50), "bf16": _step(1.5, 900, 70)}).split())
    assert "not made faster" not in faster  # the verdict follows the numbers


def test_the_batch_norm_gap_names_the_implementation_each_precision_ran():
    def prof(img_s, gpu_us, bn_us, op):
        return {
            "images_per_s": img_s,
            **_step(10, gpu_us, 100, **{"conv/gemm": 9000, "batch_norm": bn_us}),
            "ops": [{"op": op, "us": 100.0}, {"op": op + "_backward", "us": 900.0}, {"op": "aten::add_", "us": 5}],
        }

    text = " ".join(
        rp.read_batch_norm(
            {
                "fp16": prof(3500, 20000, 8000, "aten::cudnn_batch_norm"),
                "bf16": prof(2800, 26000, 14000, "aten::native_batch_norm"),
            }
        ).split()
    )
    assert "1.25x as fast" in text and "6.0 ms of GPU time" in text and "batch norm accounts for 6.0 ms" in text
    assert "in fp16 PyTorch runs aten::cudnn_batch_norm, in bf16 aten::native_batch_norm" in text


def test_the_recorded_h100_files_read_without_error_and_say_what_the_readme_says():
    refs = load_references("questions_h100-80gb-hbm3.json")
    if not refs:
        pytest.skip("no recorded profile")
    q = refs[0]
    assert "aten::native_batch_norm" in rp.read_batch_norm(q["resnet50"])
    mfu = " ".join(rp.read_mfu(q["gpt"]).split())
    assert "MFU 40.1%" in mfu
    # attention's rate counts the causal half its kernels compute, beside the MFU formula's full count
    assert "attention at 249 TFLOP/s (25%) counting the causal half" in mfu and "498 by the MFU formula" in mfu
    shapes = load_references("roofline_h100-80gb-hbm3.json")[0]["shapes"]
    padded = "bf16: 47 more vocabulary columns (50,304) made the output layer 4.9x faster"
    assert padded in rp.read_vocab_padding(shapes)


def test_checkpointing_is_read_in_gib_not_in_percentages_of_different_bases():
    rows = [
        {"saved_mib": 8.45 * 1024, "peak_memory_gib": 16.05, "ms_per_step": 100.0},
        {"saved_mib": 3.78 * 1024, "peak_memory_gib": 11.37, "ms_per_step": 118.0},
    ]
    text = " ".join(rp.read_checkpointing(rows).split())
    assert "(4.67 GiB less)" in text and "(4.68 GiB less)" in text and "x1.18" in text
    assert "removed them" in text
    partial = [{**rows[0]}, {**rows[1], "peak_memory_gib": 15.0}]
    assert "removed them" not in rp.read_checkpointing(partial)  # 1.05 of 4.67 GiB: the words follow
    cpu = [{k: v for k, v in r.items() if k != "peak_memory_gib"} for r in rows]
    assert "peak" not in rp.read_checkpointing(cpu)


def test_vocab_padding_times_both_vocabularies():
    times = rp.vocab_padding_times(tokens=4, width=8)
    assert set(times) == {50257, 50304} and all(t > 0 for t in times.values())
    assert all(t > 0 for t in rp.vocab_padding_times(tokens=4, width=8, dtype=torch.bfloat16).values())


def test_a_recorded_test_run_gives_the_chapter_s_time_and_its_slow_cells():
    ref = {
        "notebooks": {
            "notebooks/09_x.ipynb": {
                "total_s": 147.2,
                "cells": [
                    {
                        "seconds": 93.2,
                        "gpu_tag": True,
                        "first_line": "from course_lib.chapters.ch09.ladder import resnet50",
                    },
                    {"seconds": 0.4, "first_line": "import torch"},
                    {"seconds": 4.1, "first_line": "print(1)"},
                ],
            }
        }
    }
    lines = rp.read_cell_times(ref, "notebooks/09_x.ipynb").splitlines()
    assert lines[0] == "notebooks/09_x.ipynb: 147 s in all; the cells over a second:" and len(lines) == 3
    assert lines[1].split()[:3] == ["93.2", "s", "(gpu)"] and "(gpu)" not in lines[2]
    assert "not in this record" in rp.read_cell_times(ref, "notebooks/10_y.ipynb")
    recorded = load_references("celltimes_*.json")
    if recorded:
        assert "s in all" in rp.read_cell_times(recorded[0], "notebooks/09_capstone.ipynb")


def test_fp8_is_read_against_bf16_alone_and_with_its_casts():
    gemms = [
        {
            "what": "square",
            "m": 8192,
            "k": 8192,
            "n": 8192,
            "bf16_ms": 1.6,
            "tensorwise_ms": 0.8,
            "tensorwise_with_cast_ms": 3.2,
        },
        {"what": "qkv", "m": 16, "k": 16, "n": 16, "bf16_ms": 1.0, "tensorwise_error": "not supported here"},
    ]
    gpt = {
        "rows": [
            {"recipe": "bf16", "batch": 16, "seq": 1024, "ms_per_step": 37.0, "losses": [7.0] * 5},
            {"recipe": "tensorwise", "batch": 16, "seq": 1024, "ms_per_step": 44.0, "losses": [6.9] * 5},
            {"recipe": "rowwise", "note": "skipped"},
        ]
    }
    lines = rp.read_fp8(gemms, gpt).splitlines()
    assert len(lines) == 4  # a matmul fp8 could not run, and a skipped recipe, leave no row
    assert lines[1].split()[-2:] == ["2.00x", "0.50x"]
    assert "x0.84" in lines[3] and "loss at the end 6.900" in lines[3]
