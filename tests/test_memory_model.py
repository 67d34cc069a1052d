"""course_lib.chapters.ch10: every predicted peak within 2% of what MemTracker measures (CPU, FakeTensorMode),
and of what an H100 measured (the recorded run in data/reference/memory_*.json).

The CPU sweep covers the four models of the course, fp32 and 16-bit autocast, and for the GPT SDPA and
materialized attention, checkpointing where its cross-entropy dominates, fp16 with a GradScaler (real
tensors), pure bf16 and bf16 with fp32 master weights. A prediction missing one kind of tensor (the
16-bit weight copies, the master weights) is off by more than 2% here: the tests can fail.
"""
import pytest

from course_lib.chapters.ch02.step_memory import measured_mlp, mlp_moments
from course_lib.chapters.ch04.cnn_memory import cnn_moments, measured_cnn
from course_lib.chapters.ch10.measure import measured_gpt, measured_resnet50
from course_lib.chapters.ch10.memory_model import gpt_step_tensors, predicted_peak, resnet50_moments
from course_lib.chapters.ch10.recorded import predicted_recorded_row
from course_lib.models import GPTConfig
from course_lib.reference import load_references

SMALL = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64)
TARGET = 0.02


def off(predicted: int, measured: int) -> float:
    return abs(predicted - measured) / measured


@pytest.mark.parametrize("config, batch, seq, precision, checkpointing", [
    (SMALL, 4, 64, "fp32", False),
    (SMALL, 16, 64, "bf16", False),
    (GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64, sdpa=False), 16, 64, "fp16", False),
    (GPTConfig(), 8, 1024, "fp32", False),
    (GPTConfig(), 8, 1024, "bf16", False),
    (GPTConfig(), 8, 1024, "fp32", True),
    (GPTConfig(), 8, 1024, "bf16", True),
    (SMALL, 16, 64, "bf16-pure", False),
    (SMALL, 16, 64, "bf16-master", False),
    (GPTConfig(), 8, 1024, "bf16-master", False),
])
def test_the_gpt_peak_is_within_two_percent(config, batch, seq, precision, checkpointing):
    measured = measured_gpt(config, batch, seq, precision, checkpointing)["Total"]
    assert off(predicted_peak(config, batch, seq, precision, checkpointing), measured) < TARGET


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("width, depth, batch", [(4096, 3, 512), (256, 3, 4096), (2048, 2, 2048)])
def test_the_mlp_peak_is_within_two_percent(width, depth, batch, precision):
    measured = measured_mlp(width, depth, batch, precision)["Total"]
    assert off(max(mlp_moments(width, depth, batch, precision).values()), measured) < TARGET


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("width, batch, size", [(64, 64, 28), (32, 128, 32)])
def test_the_simplecnn_peak_is_within_two_percent(width, batch, size, precision):
    measured = measured_cnn(width, batch, size, precision)["Total"]
    assert off(max(cnn_moments(width, batch, size, precision).values()), measured) < TARGET


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("batch, size", [(2, 224), (8, 64)])
def test_the_resnet50_peak_is_within_two_percent(batch, size, precision):
    measured = measured_resnet50(batch, size, precision)["Total"]
    assert off(max(resnet50_moments(batch, size, precision).values()), measured) < TARGET


@pytest.mark.parametrize("batch, seq", [(16, 64), (4, 32)])
def test_fp16_with_a_grad_scaler_holds_what_fp16_autocast_holds(batch, seq):
    # The scaler's own tensors are a few bytes (scale, growth tracker, found_inf); its step runs on real tensors.
    measured = measured_gpt(SMALL, batch, seq, "fp16", scaler=True)["Total"]
    assert off(predicted_peak(SMALL, batch, seq, "fp16"), measured) < TARGET


def test_forgetting_the_master_weights_misses_the_target():
    full = gpt_step_tensors(GPTConfig(), 8, 1024, "bf16-master")["backward"]
    without = sum(t.nbytes for t in full if "master" not in t.what)
    assert off(without, measured_gpt(GPTConfig(), 8, 1024, "bf16-master")["Total"]) > TARGET


RECORDED = [(ref["file"], row) for ref in load_references("memory_*.json") for row in ref["rows"]]


@pytest.mark.parametrize("row", [row for _, row in RECORDED if row["model"] != "simplecnn"],
                         ids=lambda r: f"{r['model']}-{r['precision']}-b{r['batch']}")
def test_the_recorded_gpu_peaks_are_within_two_percent(row):
    assert abs(predicted_recorded_row(row)["error"]) < TARGET


def test_the_recorded_rows_say_what_they_miss():
    assert RECORDED, "no recorded memory run in data/reference"
    for _, row in RECORDED:
        predicted = predicted_recorded_row(row)
        if row["model"] == "simplecnn":  # convolution workspaces: under, and said so
            assert predicted["error"] < 0 and "not predicted" in predicted["note"]
        if abs(predicted["error"]) >= TARGET:
            assert predicted["note"], predicted


def test_without_cuda_rules_the_recorded_gpt_rows_miss():
    # The CPU loop's assumptions (logits held by the caller, CPU autocast's 16-bit softmax) are off on the GPU run.
    row = next(r for _, r in RECORDED if r["model"] == "gpt2" and not r["sdpa"] and r["precision"] == "bf16")
    cpu_rules = predicted_peak(GPTConfig(**row["config"]), row["batch"], row["seq"], "bf16") + row["batch_bytes"]
    assert off(cpu_rules, row["peak_bytes"]) > TARGET


def test_the_momentum_rule_is_read_from_the_record():
    # fp16 rows whose GradScaler skipped every step start without SGD's buffer: one fp32 copy of the weights less.
    resnet = [r for _, r in RECORDED if r["model"] == "resnet50"]
    starts = {(r["batch"], r["precision"]): r["phases"]["start"]["allocated"] for r in resnet}
    for (batch, precision), start in starts.items():
        if precision == "fp16":
            model_bytes = next(r["model_bytes"] for _, r in RECORDED if r["model"] == "resnet50")
            assert off(starts[(batch, "bf16")] - start, model_bytes) < 0.05


def test_forgetting_the_weight_copies_misses_the_target():
    # The check above must be able to fail: GPT-2 small's 16-bit weight copies are 2.4% of its bf16 peak.
    full = gpt_step_tensors(GPTConfig(), 8, 1024, "bf16")["backward"]
    without = sum(t.nbytes for t in full if t.category != "weight copies")
    measured = measured_gpt(GPTConfig(), 8, 1024, "bf16")["Total"]
    assert off(without, measured) > TARGET


def test_the_explorer_shows_a_picture_everywhere_and_redraws_when_a_control_moves(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from course_lib.chapters.ch10.explorer import WIDGET_VIEW, MemoryExplorer

    explorer = MemoryExplorer(SMALL, batch=2, seq=128)
    bundle = explorer._repr_mimebundle_()
    assert bundle["image/png"] and WIDGET_VIEW in bundle  # the live widget, and a picture for readers without one
    first = explorer.widget().children[-1].outputs  # the first picture is in the widget's own state,
    assert [o["output_type"] for o in first] == ["display_data"] and "image/png" in first[0]["data"]  # not shown
    batch_slider = explorer.widget().children[0].children[0]
    batch_slider.value = 4
    assert explorer.state["batch"] == 4
    monkeypatch.setattr(MemoryExplorer, "widget", lambda self: (_ for _ in ()).throw(ImportError("no ipywidgets")))
    assert set(MemoryExplorer(SMALL)._repr_mimebundle_()) == {"text/plain", "image/png"}
