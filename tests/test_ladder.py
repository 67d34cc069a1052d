"""course_lib.chapters.ch09.ladder: every rung runs at toy size on a CPU; targets are computed, not typed."""

import json

import pytest
import torch

from course_lib.chapters.ch09 import ladder, parity, rungs, targets


def test_resnet50_ladder_times_every_rung_this_machine_can_run_and_says_why_not_the_others(monkeypatch):
    # ResNet-50 has 25M parameters: even at 32 px a CPU step takes about a second, and each row
    # warms up first. The rows' logic is tested here with bench.step_row (tested in test_bench.py)
    # replaced by a stand-in that records what it was asked to time.
    asked = []

    def step_row(model, precision, device, *, batch, steps, allow_tf32=False, channels_last=False, shape=None):
        asked.append((model, precision, channels_last, shape))
        ms = {"fp32": 40.0, "bf16": 20.0}[precision] * (0.9 if channels_last else 1.0)
        return {
            "precision": precision,
            "tf32": allow_tf32,
            "channels_last": channels_last,
            "model": model,
            "batch": batch,
            "steps": steps,
            "ms_per_step": ms,
            "ms_q1": ms,
            "ms_q3": ms,
            "times_ms": [ms],
            "samples_per_s": batch / ms * 1e3,
            "peak_memory_gib": None,
        }

    monkeypatch.setattr(ladder, "step_row", step_row)
    monkeypatch.setattr(ladder, "has_native_bf16", lambda dev: True)
    rows = ladder.resnet50_ladder("cpu", batch=2, steps=1, image_size=32)
    assert asked == [("resnet50", p, cl, (3, 32, 32)) for p in ("fp32", "bf16") for cl in (False, True)]
    assert [r["mode"] for r in rows] == [
        f"{p}{cl}" for p in ("FP32 (strict)", "TF32", "AMP bf16", "AMP fp16") for cl in ("", " + channels_last")
    ]
    assert all("sm_80" in r["note"] for r in rows if r["mode"].startswith("TF32"))
    assert all("fp16 convolution" in r["note"] for r in rows if r["mode"].startswith("AMP fp16"))  # minutes on a CPU
    timed = [r for r in rows if "ms_per_step" in r]
    assert timed[0]["speedup"] == 1.0 and timed[0]["image_size"] == 32  # a toy on a CPU, never 224 px
    assert [round(r["speedup"], 2) for r in timed] == [1.0, 1.11, 2.0, 2.22]
    assert all(len(line) <= 100 for line in rungs.format_rows(rows).splitlines())
    monkeypatch.setattr(ladder, "has_native_bf16", lambda dev: False)
    rows = ladder.resnet50_ladder("cpu", batch=2, steps=1)
    assert all("emulated" in r["note"] for r in rows if r["mode"].startswith("AMP bf16"))
    assert asked[-1][3] == (3, 64, 64)  # the CPU's default toy size


def test_course_ladder_adds_one_change_per_rung_and_skips_compiling_on_a_cpu():
    rows = rungs.course_ladder("cpu", batch=4, steps=1)
    assert [r["mode"].split(" (")[0] for r in rows] == [
        "fp32, DataLoader",
        f"+ AMP {rows[1].get('precision', 'bf16')}",
        "+ channels_last",
        "+ fused AdamW",
        "+ torch.compile",
        "+ workers, pinned",
        "+ data on the device",
    ]
    assert all("compiling takes minutes" in r["note"] for r in rows[4:6]) and rows[6]["mode"].endswith("(eager)")
    timed = [r for r in rows if "ms_per_step" in r]
    assert len(timed) == 5 and timed[0]["speedup"] == 1.0 and timed[0]["precision"] == "fp32"
    assert all(r["samples_per_s"] > 0 and 0 <= r["data_wait"] <= 1 for r in timed)
    assert [r["feed"] for r in timed] == ["loader"] * 4 + ["device"]


def test_accuracy_parity_trains_two_seeds_and_mixed_precision_and_reads_them():
    runs = parity.accuracy_parity("cpu", train_size=64, test_size=40, epochs=1, batch=32, width=4)
    assert list(runs)[:2] == ["fp32, seed 0", "fp32, seed 1"] and list(runs)[2].endswith("seed 0")
    assert all(len(h.eval) == 1 and len(h.loss) == 2 for h in runs.values())
    text = parity.read_parity(runs)
    assert "seed-to-seed noise" in text and all(len(line) <= 100 for line in text.splitlines())


