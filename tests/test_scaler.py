"""course_lib.chapters.ch03.scaler (chapter 03): the reference scaler against torch.amp.GradScaler, bit for bit,
the underflow and overflow tools, the fp16 run and its recording CLI, and the loss-scale simulator."""

from __future__ import annotations

import base64
import copy
import json
import math
import random
import struct
import sys
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.chapters.ch01 import widgets as W
from course_lib.chapters.ch03 import loss_scale_simulator as LS
from course_lib.chapters.ch03 import scaler as S
from course_lib.chapters.ch03 import underflow as U

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- float32 rounding


def test_f32_rounds_like_torch_including_ties_subnormals_and_overflow():
    rng = random.Random(0)
    xs = [rng.uniform(-1, 1) * 2.0 ** rng.uniform(-160, 130) for _ in range(3000)]
    fmax = torch.finfo(torch.float32).max
    ulp_top = 2.0**104  # spacing of float32 at its largest binade
    xs += [fmax, fmax + ulp_top / 2 - 1e20, fmax + ulp_top / 2, 2.0**-150, 3 * 2.0**-150, 2.0**-149, 0.1, -0.0]
    want = torch.tensor(xs, dtype=torch.float64).to(torch.float32).tolist()
    got = [S.f32(x) for x in xs]
    assert got == want
    assert S.f32(fmax + ulp_top / 2) == math.inf and S.f32(-1e39) == -math.inf and S.f32(2.0**-150) == 0.0


# --------------------------------------------------------------------------- the update rule, bit for bit


def random_settings(rng: random.Random) -> tuple[dict, list[bool]]:
    gi = rng.randint(1, 12)
    settings = dict(
        init_scale=rng.choice(
            [2.0 ** rng.randint(-30, 40), 10 ** rng.uniform(-44, 38.5), 3.4e38, 1e-45, rng.uniform(0.5, 1e6)]
        ),
        growth_factor=rng.choice([2.0, round(rng.uniform(1.01, 4.0), rng.randint(1, 7)), 1.0001, 1e10]),
        backoff_factor=rng.choice([0.5, round(rng.uniform(0.01, 0.94), rng.randint(1, 7)), 1e-10]),
        growth_interval=gi,
        growth_tracker=rng.choice([0, 0, rng.randint(0, gi - 1), gi + rng.randint(0, 6)]),
    )
    p = rng.choice([0.0, 0.05, rng.uniform(0, 0.6), 0.95])
    return settings, [rng.random() < p for _ in range(rng.randint(20, 120))]


@pytest.mark.parametrize("seed", range(6))
def test_reference_scaler_matches_gradscaler_bit_for_bit_on_random_sequences(seed):
    rng = random.Random(seed)
    for _ in range(12):
        settings, pattern = random_settings(rng)
        t = S.simulate(pattern, **settings)
        assert list(zip(t.after, t.tracker)) == S.torch_trajectory(pattern, **settings), settings
        assert t.scale == [S.f32(settings["init_scale"])] + t.after[:-1]


def test_the_edges_growth_stops_below_inf_backoff_reaches_zero_and_equality_blocks_growth():
    top = S.simulate([False] * 3, init_scale=2.0**127, growth_interval=1)
    assert top.after == [2.0**127] * 3 and top.event == ["capped"] * 3 and top.tracker == [0] * 3
    bottom = S.simulate([True] * 4, init_scale=2.0**-148)
    assert bottom.after == [2.0**-149, 0.0, 0.0, 0.0]
    past = S.simulate([False] * 50, growth_interval=10, growth_tracker=12)
    assert set(past.after) == {65536.0} and past.tracker[-1] == 62
    for settings, pattern in [
        (dict(init_scale=2.0**127, growth_interval=1), [False] * 3),
        (dict(init_scale=2.0**-148), [True] * 4),
        (dict(growth_interval=10, growth_tracker=12), [False] * 50),
    ]:
        t = S.simulate(pattern, **settings)
        assert list(zip(t.after, t.tracker)) == S.torch_trajectory(pattern, **settings)


def test_inv_scale_is_torchs_reciprocal():
    for s in [2.0**16, 3.0, S.f32(0.7), S.f32(1e-40), 1.0, 0.0, S.f32(3.3e38)]:
        want = torch.tensor(s, dtype=torch.float32).double().reciprocal().float().item()
        assert S.DynamicLossScaler(s).inv_scale() == want


