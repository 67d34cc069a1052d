"""course_lib.chapters.ch10: `predict_step` refuses what it does not model and names what it does; its tapes
hold the models' own parameters; chapters 02 and 04 agree with it; a prediction missing one kind of tensor
misses the 2% target; an H100's recorded run (data/reference/memory_*.json) is predicted within 2% by the
walk alone, and within 1% once the record's own reading of what the allocator held before the step is
added; the explorer draws everywhere. The seeded sweep against MemTracker is tests/test_memory_sweep.py.
"""

import pytest

from course_lib.chapters.ch10.predict import OPTIMIZERS, PRECISIONS, Step, predict_step
from course_lib.chapters.ch10.recorded import predicted_recorded_row
from course_lib.models import GPTConfig
from course_lib.reference import load_references

TARGET = 0.02


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"model": "vit", "batch": 1}, "model 'vit' is not modelled"),
        ({"model": "gpt", "batch": 1, "seq": 8, "optimizer": "adam8bit"}, "optimizer 'adam8bit' is not modelled"),
        ({"model": "gpt", "batch": 1, "seq": 8, "optimizer": "adamw(foreach)"}, "not modelled"),
        ({"model": "gpt", "batch": 1, "seq": 8, "precision": "fp8"}, "precision 'fp8' is not modelled"),
        ({"model": "gpt", "batch": 1, "seq": 8, "attention": "flash"}, "attention 'flash' is not modelled"),
        ({"model": "gpt", "batch": 1, "seq": 8, "device": "mps"}, "device 'mps' is not modelled"),
        ({"model": "resnet50", "batch": 1, "size": 64, "checkpointing": True}, "GPT's blocks only"),
        ({"model": "mlp", "batch": 1, "width": 8, "depth": 1, "seq": 8}, "seq does not apply to mlp"),
        ({"model": "gpt", "batch": 1}, "gpt needs seq"),
        ({"model": "gpt", "batch": 1, "seq": 8, "precision": "bf16-master", "optimizer": "sgd"}, "choose an adamw"),
        ({"model": "gpt", "batch": 1, "seq": 2048}, "longer than the model's block_size"),
    ],
)
def test_an_option_it_does_not_model_raises_and_says_what_it_does(bad, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        predict_step(Step(**bad))


def test_pytorchs_default_adamw_is_named_not_guessed():
    # "adamw" is the implementation PyTorch picks itself: the for-loop one on a CPU, foreach on CUDA
    assert Step("mlp", 8, width=8, depth=1).optimizer_kind == "adamw-forloop"
    assert Step("mlp", 8, width=8, depth=1, device="cuda").optimizer_kind == "adamw-foreach"
    assert predict_step(Step("mlp", 8, width=512, depth=1)).moment == "step: adamw-forloop"


def test_a_tapes_parameters_are_the_models():
    import torch

    from course_lib.chapters.ch10.predict import _tape
    from course_lib.models import GPT, MLP, SimpleCNN, resnet50

    cases = [
        (
            Step("gpt", 1, seq=8, config=GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)),
            lambda: GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)),
        ),
        (Step("mlp", 1, width=32, depth=3), lambda: MLP(in_features=32, hidden=32, depth=3)),
        (Step("simplecnn", 1, size=28, width=16), lambda: SimpleCNN(in_channels=1, width=16)),
        (Step("resnet50", 1, size=64), lambda: resnet50(num_classes=1000)),
    ]
    for step, build in cases:
        with torch.device("meta"):
            model = build()
        tape = _tape(step)
        assert [tape.tensors[p].numel for p in tape.params] == [p.numel() for p in model.parameters()], step.model
        assert sum(h.nbytes for h in tape.buffers) == sum(b.numel() * b.element_size() for b in model.buffers())


def test_the_chapter_02_and_04_walks_agree_with_the_tapes():
    from course_lib.chapters.ch02.step_memory import mlp_moments
    from course_lib.chapters.ch04.cnn_memory import cnn_moments

    for precision in ("fp32", "bf16"):
        mlp = predict_step(Step("mlp", 512, width=4096, depth=3, precision=precision, optimizer="sgd")).peak
        assert abs(max(mlp_moments(4096, 3, 512, precision).values()) / mlp - 1) < 0.001
        cnn = predict_step(Step("simplecnn", 64, size=28, width=64, precision=precision, optimizer="sgd")).peak
        assert abs(max(cnn_moments(64, 64, 28, precision).values()) / cnn - 1) < 0.001


