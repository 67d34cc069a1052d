"""course_lib.chapters.ch01.matmul: matmul error against float64, the datasheet peaks and their ratios."""

import pytest
import torch

from course_lib.chapters.ch01 import matmul as M


def test_cpu_matmul_accumulates_in_high_precision_and_a_16_bit_accumulator_does_not():
    for fmt in ["fp16", "bf16"]:
        floor = M.matmul_error(4096, fmt, method="inputs")
        assert M.matmul_error(4096, fmt) < 1.5 * floor
        assert M.matmul_error(4096, fmt, method="naive") > 3 * M.matmul_error(64, fmt, method="naive")
        assert M.matmul_error(4096, fmt, method="naive") > 3 * floor
    assert M.matmul_error(1024, "fp32") < 1e-6
    with pytest.raises(ValueError, match="method"):
        M.matmul_error(16, "fp16", method="fast")
    with pytest.raises(ValueError, match="not a dtype"):
        M.matmul_error(16, "tf32")


def test_matmul_table_on_cpu_has_no_tf32_column_and_restores_both_reduction_flags():
    flags = torch.backends.cuda.matmul
    before = flags.allow_fp16_reduced_precision_reduction, flags.allow_bf16_reduced_precision_reduction
    rows = M.matmul_table(ks=(64,), device="cpu")
    columns = [c for c in rows[0] if c != "K"]
    assert columns == ["fp32", "fp16", "fp16 RR off", "fp16 floor", "bf16", "bf16 RR off", "bf16 floor"]
    assert all(0 <= rows[0][c] < 0.01 for c in columns)
    assert (flags.allow_fp16_reduced_precision_reduction, flags.allow_bf16_reduced_precision_reduction) == before
    text = M.matmul_table_text(rows)
    assert "bf16 RR off" in text and "TF32" not in text


def test_matmul_table_text_puts_modes_in_rows_and_fits_100_characters():
    modes = ["fp32", "fp32 TF32", "fp16", "fp16 RR off", "fp16 floor", "bf16", "bf16 RR off", "bf16 floor"]
    rows = [{"K": k, **{m: 1e-3 * i for i, m in enumerate(modes)}} for k in (256, 4096, 65536)]
    lines = M.matmul_table_text(rows).splitlines()
    assert [line.split("  ")[0].strip() for line in lines[1:]] == modes
    assert "K = 65536" in lines[0] and max(map(len, lines)) <= 100
    assert lines[2].split()[-3:] == ["1.00e-03"] * 3  # "fp32 TF32": one value per K


def test_peak_ratios_come_from_the_device_table_with_no_tensor_core_path_as_none():
    from course_lib.chapters.ch01.matmul import PEAK_TFLOPS

    rows = {r["gpu"]: r for r in M.peak_ratios()}
    assert set(rows) == set(PEAK_TFLOPS) and set(M.FP8_PEAK_TFLOPS) <= set(PEAK_TFLOPS)
    assert rows["H100 SXM"]["bf16/fp32"] == pytest.approx(989.4 / 66.9) == pytest.approx(14.8, abs=0.05)
    assert rows["H100 SXM"]["fp8/bf16"] == pytest.approx(2.0, abs=0.01)
    for gpu in ("T4", "V100 SXM2", "V100 PCIe"):  # fp16 Tensor Cores only: bf16 and TF32 have no path
        assert rows[gpu]["bf16/fp32"] is None and rows[gpu]["tf32/fp32"] is None and rows[gpu]["fp16/fp32"] > 1
        assert rows[gpu]["fp8/bf16"] is None
    assert rows["H100 PCIe"]["fp8/bf16"] == "n/a"  # has fp8 Tensor Cores, but no figure is cited
    text = M.peak_ratios_text()
    assert max(map(len, text.splitlines())) <= 100
    t4 = next(line for line in text.splitlines() if line.startswith("T4 "))
    assert t4.count("no Tensor Core path") == 3 and "8.0×" in t4