def test_state_dict_has_gradscalers_keys_and_continues_a_gradscaler_run():
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=3)
    assert set(S.DynamicLossScaler().state_dict()) == set(scaler.state_dict())
    head, tail = [False, True, False, False], [False, False, True, False, False, False, False]
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)
    for inf in head:
        scaler.scale(p.sum())
        p.grad = torch.full((1,), math.inf if inf else 1.0)
        scaler.step(opt)
        scaler.update()
    state = scaler.state_dict()
    ours = S.DynamicLossScaler.from_state_dict(state)
    want = S.torch_trajectory(
        tail,
        init_scale=state["scale"],
        growth_factor=1.7,
        backoff_factor=0.3,
        growth_interval=3,
        growth_tracker=state["_growth_tracker"],
    )
    got = []
    for inf in tail:
        ours.update(inf)
        got.append((ours.scale, ours.growth_tracker))
    assert got == want


def test_a_training_loop_with_the_reference_scaler_equals_one_with_gradscaler():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    twin = copy.deepcopy(model)
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    ref = S.DynamicLossScaler(init_scale=2.0**20, growth_factor=1.5, backoff_factor=0.6, growth_interval=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_factor=1.5, backoff_factor=0.6, growth_interval=2)
    skipped = 0
    for i in range(12):
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        if i in (3, 7):
            x[0, 0] = 1e6  # inf in fp16
        for net, o in ((model, opt), (twin, twin_opt)):
            o.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(net(x), y)
            if net is model:
                (loss * ref.scale).backward()
                found = ref.unscale_(p.grad for p in net.parameters())
                if not found:
                    o.step()
                skipped += found
                ref.update(found)
            else:
                scaler.scale(loss).backward()
                scaler.step(o)
                scaler.update()
        assert ref.scale == scaler.get_scale()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    assert skipped >= 2


def test_unscale_checks_before_multiplying_so_a_zero_scale_lets_nan_through():
    g = [torch.zeros(3), torch.tensor([1.0, math.inf])]
    assert S.DynamicLossScaler(2.0).unscale_(g) is True
    zero = [torch.zeros(3)]
    assert S.DynamicLossScaler(0.0).unscale_(zero) is False and zero[0].isnan().all()


# --------------------------------------------------------------------------- underflow and overflow tools


def test_fates_at_scales_count_zero_subnormal_normal_and_overflow():
    v = torch.tensor([0.0, 2.0**-26, 2.0**-20, 1.0, 1e5], dtype=torch.float32)
    (r,) = U.fates_at_scales(v)
    assert r["n"] == 4 and (r["underflow"], r["subnormal"], r["normal"], r["overflow"]) == (0.25, 0.25, 0.25, 0.25)
    (r16,) = U.fates_at_scales(v, [2.0**16])
    assert (r16["underflow"], r16["subnormal"], r16["overflow"]) == (0.0, 0.0, 0.5)
    (rb,) = U.fates_at_scales(v, dtype=torch.bfloat16)
    assert rb["normal"] == 1.0
    text = U.format_fates(U.fates_at_scales(v, [1.0, 2.0**16]))
    assert "2^16" in text and max(map(len, text.splitlines())) <= 100


@pytest.mark.parametrize(
    "value, scale, fate",
    [
        (65519996.0, 1e-3, "overflow"),  # fp32 product 65520.0, a tie: inf; in float64 65519.996 -> 65504
        (7.241964794957312e-06, 3.0**-5, "underflow"),  # fp32 product 2^-25, a tie: 0; in float64 above -> 2^-24
    ],
)
def test_fates_at_scales_scales_as_gradscaler_does_a_float32_product_rounded_once(value, scale, fate):
    # Neither scale is a float32 number. GradScaler holds the scale as a float32 and scale() multiplies
    # in float32; multiplying in float64 and converting rounds the product twice and lands elsewhere.
    v = torch.tensor([value])
    assert v.item() == value
    stored = torch.amp.GradScaler("cpu", init_scale=scale).scale(v).to(torch.float16)
    want = "overflow" if torch.isinf(stored).all() else "underflow" if (stored == 0).all() else "other"
    assert want == fate
    (r,) = U.fates_at_scales(v, [scale])
    assert r[fate] == 1.0 and r["scale"] == S.f32(scale)