def test_leaving_out_a_kind_of_tensor_misses_the_target():
    # The 2% target can fail: a prediction without the 16-bit weight copies, or without the fp32
    # master weights, or with the foreach temporaries where the for-loop ones are, is off by more.
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
    bf16 = predict_step(Step("gpt", 4, seq=32, config=config, precision="bf16", optimizer="adamw-fused"))
    assert sum(h.nbytes for h in bf16.held if h.category == "weight copies") > TARGET * bf16.peak
    master = predict_step(Step("gpt", 4, seq=32, config=config, precision="bf16-master", optimizer="adamw-fused"))
    assert sum(h.nbytes for h in master.held if "master" in h.what) > TARGET * master.peak
    forloop = Step("gpt", 1, seq=8, config=config, optimizer="adamw-forloop")
    foreach = Step("gpt", 1, seq=8, config=config, optimizer="adamw-foreach")
    assert abs(predict_step(foreach).peak / predict_step(forloop).peak - 1) > TARGET


RECORDED = [row for ref in load_references("memory_*.json") for row in ref["rows"]]


@pytest.mark.parametrize(
    "row",
    [r for r in RECORDED if r["model"] != "simplecnn"],
    ids=lambda r: f"{r['model']}-{r['precision']}-b{r['batch']}",
)
def test_the_recorded_gpu_peaks_are_within_two_percent(row):
    predicted = predicted_recorded_row(row)
    assert abs(predicted["error"]) < TARGET  # the walk alone
    assert abs(predicted["error_with_start"]) < 0.01  # with what the allocator held before the step


def test_every_recorded_row_is_under_predicted_by_the_walk_alone_and_the_record_says_by_how_much():
    assert RECORDED, "no recorded memory run in data/reference"
    rows = [predicted_recorded_row(r) for r in RECORDED]
    assert all(r["error"] < 0 for r in rows)
    for r in rows:
        assert r["before"] >= 0
        if r["model"] == "simplecnn":  # convolution workspaces: under, and said so
            assert r["error_with_start"] < -TARGET and "not predicted" in r["note"]


def test_without_cuda_rules_and_the_runs_loop_the_recorded_gpt_rows_miss():
    # CPU autocast's 16-bit softmax and the course loop's held logits are off on the GPU run.
    from course_lib.chapters.ch10.recorded import recorded_step

    row = next(r for r in RECORDED if r["model"] == "gpt2" and not r["sdpa"] and r["precision"] == "bf16")
    step = recorded_step(row)
    cpu_rules = (
        predict_step(
            Step("gpt", step.batch, seq=step.seq, config=step.config, precision="bf16", optimizer=step.optimizer)
        ).peak
        + row["batch_bytes"]
    )
    assert abs(cpu_rules / row["peak_bytes"] - 1) > TARGET


def test_the_momentum_rule_is_read_from_the_record():
    # fp16 rows whose GradScaler skipped every step start without SGD's buffer: one fp32 copy of the weights less.
    resnet = [r for r in RECORDED if r["model"] == "resnet50"]
    starts = {(r["batch"], r["precision"]): r["phases"]["start"]["allocated"] for r in resnet}
    model_bytes = resnet[0]["model_bytes"]
    for (batch, precision), start in starts.items():
        if precision == "fp16":
            assert abs((starts[(batch, "bf16")] - start) / model_bytes - 1) < 0.05


def test_the_explorer_shows_a_picture_everywhere_and_redraws_when_a_control_moves(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from course_lib.chapters.ch01.widgets import WIDGET_VIEW
    from course_lib.chapters.ch10.explorer import MemoryExplorer

    small = GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=64)
    explorer = MemoryExplorer(small, batch=2, seq=128)
    bundle = explorer._repr_mimebundle_()
    assert bundle["image/png"] and WIDGET_VIEW in bundle  # the live widget, and a picture for readers without one
    first = explorer.widget().children[-1].outputs  # the first picture is in the widget's own state,
    assert [o["output_type"] for o in first] == ["display_data"] and "image/png" in first[0]["data"]  # not shown
    *rows, note, _ = explorer.widget().children
    controls = {c.description: c for box in rows for c in box.children}
    # reopened without a kernel, the saved picture says so where it is drawn (ipywidgets marks the view
    # jupyter-widgets-disconnected); live, the note is hidden
    assert ".jupyter-widgets-disconnected .amp-saved{display:block}" in note.value
    assert ".amp-saved{display:none}" in note.value and "Run this cell again" in note.value
    controls["batch"].value = 4
    assert explorer.state["batch"] == 4
    offered = (("precision", PRECISIONS), ("optimizer", OPTIMIZERS), ("attention", ("sdpa", "materialized")))
    for name, options in offered:
        assert set(options) <= set(controls[name].options)  # every option a step can take is offered
    controls["precision"].value = "bf16-master"
    controls["optimizer"].value = "sgd"  # not a recipe the course models: the explorer says so, and does not fail
    assert "choose an adamw" in explorer.message
    monkeypatch.setattr(MemoryExplorer, "widget", lambda self: (_ for _ in ()).throw(ImportError("no ipywidgets")))
    assert set(MemoryExplorer(small)._repr_mimebundle_()) == {"text/plain", "image/png"}
