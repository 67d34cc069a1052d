"""course_lib.chapters.ch03.overflow: forward hooks find the first layer whose output leaves fp16's range."""

import torch
import torch.nn.functional as F

from course_lib.chapters.ch03.overflow import first_nonfinite, format_magnitudes, trace_magnitudes
from course_lib.chapters.ch09.growing import growing_mlp


def test_growing_mlp_works_in_fp32_and_overflows_in_the_middle_in_fp16():
    x = torch.randn(16, 1, 28, 28)
    model = growing_mlp()
    assert torch.isfinite(F.cross_entropy(model(x), torch.zeros(16, dtype=torch.long)))
    fp32 = trace_magnitudes(model, x)
    assert first_nonfinite(fp32) is None and max(r.max_abs for r in fp32) > 65504  # beyond fp16, finite in fp32
    fp16 = trace_magnitudes(model, x, device_type="cpu", dtype=torch.float16)
    culprit = first_nonfinite(fp16)
    names = [r.name for r in fp16]
    assert culprit.kind == "Linear" and 0 < names.index(culprit.name) < names.index("norm")
    before = fp16[: names.index(culprit.name)]
    assert all(r.nonfinite == 0 and r.max_abs <= 65504 for r in before)
    assert fp16[-1].nonfinite > 0  # the NaN reaches the logits


def test_the_trace_follows_execution_order_and_removes_its_hooks():
    model = growing_mlp(depth=2, gain=2**0.5)
    rows = trace_magnitudes(model, torch.randn(4, 1, 28, 28), device_type="cpu", dtype=torch.bfloat16)
    assert [r.name for r in rows] == ["flatten", "fc1", "relu1", "fc2", "relu2", "norm", "head"]
    assert rows[1].dtype == "bfloat16" and first_nonfinite(rows) is None
    assert all(not m._forward_hooks for m in model.modules())


def test_format_marks_the_first_inf_and_values_beyond_fp16():
    x = torch.randn(8, 1, 28, 28)
    text = format_magnitudes(trace_magnitudes(growing_mlp(), x, device_type="cpu", dtype=torch.float16))
    assert text.count("<- first inf/NaN") == 1 and all(len(line) <= 100 for line in text.splitlines())
    assert "<- beyond fp16" in format_magnitudes(trace_magnitudes(growing_mlp(), x))


def test_chapter_03s_model_overflows_at_its_first_linear_and_every_later_output_is_broken():
    """Chapter 03, section 10: weights that fit fp16 (< 65504), a first layer whose outputs do not."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight.mul_(1e4)
    x = torch.randn(4, 8) + 30
    rows = trace_magnitudes(model, x, device_type="cpu", dtype=torch.float16)
    assert [r.kind for r in rows] == ["Linear", "LayerNorm", "Linear"] and rows[0].dtype == "float16"
    assert first_nonfinite(rows) is rows[0] and all(r.nonfinite > 0 for r in rows)
    assert rows[1].nonfinite == 4 * 8  # a LayerNorm over a row holding an inf: no value of it is finite
    assert first_nonfinite(trace_magnitudes(model, x, device_type="cpu", dtype=torch.bfloat16)) is None
