"""course_lib.bench: peak table lookup, timing, saved-activation accounting, the CLI."""
import json

import pytest
import torch

from course_lib import bench


@pytest.mark.parametrize("name, key", [
    ("Tesla T4", "T4"), ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H200", "H200"), ("NVIDIA L4", "L4"), ("NVIDIA A10", "A10"),
    ("NVIDIA H100 NVL", None), ("NVIDIA A10G", None), ("NVIDIA GeForce RTX 4090", None),
])
def test_gpu_names_map_to_peaks_or_unknown(name, key):
    assert bench.gpu_key(name) == key


def test_t4_has_no_bf16_peak_and_mfu_is_unknown_for_unknown_gpus():
    assert bench.peak_tflops("Tesla T4", "bf16") is None
    assert bench.mfu(100.0, "Some Future GPU", "bf16") is None
    assert bench.mfu(494.7, "NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(0.5)


def test_time_fn_runs_warmup_plus_iters_and_reports_median():
    calls = []
    t = bench.time_fn(lambda: calls.append(1), warmup=2, iters=5, device="cpu")
    assert len(calls) == 7 and len(t.times_ms) == 5 and t.median_ms >= 0


def test_saved_activation_bytes_halve_under_bf16_autocast():
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    fp32 = bench.saved_activation_bytes(lambda: lin(x).relu().sum())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = bench.saved_activation_bytes(lambda: lin(x).relu().sum())
    assert fp32 > 0 and bf16 < 0.75 * fp32


def test_tf32_context_restores_previous_settings():
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    with bench.tf32(True):
        assert torch.get_float32_matmul_precision() == "high"
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before


def test_cli_prints_table_and_writes_json_with_provenance(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--model", "mlp", "--batch", "16", "--steps", "2", "--device", "cpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "FP32 (strict)" in text and "AMP" in text
    data = json.loads(out.read_text())
    assert {"device", "torch", "date", "command"} <= set(data["provenance"])
    assert data["rows"][0]["speedup_vs_fp32"] == 1.0


def test_matmul_table_on_cpu_skips_tf32_and_reports_positive_throughput():
    rows = bench.matmul_speed_table(n=64, device="cpu", iters=2)
    assert [r["dtype"] for r in rows] == ["fp32 (strict)", "fp16", "bf16"]
    assert all(r["tflops"] > 0 and r["peak_tflops"] is None for r in rows)
    assert "TFLOP/s" in bench.format_matmul_speed(rows)


def test_matmul_tflops_counts_two_n_cubed_flops(monkeypatch):
    monkeypatch.setattr(bench, "time_fn", lambda *a, **k: bench.Timing([2.0]))  # 2 ms per call
    assert bench.matmul_tflops(1000, torch.float32, "cpu") == pytest.approx(2e9 / 2e-3 / 1e12)
