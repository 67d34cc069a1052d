"""course_lib.chapters.ch02.matmul_speed: TFLOP/s per dtype on this device, next to the datasheet peak."""

import json

import pytest
import torch

from course_lib.chapters.ch02 import matmul_speed as M
from course_lib.timing import Timing


def test_speed_table_on_cpu_skips_tf32_and_reports_positive_throughput():
    rows = M.matmul_speed_table(n=64, device="cpu", iters=2)
    assert [r["dtype"] for r in rows] == ["fp32 (strict)", "fp16", "bf16"]
    assert all(r["tflops"] > 0 and r["peak_tflops"] is None and r["spread"] >= 0 for r in rows)
    assert "TFLOP/s" in M.format_matmul_speed(rows)


def test_matmul_tflops_counts_two_n_cubed_flops(monkeypatch):
    monkeypatch.setattr(M, "time_fn", lambda *a, **k: Timing([2.0, 2.0, 2.0]))  # 2 ms per call
    tflops, spread = M.matmul_tflops(1000, torch.float32, "cpu")
    assert tflops == pytest.approx(2e9 / 2e-3 / 1e12) and spread == 0


def test_cli_records_rows_with_provenance(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert M.main(["--n", "32", "--device", "cpu", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    command = f"python -m course_lib.chapters.ch02.matmul_speed --n 32 --device cpu --json {out}"
    assert data["provenance"]["command"] == command
    assert [r["dtype"] for r in data["rows"]] == ["fp32 (strict)", "fp16", "bf16"]