def test_gpt_ladder_adds_one_change_per_rung_and_skips_compiling_on_a_cpu():
    rows = ladder.gpt_ladder("cpu", batch=1, seq=8, steps=1)
    modes = [r["mode"] for r in rows]
    assert modes[0] == "FP32 (strict)" and modes[3] == "+ SDPA attention" and modes[-1] == "+ fused AdamW"
    compiled = [r for r in rows if "compile" in r["mode"] or "fused" in r["mode"]]
    assert all("compiling takes minutes" in r["note"] for r in compiled)
    timed = [r for r in rows if "ms_per_step" in r]
    assert len(timed) >= 3 and all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in timed)  # no CPU peak


def test_optimizer_and_checkpointing_tables_measure_what_they_say():
    opt = ladder.optimizer_table("cpu", steps=1)
    assert [r["mode"] for r in opt] == ["AdamW for-loop", "AdamW foreach", "AdamW fused"]
    ckpt = ladder.checkpointing_table("cpu", steps=1)
    kept, recomputed = ckpt[0]["saved_mib"], ckpt[1]["saved_mib"]
    assert recomputed < kept  # checkpointing keeps only each block's input


def test_the_resnet50_ladder_times_only_the_modes_asked_for():
    rows = ladder.resnet50_ladder("cpu", batch=2, steps=1, image_size=32, modes=("FP32 (strict)", "TF32"))
    assert [r["mode"] for r in rows] == ["FP32 (strict)", "TF32"]
    assert "ms_per_step" in rows[0] and "note" in rows[1]  # TF32 needs an Ampere GPU: kept, with the reason