def test_fates_at_scales_is_chapter_01s_classification_at_each_scale():
    from course_lib.chapters.ch01.format_limits import fates

    v = torch.tensor([0.0, 2.0**-30, 2.0**-20, 1e-3, 1.0, 3e4, math.inf, math.nan])
    rows = U.fates_at_scales(v, [1.0, 2.0**8, 2.0**16])
    for r in rows:
        assert r["n"] == 5  # the non-zero finite values: inf and NaN are no gradient's fate
        assert {k: r[k] for k in ("overflow", "underflow", "subnormal", "normal")} == fates(v, "fp16", scale=r["scale"])
    assert [r["underflow"] for r in rows] == [1 / 5, 0.0, 0.0] and rows[2]["overflow"] == 2 / 5


def test_gradient_sample_collects_activation_and_parameter_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 3))
    g = U.gradient_sample(model, torch.randn(5, 10), torch.randint(0, 3, (5,)))
    assert g["parameters"].numel() == sum(p.numel() for p in model.parameters())
    assert g["activations"].numel() == 5 * (7 + 7 + 3)  # each leaf module's output
    assert not model._forward_hooks and not model[0]._forward_hooks


# --------------------------------------------------------------------------- real fp16 runs and the CLI


def tiny_batches(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


def test_gradients_shifted_below_fp16s_range_stop_unscaled_training_and_the_scaler_restores_it():
    torch.manual_seed(0)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    batches = [(x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16]) for i in range(4)] * 6
    rows = U.shifted_gradient_runs(
        lambda: nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10)), batches, shifts=(0, 24)
    )
    by = {(r["shift"], r["mode"]): r for r in rows}
    assert [r["gap"] for r in rows if r["gap"] is not None] == [0.0, 0.0]  # fp32: the same steps at any shift
    unscaled, scaled = by[(24, "fp16, no scaler")], by[(24, "fp16 + GradScaler")]
    assert unscaled["zero"] == 1.0 and unscaled["loss"][:4] == unscaled["loss"][-4:]  # no gradient: no step
    assert scaled["zero"] < 0.5 and scaled["loss"][-1] < scaled["loss"][0] and scaled["scale"] == 2.0**16
    text = U.format_shifted_runs(rows)
    assert "2^-24" in text and all(len(line) <= 100 for line in text.splitlines())


def test_fp16_run_skips_exactly_the_overflowing_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    r = S.fp16_run(model, torch.optim.SGD(model.parameters(), lr=0.01), tiny_batches(), 10, loss_factor=1e5)
    assert len(r["scale"]) == 10 and r["skipped"][0] and r["moved"][0] == 0.0
    replay = S.simulate(r["skipped"])
    assert replay.scale == r["scale"]
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    clipped = S.fp16_run(
        other, torch.optim.SGD(other.parameters(), lr=0.01), tiny_batches(), 3, init_scale=4.0, clip=0.01
    )
    assert not any(clipped["skipped"])


