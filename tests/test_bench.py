"""course_lib.chapters.ch00.bench: the FP32 / TF32 / AMP step table and its CLI."""

import json

import pytest
import torch

from course_lib.chapters.ch00 import bench


def test_cli_prints_table_with_spread_and_writes_json_with_provenance(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--model", "mlp", "--batch", "16", "--steps", "3", "--device", "cpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "FP32 (strict)" in text and "AMP" in text and "middle half" in text
    data = json.loads(out.read_text())
    assert {"device", "torch", "date", "command"} <= set(data["provenance"])
    timed = [r for r in data["rows"] if "ms_per_step" in r]
    assert timed[0]["speedup_vs_fp32"] == 1.0
    assert all(r["ms_q1"] <= r["ms_per_step"] <= r["ms_q3"] for r in timed)


def test_on_a_cpu_tf32_is_a_labelled_skip_and_there_is_no_channels_last_row():
    rows = bench.precision_table(model="mlp", batch=8, steps=2, device="cpu")
    assert [r["mode"] for r in rows][:2] == ["FP32 (strict)", "TF32"]
    assert "sm_80" in rows[1]["note"] and "ms_per_step" not in rows[1]
    assert not any("channels_last" in r["mode"] for r in rows)
    assert rows[2]["precision"] in ("bf16", "fp16")


def test_a_gpu_sized_model_is_refused_on_a_cpu():
    with pytest.raises(ValueError, match="sized for a GPU"):
        bench.precision_table(model="resnet50", device="cpu")


def _row(mode, times):
    return {"mode": mode, "ms_per_step": sorted(times)[len(times) // 2], "times_ms": times}


def test_read_table_says_faster_or_slower_by_the_factor_and_compares_with_the_spread():
    base = _row("FP32 (strict)", [95.0, 98.0, 100.0, 102.0, 105.0])
    text = bench.read_table([base, {"mode": "TF32", "note": "skipped"}, _row("AMP bf16", [48, 49, 50, 51, 52])])
    assert "2.00x faster" in text and "larger than the spread" in text and "TF32" not in text
    text = bench.read_table([base, _row("AMP bf16", [99.0, 101.0, 104.0, 106.0, 110.0])])
    assert "1.04x slower" in text and "within the spread" in text
    assert all(len(line) <= 100 for line in text.splitlines())


@pytest.mark.parametrize("flags, expect", [(["avx512_bf16"], "natively"), ([], "in software")])
def test_compare_runs_reads_the_measured_times_and_this_cpu(monkeypatch, flags, expect):
    monkeypatch.setattr(bench, "cpu_bf16_flags", lambda: flags)
    text = bench.compare_runs({"fp32": 10.0, "bf16": 4.0}, "cpu")
    assert "bf16 was 2.50x faster" in text and expect in text and "spread" in text
    assert "bf16 was 2.00x slower" in bench.compare_runs({"fp32": 10.0, "bf16": 20.0}, "cpu")
    assert all(len(line) <= 100 for line in text.splitlines())


@pytest.mark.parametrize("flags, precision", [(["amx_bf16"], "bf16"), ([], "bf16")])
def test_mixed_precision_for_a_cpu_is_always_a_16_bit_type(monkeypatch, flags, precision):
    import course_lib.device as D

    monkeypatch.setattr(D, "cpu_bf16_flags", lambda cpuinfo=None: flags)
    assert D.mixed_precision_for("cpu") == precision


def test_the_amp_step_picture_has_its_three_colours_in_a_legend_inside_the_axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = bench.draw_amp_step()
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["fp32 (32 bits)", "16 bits (fp16 or bf16)", "fp16 only: loss scaling by S"]
    assert len(ax.patches) >= 16  # 8 boxes and 8 arrows
    plt.close(fig)


@pytest.mark.parametrize(
    "cc, native, expect",
    [
        ((7, 5), False, "sm_75) has fp16 Tensor Cores"),
        ((8, 0), True, "sm_80) has bf16 Tensor Cores"),
        ((6, 1), False, "sm_61) has no Tensor Cores"),
    ],
)
def test_compare_runs_on_a_gpu_names_its_tensor_cores(monkeypatch, cc, native, expect):
    monkeypatch.setattr(bench, "cuda_capability", lambda dev=None: cc)
    monkeypatch.setattr(bench, "has_native_bf16", lambda dev=None: native)
    text = bench.compare_runs({"fp32": 3.0, "fp16": 1.0}, "cuda")
    assert "fp16 was 3.00x faster" in text and expect in text


def test_a_cuda_step_row_is_timed_with_cudnn_autotuning_on_and_restores_the_flag(monkeypatch):
    # The ResNet-50 targets assume cudnn.benchmark (fixed shapes: the fastest convolution algorithm is
    # picked in the warm-up). The row must time with it on, on CUDA only, and leave the flag as it was.
    seen = {}

    class FakeTrainer:
        def __init__(self, model, optimizer, cfg):
            pass

        def train_step(self, batches):
            seen.setdefault("benchmark", torch.backends.cudnn.benchmark)

    monkeypatch.setattr(bench, "synthetic_batches", lambda *a, **k: [(torch.zeros(2, 1, 28, 28), torch.zeros(2))])
    monkeypatch.setattr(bench, "Trainer", FakeTrainer)
    monkeypatch.setattr(bench, "peak_memory_bytes", lambda step, device: step() or 0)
    monkeypatch.setattr(bench, "time_fn", lambda step, **k: (step(), bench.Timing([1.0]))[1])
    # autotune=False (the largest-batch probe, which times nothing): cuDNN's heuristics, even on CUDA
    for device, autotune, expected in (("cuda", True, True), ("cpu", True, False), ("cuda", False, False)):
        seen.clear()
        before = torch.backends.cudnn.benchmark
        bench.step_row("simplecnn", "fp32", torch.device(device), batch=2, steps=1, autotune=autotune)
        assert seen["benchmark"] is expected and torch.backends.cudnn.benchmark == before
