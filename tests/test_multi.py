"""course_lib.chapters.ch05.multi: chapter 05's loops do what the AMP examples page prescribes."""

from __future__ import annotations

import copy
import inspect
import json

import pytest
import torch
import torch.nn as nn

from course_lib.chapters.ch05 import article_two_models, multi

FP16 = multi.cpu_fp16_scaler_works()
needs_fp16 = pytest.mark.skipif(not FP16, reason="this torch has no CPU fp16 autocast + GradScaler")


def test_amp_mode_picks_fp16_with_a_scaler_where_it_works_else_bf16_alone():
    mode = multi.amp_mode("cpu")
    assert (mode.dtype, mode.scaler) == ((torch.float16, True) if FP16 else (torch.bfloat16, False))
    assert multi.amp_mode("cuda").dtype == torch.float16 and multi.amp_mode("cuda").scaler
    fp32 = multi.AmpMode("cpu", torch.float32, False, "")
    with fp32.autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert fp32.name == "fp32" and not fp32.make_scaler().is_enabled()


@needs_fp16
def test_two_model_step_matches_the_examples_page_and_skips_then_learns():
    mode = multi.amp_mode("cpu")
    model0, model1 = article_two_models.two_models(0)
    opt0, opt1 = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (model0, model1))
    scaler = mode.make_scaler()
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    rows = [
        article_two_models.two_model_step(model0, model1, opt0, opt1, scaler, x, y, mode, max_norm=1.0)
        for _ in range(8)
    ]
    assert rows[0]["scale"] == 2.0**16 and rows[0]["skipped"] == [True, True]  # fp16 overflows at 65536
    assert rows[-1]["skipped"] == [False, False] and rows[-1]["loss0"] < rows[0]["loss0"]
    scales = [r["scale"] for r in rows]
    assert all(b in (a, a / 2) for a, b in zip(scales, scales[1:]))  # one update per iteration: one halving at most


@needs_fp16
def test_each_optimizer_skips_on_its_own_and_update_backs_off_once():
    rows = article_two_models.independent_skips(multi.amp_mode("cpu"), iterations=8)
    alone = [r for r in rows if r["opt1_skipped"] and not r["opt0_skipped"]]
    assert alone and all(r["scale_after"] == r["scale"] / 2 for r in alone)
    assert not rows[-1]["opt1_skipped"]


def test_retain_graph_and_the_summed_loss_give_the_same_gradients():
    result = article_two_models.retain_vs_sum(multi.AmpMode("cpu", torch.float32, False, ""), batch=16, iters=2)
    assert result["max_rel_diff"] < 1e-5 and set(result["timings"]) == {
        "two backward (retain_graph)",
        "one backward of the sum",
    }


@needs_fp16
def test_gan_step_uses_one_scaler_and_trains_on_real_images():
    torch.manual_seed(0)
    images = torch.rand(256, 1, 28, 28) * 2 - 1
    gen, disc, hist = multi.train_gan(images, multi.amp_mode("cpu"), steps=12, batch_size=16, growth_interval=4)
    assert len(hist.d_loss) == len(hist.scale) == 12 and hist.mode == "fp16 + GradScaler"
    assert hist.scale[4] == 2.0**17  # grew after 4 clean iterations: one update per iteration
    assert gen(torch.randn(2, gen.z_dim)).shape == (2, 1, 28, 28) and multi.image_grid(images, 2, 3).shape == (56, 84)


def test_gan_images_are_in_the_generators_range():
    data = torch.utils.data.TensorDataset((torch.rand(8, 1, 28, 28) - 0.286) / 0.353, torch.zeros(8))
    x = multi.gan_images(data, 0.286, 0.353)
    assert x.min() >= -1 - 1e-5 and x.max() <= 1 + 1e-5


@needs_fp16
def test_the_penalty_matches_fp32_only_with_the_manual_unscaling():
    mode = multi.amp_mode("cpu")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(32, 20), torch.randint(0, 4, (32,))
    ref = multi.penalty_reference(copy.deepcopy(net), x, y)
    for unscale, close in ((True, True), (False, False)):
        model = copy.deepcopy(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = mode.make_scaler(init_scale=2.0**10)
        out = multi.penalty_backward(model, scaler, x, y, mode, unscale=unscale)
        scaler.unscale_(opt)
        assert (abs(out["penalty"] - ref["penalty"]) < 0.05 * ref["penalty"]) == close
        errs = [((p.grad - g).norm() / g.norm()).item() for p, g in zip(model.parameters(), ref["grads"])]
        assert (max(errs) < 0.05) == close


def test_the_functions_the_chapter_prints_fit_in_100_characters():
    for fn in (article_two_models.two_model_step, multi.gan_step, multi.penalty_backward):
        assert max(map(len, inspect.getsource(fn).splitlines())) <= 100, fn.__name__


def test_the_reference_cli_records_every_mode(tmp_path, capsys):
    out = tmp_path / "multi_cpu.json"
    assert multi.main(["--device", "cpu", "--steps", "3", "--batch", "8", "--json", str(out)]) == 0
    ref = json.loads(out.read_text())
    assert [r["mode"] for r in ref["rows"]] == ["fp32", "bf16", multi.amp_mode("cpu").name]
    assert ref["provenance"]["command"].startswith("python -m course_lib.chapters.ch05.multi")
    text = multi.format_gan_reference(ref)
    assert all(len(line) <= 100 for line in text.splitlines()) and "fp32" in text


def test_a_live_run_is_sized_by_what_this_machine_measured(monkeypatch):
    assert multi.steps_within(20, 0.005) == 2000  # 4,000 fit: capped
    assert multi.steps_within(20, 0.0238) == 800  # 840 fit: rounded down to a multiple of 100
    assert multi.steps_within(20, 0.5) == 100 and multi.steps_within(30, 0.1, lo=100, hi=300) == 300
    calls = []

    def fake_train_gan(images, mode, steps, batch_size):
        calls.append(steps)
        first = [1.0] * 5  # the first iterations set things up: slow
        burst = [0.05] * (steps - 6) + [2.0]  # then 50 ms an iteration, one caught by a neighbour's burst
        return None, None, multi.GanHistory(step_seconds=first + burst)

    monkeypatch.setattr(multi, "train_gan", fake_train_gan)
    n, per = multi.gan_iterations(torch.zeros(4, 1, 28, 28), multi.amp_mode("cpu"), budget_s=25, hi=300)
    assert calls == [25] and per == pytest.approx(0.05) and n == 300  # the median of the last 20
    assert multi.gan_iterations(torch.zeros(4, 1, 28, 28), multi.amp_mode("cpu"), budget_s=12)[0] == 200
