"""course_lib.chapters.bench: the FP32 / TF32 / AMP step table and its CLI."""
import json

import pytest

from course_lib.chapters import bench


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
