"""The GPU recorders of chapters 09-11 (they replaced tools/gpu_study.py): each parses the arguments its
recorded command was run with, builds on the core (amp_step, AMP_DTYPES, time_fn) and chapter 11's fp8
code, and writes the keys its chapter reads. The GPU sizes cannot run here: each part runs at toy size
on the CPU, as the recorders do off a GPU."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from course_lib import _provenance, reference
from course_lib.chapters.ch09 import record_questions
from course_lib.chapters.ch10 import record_memory
from course_lib.chapters.ch11 import record_fp8, record_roofline
from course_lib.models import MLP

CPU = torch.device("cpu")
RECORDERS = {
    "questions": record_questions,
    "memory": record_memory,
    "roofline": record_roofline,
    "fp8gpt": record_fp8,
}


class Parsed(Exception):
    pass


@pytest.mark.parametrize("study", sorted(RECORDERS))
def test_each_old_subcommand_maps_to_its_chapter_recorder_which_takes_its_arguments(study, monkeypatch):
    old = f"python tools/gpu_study.py {study} --json data/reference/{study}_h100.json --deadline 114 --deadline 110"
    now = reference.current_command(old)
    module = RECORDERS[study]
    assert now == f"python -m {module.__name__} --json data/reference/{study}_h100.json --deadline 114 --deadline 110"
    seen = {}

    def parse_only(self, args=None, namespace=None):
        seen.update(vars(self.parse_known_args(args, namespace)[0]))
        raise Parsed

    monkeypatch.setattr("argparse.ArgumentParser.parse_args", parse_only)
    with pytest.raises(Parsed):
        module.main(now.split()[3:])
    assert seen["json"] == f"data/reference/{study}_h100.json" and seen["deadline"] == 110.0


def test_tools_no_longer_holds_the_study_script():
    assert not (_provenance.ROOT / "tools" / "gpu_study.py").exists()
    assert all(old.startswith("tools/gpu_study.py ") for old in _provenance.MOVED if old.startswith("tools/"))


def test_every_recorded_step_is_the_core_s_amp_step(monkeypatch):
    from course_lib import train

    calls, real = [], train.amp_step

    def spy(*args, **kwargs):
        calls.append(args[4])  # the autocast dtype
        return real(*args, **kwargs)

    monkeypatch.setattr(record_questions, "amp_step", spy)
    monkeypatch.setattr(record_memory, "amp_step", spy)
    model = MLP(in_features=8, hidden=8, depth=1)
    x, y = torch.randn(4, 8), torch.randint(0, 10, (4,))
    off = torch.amp.GradScaler("cpu", enabled=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for precision in ("fp32", "bf16"):
        record_questions.one_step(model, opt, off, x, y, precision)()
    assert calls == [None, torch.bfloat16]
    _mlp_row("bf16", None)
    assert calls[2:] == [torch.bfloat16] * 3  # two warm-up steps and the measured one


def test_back_to_back_ms_times_batches_of_calls_through_time_fn(monkeypatch):
    from course_lib.timing import Timing

    calls, timed = [], []

    def fake_time_fn(fn, *, warmup, iters, device):
        timed.append((warmup, iters))
        for _ in range(iters):
            fn()
        return Timing([10.0, 20.0, 30.0][:iters])

    monkeypatch.setattr(record_questions, "time_fn", fake_time_fn)
    out = record_questions.back_to_back_ms(lambda: calls.append(1), iters=5, device=CPU, reps=3, warmup=2)
    assert len(calls) == 2 + 3 * 5 and timed == [(0, 3)]
    assert out == {"ms": 4.0, "ms_min": 2.0, "ms_max": 6.0}  # per call: each sample over its 5 calls


def test_a_profiled_cpu_step_gives_the_kernel_summary_and_op_table_shapes():
    model = MLP(in_features=16, hidden=16, depth=1)
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    step = record_questions.one_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", enabled=False), x, y, "fp32"
    )
    trace = record_questions.profile_trace(step, CPU, steps=2, shapes=True)
    ops = record_questions.op_table(trace, 2, top=60)
    assert ops and set(ops[0]) == {"op", "dims", "types", "calls", "us"}
    assert any(o["op"] == "aten::addmm" for o in ops)
    summary = record_questions.kernel_summary(trace, 2)
    assert summary["kernels_per_step"] == 0 and set(summary) == {
        "gpu_us_per_step",
        "kernels_per_step",
        "by_class_us",
        "top",
    }
    assert record_questions.kernel_class("ampere_bf16_s16816gemm") == "conv/gemm"
    assert record_questions.kernel_class("triton_poi_fused_add") == "triton (fused)"


def tiny_cnn() -> torch.nn.Module:
    """A stand-in for SimpleCNN on 1 x 28 x 28 images: the recorders' code, not the CPU's convolutions."""
    return torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, stride=4), torch.nn.Flatten(), torch.nn.Linear(2 * 7 * 7, 10))


def test_the_questions_rows_carry_what_recorded_profiles_reads(monkeypatch):
    monkeypatch.setattr(record_questions, "SimpleCNN", tiny_cnn)
    cnn = record_questions.q_simplecnn(CPU, 4)
    assert list(cnn) == ["fp32", "bf16", "bf16 + channels_last"]
    assert {"ms_per_step", "ms_per_step_back_to_back", "kernels", "ops"} <= set(cnn["bf16"])
    gpt = record_questions.q_gpt(CPU, (1, 2), deadline=0.0)  # the deadline passed: the second batch is skipped
    assert gpt["rows"][1] == {"batch": 2, "note": "skipped: the call's deadline"} and gpt["mfu_peak_tflops"] is None
    assert {"mfu", "gpu_busy", "gemm_tflops", "attention_tflops", "flops_per_token"} <= set(gpt["rows"][0])
    assert "SimpleCNN fp32:" in record_questions.summary({"simplecnn": cnn, "resnet50": {}, "gpt": gpt})


def _mlp_row(precision: str, optimizer: str | None) -> dict:
    x = torch.randn(8, 32, dtype=torch.bfloat16 if precision.startswith("bf16-") else torch.float32)  # pure bf16
    return record_memory.measure_memory(
        lambda: (MLP(in_features=32, hidden=32, depth=2), lambda m, a, b: F.cross_entropy(m(a), b)),
        lambda: (x, torch.randint(0, 10, (8,))),
        precision,
        optimizer,
        CPU,
    )


def test_a_memory_row_has_every_phase_and_the_keys_recorded_reads():
    row = _mlp_row("fp32", None)
    assert list(row["phases"]) == ["start", "forward", "backward", "optimizer"]  # marked in the order they ran
    assert {"model_bytes", "optimizer_made_bytes", "batch_bytes", "peak_bytes", "saved_by_dtype"} <= set(row)
    assert row["param_count"] == sum(p.numel() for p in MLP(in_features=32, hidden=32, depth=2).parameters())
    assert row["saved_by_dtype"]["float32"] > 0  # the forward's saved activations, counted on any device


def test_master_weights_are_stepped_by_the_chapter_s_optimizer_and_the_mlp_by_none():
    params = list(MLP(in_features=8, hidden=8, depth=1).to(torch.bfloat16).parameters())
    from course_lib.chapters.ch10.master_weights import MasterWeightsAdamW

    assert isinstance(record_memory._optimizer("fused", params, "bf16-master"), MasterWeightsAdamW)
    still = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    record_memory._optimizer(None, params, "bf16").step()
    assert all(torch.equal(a, b) for a, b in zip(still, params))
    row = _mlp_row("bf16-master", "fused")
    assert row["precision"] == "bf16-master" and row["phases"]["optimizer"]


def test_the_memory_table_prints_a_row_that_ran_out_of_memory_as_its_error():
    row = _mlp_row("fp32", "sgd") | {"model": "mlp", "batch": 8}
    lost = {"model": "gpt2", "batch": 8, "precision": "fp32", "optimizer": "fused", "error": "CUDA out of memory"}
    lines = record_memory.format_memory_rows([row, lost]).splitlines()
    assert lines[0].split()[:3] == ["model", "b", "precision"] and lines[2].split() == [
        "gpt2",
        "CUDA",
        "out",
        "of",
        "memory",
    ]


def test_fp8_rows_use_the_chapter_s_scaled_casts():
    row = record_roofline.fp8_row(CPU, 32, 64, 16, iters=2)
    for mode in ("tensorwise", "rowwise"):
        if f"{mode}_error" not in row:  # an older torch's CPU _scaled_mm may refuse a granularity
            assert row[f"{mode}_rel_error"] < 0.1 and row[f"{mode}_ms"] > 0 and row[f"{mode}_with_cast_ms"] > 0
    assert row["bf16_tflops"] > 0


def test_the_roofline_parts_have_the_recorded_keys(monkeypatch):
    monkeypatch.setattr(record_roofline, "SimpleCNN", tiny_cnn)
    row = record_roofline.matmul_row(CPU, 16, 16, 16, torch.float32, iters=2)
    assert set(row) == {"m", "k", "n", "ms", "ms_min", "ms_max", "tflops"}
    ops = record_roofline._step_ops(CPU, big=False)
    assert list(ops) == ["gpt2 bf16 batch 8", "simplecnn fp32 batch 256", "simplecnn bf16 batch 256"]
    assert all(o["us"] >= 0 for o in ops["gpt2 bf16 batch 8"])


def test_the_markov_language_has_four_successors_per_token():
    (x, y), *_ = record_fp8.markov_batches(64, 2, 16, 1, CPU)
    assert torch.equal(x[:, 1:], y[:, :-1])
    pairs = {(int(a), int(b)) for a, b in zip(x.flatten(), y.flatten())}
    assert max(sum(1 for a, _ in pairs if a == t) for t in {a for a, _ in pairs}) <= 4


def test_the_fp8_recorder_runs_its_bf16_recipe_where_torchao_is_installed(tmp_path):
    pytest.importorskip("torchao.float8")
    data = record_fp8.markov_batches(512, 2, 16, 2, CPU)
    row = record_fp8.recipe_row("bf16", CPU, data, 2, 16)
    assert len(row["losses"]) == 1 + 2 + 2 + 3 and row["ms_per_step"] > 0


def test_a_recorder_writes_its_payload_with_the_new_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        record_fp8,
        "fp8_gpt",
        lambda device, deadline: {"rows": [{"recipe": "bf16", "ms_per_step": 2.0, "losses": [1.0]}]},
    )
    out = tmp_path / "fp8gpt.json"
    monkeypatch.setattr(sys, "argv", ["x", "--json", str(out)])
    assert record_fp8.main() == 0
    saved = json.loads(out.read_text())
    assert saved["provenance"]["command"] == f"python -m course_lib.chapters.ch11.record_fp8 --json {out}"
    assert saved["provenance"]["source"] == "course_lib/chapters/ch11/record_fp8.py"
    assert saved["rows"][0]["recipe"] == "bf16" and "bf16: 2.0 ms/step" in capsys.readouterr().out