def test_the_cli_records_a_run_with_provenance(tmp_path, capsys):
    out = tmp_path / "scaler_test.json"
    assert (
        S.main(
            [
                "--device",
                "cpu",
                "--model",
                "mlp",
                "--steps",
                "6",
                "--batch",
                "8",
                "--growth-interval",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rec = json.loads(out.read_text())
    assert rec["provenance"]["command"].startswith("python -m course_lib.chapters.ch03.scaler --device cpu")
    assert len(rec["scale"]) == 6 and rec["replay_identical"] is True
    text = S.describe_dynamics(rec)
    assert "bit for bit: True" in text and max(map(len, text.splitlines())) <= 100
    assert "wrote" in capsys.readouterr().out


def test_plots_draw_without_errors():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = S.simulate(lambda i, s: s > 2**18, 120, growth_interval=10)
    _, ax = plt.subplots()
    S.plot_trajectory(ax, t.scale, t.skipped, label="run")
    assert ax.get_legend() is not None and ax.get_yscale() == "log"
    fig = U.plot_gradient_histograms({"a": torch.tensor([1e-6, 1e-3, 0.0])})
    run = {"model": "mlp", "device": "cpu", "growth_interval": 10, "scale": t.scale, "skipped": t.skipped}
    S.plot_dynamics(run)
    plt.close("all")
    assert fig is not None


# --------------------------------------------------------------------------- the loss-scale simulator


@pytest.mark.parametrize("pattern", list(LS.PATTERNS))
def test_simulator_text_is_deterministic_and_fits_100_characters(pattern):
    sim = LS.scale_simulator(pattern=pattern, parameter=7, steps=300)
    text = repr(sim)
    assert text == repr(LS.scale_simulator(pattern=pattern, parameter=7, steps=300))
    assert max(map(len, text.splitlines())) <= 100
    page = sim._repr_html_()
    chart = base64.b64decode(page.split("base64,")[1].split('"')[0]).decode()
    assert page.startswith("<div><img") and chart.startswith("<svg") and "skipped step" in chart


def test_simulator_patterns_do_what_they_say():
    never = LS.SimulatorSettings(pattern="never", steps=100, growth_interval=10).run()
    assert not any(never.skipped) and never.event.count("growth") == 10
    always = LS.SimulatorSettings(pattern="every step", steps=10).run()
    assert all(always.skipped) and always.after[-1] == 2.0**6
    every = LS.SimulatorSettings(pattern="every k-th step", parameter=5, steps=20).run()
    assert [i + 1 for i, k in enumerate(every.skipped) if k] == [5, 10, 15, 20]
    headroom = LS.SimulatorSettings(pattern="headroom", parameter=18, growth_interval=5, steps=200).run()
    assert max(headroom.scale) <= 2.0**19 and any(headroom.skipped)
    with pytest.raises(ValueError):
        LS.scale_simulator(pattern="sometimes")


def test_simulator_display_carries_the_widget_and_both_static_views():
    sim = LS.scale_simulator()
    bundle = sim._repr_mimebundle_()
    assert bundle["text/plain"] == LS.simulator_text(sim.settings)
    assert bundle["text/html"] == LS.simulator_html(sim.settings)
    assert "model_id" in bundle[W.WIDGET_VIEW]


def test_simulator_falls_back_to_the_static_views_without_ipywidgets(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    assert set(LS.scale_simulator()._repr_mimebundle_()) == {"text/plain", "text/html"}


def chart_of(page: str) -> str:
    return base64.b64decode(page.split("base64,")[1].split('"')[0]).decode()


def test_live_simulator_follows_its_controls():
    sim = LS.scale_simulator()
    box = sim.widget()
    controls, helptext, view = sim._controls, box.children[-2], box.children[-1]
    controls["pattern"].value = "every k-th step"
    assert controls["parameter"].description == "k" and "every" in helptext.value
    controls["parameter"].value = 10
    controls["growth_interval"].value = 50
    assert sim.settings.pattern == "every k-th step" and sim.settings.parameter == 10
    assert "skipped step (20 of 200)" in chart_of(view.value)
    controls["pattern"].value = "never"
    assert controls["parameter"].description == "(unused)" and "skipped step (0 of 200)" in chart_of(view.value)
    assert sim.widget() is box


def test_the_chapter_stores_the_simulators_static_views():
    nb = nbformat.read(ROOT / "notebooks" / "03_grad_scaler.ipynb", as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and "scale_simulator()" in c.source]
    assert cells, "chapter 03 shows the simulator"
    for cell in cells:
        assert "nbval-check-output" in cell.metadata.get("tags", [])
        (out,) = [o for o in cell.outputs if "data" in o]
        assert set(out["data"]) == {"text/plain", "text/html"}
        sim = LS.scale_simulator()
        assert out["data"]["text/plain"] == repr(sim) and out["data"]["text/html"] == sim._repr_html_()


def test_struct_rounding_is_what_the_exercise_helper_does():
    # the exercise's to_float32 uses torch; f32 uses struct: the same function
    for x in [0.1, 1 / 3, 3.5e38, 2.0**-150, 3 * 2.0**-150]:
        assert S.f32(x) == torch.tensor(x, dtype=torch.float64).to(torch.float32).item()
    assert struct.calcsize("f") == 4