def test_compiled_rungs_are_measured_only_where_compiling_is_quick(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(rungs.os, "cpu_count", lambda: 2)  # Colab's 2 vCPUs: minutes per cold compile
    assert not rungs.compiles_quickly(cuda) and not rungs.compiles_quickly(cpu)
    assert rungs.compiles_quickly(cpu, compile_on_cpu=True)
    monkeypatch.setattr(rungs.os, "cpu_count", lambda: 16)
    assert rungs.compiles_quickly(cuda) and not rungs.compiles_quickly(cpu)


def test_largest_batch_is_a_gpu_measurement():
    assert ladder.largest_batch("bf16", device="cpu")["largest_batch"] is None


def _row(mode, img_s, mem, channels_last=False):
    return {
        "mode": mode,
        "ms_per_step": 1000 / img_s,
        "samples_per_s": img_s,
        "peak_memory_gib": mem,
        "channels_last": channels_last,
    }


def test_targets_are_ratios_of_measured_rows_like_for_like():
    rows = [
        _row("FP32 (strict)", 800, 20.0),
        _row("FP32 (strict) + channels_last", 780, 20.1, True),
        _row("TF32", 1500, 20.0),
        _row("TF32 + channels_last", 2000, 20.1, True),
        _row("AMP bf16", 2600, 12.0),
        _row("AMP bf16 + channels_last", 3000, 12.5, True),
        _row("AMP fp16 + channels_last", 3600, 12.5, True),
    ]
    gpt = [
        {"mode": "FP32 (strict)", "ms_per_step": 9, "mfu": 0.5},
        {"mode": "+ fused AdamW", "ms_per_step": 1, "mfu": 0.30},
        {"mode": "x", "note": "skipped"},
    ]
    course = [
        {"feed": "loader", "data_wait": 0.5, "samples_per_s": 10},
        {"feed": "workers", "data_wait": 0.04, "samples_per_s": 30},
        {"feed": "device", "data_wait": 0.0, "samples_per_s": 50},
    ]
    goals = list(targets.targets(rows, gpt, course))
    speed, vs_fp32, vs_tf32, memory, mfu, wait = goals
    # the rung the target names (bf16 + channels_last), not the fastest AMP row (fp16 here)
    assert speed["goal"] == "ResNet-50 AMP bf16 + channels_last, images/s" and speed["value"] == 3000
    assert speed["met"] and speed["stretch_met"] is False  # 3,000 < 3,200
    # AMP and its baseline in the same layout: channels_last speeds up TF32 too
    assert vs_fp32["goal"].endswith("channels_last") and vs_fp32["value"] == pytest.approx(3000 / 780)
    assert vs_tf32["value"] == pytest.approx(1.5) and vs_tf32["met"] is False  # 3000 / 2000, not 3000 / 1500
    assert memory["value"] == pytest.approx(0.6)  # same batch, NCHW
    assert mfu["value"] == 0.30 and mfu["met"] is False  # the last rung, not a better-looking earlier one
    assert wait["value"] == 0.04 and wait["met"] is True  # data on the device (0.0) is no DataLoader
    # a table without channels_last baselines (chapter 00's) compares in NCHW
    nchw = list(targets.targets([r for r in rows if not r["channels_last"] or r["mode"].startswith("AMP bf16")]))
    assert nchw[1]["goal"].endswith("NCHW") and nchw[1]["value"] == pytest.approx(2600 / 800)
    # fp16 is the AMP rows' type where no bf16 row was timed (a T4)
    t4 = [
        _row("FP32 (strict)", 100, 10.0),
        _row("AMP fp16", 300, 6.0),
        _row("AMP fp16 + channels_last", 320, 6.0, True),
    ]
    assert list(targets.targets(t4))[0]["goal"].startswith("ResNet-50 AMP fp16")
    cpu = list(targets.targets([_row("FP32 (strict)", 10, None)]))
    assert cpu[0]["met"] is None and "n/a" in targets.format_targets(cpu)


def test_cli_records_rows_with_provenance(tmp_path):
    out = tmp_path / "ladder.json"
    assert ladder.main(["checkpointing", "--device", "cpu", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["provenance"]["command"].startswith("python -m course_lib.chapters.ch09.ladder checkpointing")
    assert len(data["checkpointing"]) == 2 and "targets" not in data


def test_every_gpt_rung_is_measured_against_one_named_peak(monkeypatch):
    # On an H100 the peak is bf16's dense 989.4 TFLOP/s for every rung, strict FP32 included: a
    # strict-FP32 rung divided by the fp32 peak (66.9) would look 15x better used than it is.
    monkeypatch.setattr(ladder, "_gpu_name", lambda dev: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(ladder, "mixed_precision_for", lambda dev: "bf16")
    rows = [r for r in ladder.gpt_ladder("cpu", batch=1, seq=8, steps=1) if "ms_per_step" in r]
    assert {r["mfu_peak"] for r in rows} == {"NVIDIA H100 80GB HBM3 dense bf16, 989.4 TFLOP/s"}
    assert all(r["mfu"] == pytest.approx(r["model_tflops"] / 989.4) for r in rows)


def test_matmul_ceiling_times_the_devices_mixed_precision_not_always_bf16(monkeypatch):
    asked = []
    monkeypatch.setattr(ladder, "pick_device", lambda device: ladder.torch.device("cuda"))
    monkeypatch.setattr(ladder, "matmul_tflops", lambda n, dtype, dev: asked.append(dtype) or (50.0, 1.0))
    for amp, dtype in (("fp16", ladder.torch.float16), ("bf16", ladder.torch.bfloat16)):  # a T4, an H100
        monkeypatch.setattr(ladder, "mixed_precision_for", lambda dev, amp=amp: amp)
        assert ladder.matmul_ceiling() == 50.0 and asked[-1] == dtype


def test_resnet50_cli_probes_the_largest_batch_in_the_devices_mixed_precision(monkeypatch, tmp_path):
    # A T4 or V100 has no native bf16: the probe must ask for fp16 there, not crash on bf16.
    probed = []
    monkeypatch.setattr(ladder, "resnet50_ladder", lambda device: [])
    monkeypatch.setattr(ladder, "mixed_precision_for", lambda dev: "fp16")
    monkeypatch.setattr(ladder, "largest_batch", lambda precision, device: probed.append(precision) or {})
    out = tmp_path / "data" / "reference" / "ladder_resnet50_t4.json"  # folders that do not exist yet
    assert ladder.main(["resnet50", "--device", "cpu", "--json", str(out)]) == 0
    assert probed == ["fp32", "fp16"] and json.loads(out.read_text())["largest_batch"] == [{}, {}]


def test_largest_batch_doubles_until_out_of_memory_with_one_untimed_step_per_probe(monkeypatch):
    asked = []

    def step_row(model, precision, device, *, batch, steps, warmup=3, channels_last=False, autotune=True):
        asked.append((batch, steps, warmup, autotune))
        if batch > 256:
            raise ladder.torch.cuda.OutOfMemoryError("CUDA out of memory")
        return {}

    monkeypatch.setattr(ladder, "pick_device", lambda device: ladder.torch.device("cuda"))
    monkeypatch.setattr(ladder, "step_row", step_row)
    found = ladder.largest_batch("fp16")
    assert found["largest_batch"] == 256 and found["note"] == ""
    # no warm-up and no cuDNN autotuning (a minute per new size in strict FP32): a probe times nothing
    assert asked == [(64, 1, 0, False), (128, 1, 0, False), (256, 1, 0, False), (512, 1, 0, False)]


def test_each_rung_is_the_one_before_it_with_one_change():
    for ladder_rungs in (rungs.COURSE_RUNGS, ladder.GPT_RUNGS):
        for before, after in zip(ladder_rungs, ladder_rungs[1:]):
            changed = [k for k, v in vars(after).items() if k != "label" and v != vars(before)[k]]
            assert len(changed) == 1, (after.label, changed)
