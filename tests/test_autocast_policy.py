"""course_lib.chapters.ch02.autocast_policy (chapter 02) and the chapter 02 checks.

The probe's *classifications* are tested where torch has kept them stable for years
(matmul-like ops go down, losses go up, relu/add/batch_norm are unlisted); everything else is
tested as an invariant between the probe and a direct run, so a torch upgrade that moves an
op between lists does not break the suite.
"""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.chapters.ch02 import autocast_dispatch as disp
from course_lib.chapters.ch02 import autocast_dtypes as ad
from course_lib.chapters.ch02 import autocast_policy as ap
from course_lib.models import SimpleCNN

LOW = [torch.bfloat16, torch.float16]
FAKE_CUDA = ap.fake_cuda_available()


def policy_of(rows):
    return {r.op: r.policy for r in rows}


@pytest.fixture(scope="module", params=LOW, ids=["bf16", "fp16"])
def cpu_rows(request):
    return ap.probe_policy("cpu", request.param)


@pytest.fixture(scope="module")
def fake_cuda_rows():
    if not FAKE_CUDA:
        pytest.skip("this torch build cannot run CUDA autocast on FakeTensors")
    return ap.probe_policy("cuda", torch.float16, fake=True)


def test_matmul_family_runs_in_low_precision_on_cpu(cpu_rows):
    policy = policy_of(cpu_rows)
    for op in ("matmul", "mm", "linear", "conv1d", "conv2d", "bmm", "addmm", "baddbmm"):
        assert policy[op] == "lower_precision", op
    low = cpu_rows[0].dtype
    assert all(r.from_fp32 == low for r in cpu_rows if r.policy == "lower_precision")


def test_losses_run_in_fp32_on_cpu_even_for_low_precision_inputs(cpu_rows):
    rows = {r.op: r for r in cpu_rows}
    for op in ("mse_loss", "l1_loss", "cross_entropy", "nll_loss", "binary_cross_entropy_with_logits"):
        assert rows[op].policy == "fp32" and rows[op].from_low == torch.float32, op
    # BCE is banned on CUDA but runs (in fp32) on the CPU
    assert rows["binary_cross_entropy"].policy == "fp32"


def test_unlisted_ops_follow_their_inputs(cpu_rows):
    rows = {r.op: r for r in cpu_rows}
    low = cpu_rows[0].dtype
    for op in ("relu", "add", "dropout", "batch_norm"):
        assert rows[op].policy == "unchanged", op
        assert (rows[op].from_fp32, rows[op].from_low) == (torch.float32, low), op


def test_every_row_is_consistent_with_its_policy(cpu_rows):
    low = cpu_rows[0].dtype
    for r in cpu_rows:
        assert r.policy in ap.POLICIES
        if r.policy == "fp32":
            assert r.from_fp32 == r.from_low == torch.float32, r
        if r.policy == "unchanged":
            assert (r.from_fp32, r.from_low) == (torch.float32, low), r
        if r.policy == "promote":  # the widest input type wins
            assert (r.from_low, r.from_mixed) == (low, torch.float32), r


def test_probe_agrees_with_a_direct_run_under_autocast(cpu_rows):
    low = cpu_rows[0].dtype
    rows = {r.op: r for r in cpu_rows}
    x = torch.randn(8, 16).to(low)
    with torch.autocast("cpu", dtype=low):
        direct = {
            "softmax": F.softmax(x, -1).dtype,
            "layer_norm": F.layer_norm(x, (16,)).dtype,
            "sum": x.sum().dtype,
            "mse_loss": F.mse_loss(x, x).dtype,
            "matmul": (x.float() @ x.float().T).dtype,
        }
    for op, dtype in direct.items():
        want = rows[op].from_fp32 if op == "matmul" else rows[op].from_low
        assert dtype == want, op


def test_promote_is_told_apart_from_ordinary_type_promotion():
    # cat (CPU promote list) and add (unlisted) both give fp32 for bf16 + fp32 inputs, but only
    # for cat does autocast insert the cast; the trace is what tells them apart.
    rows = {r.op: r for r in ap.probe_policy("cpu", torch.bfloat16, ops=["cat", "add"])}
    assert rows["cat"].policy == "promote" and rows["add"].policy == "unchanged"
    assert rows["cat"].from_mixed == rows["add"].from_mixed == torch.float32
    a, b = torch.randn(4, 4).bfloat16(), torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert disp.casts(disp.dispatch_trace(lambda: torch.cat([a, b])))[("bf16", "fp32")] == 1
        assert not disp.casts(disp.dispatch_trace(lambda: a + b))


def test_cpu_fp16_shares_the_bf16_lists():
    assert ap.compare_policies(ap.probe_policy("cpu", torch.bfloat16), ap.probe_policy("cpu", torch.float16)) == []


def test_fake_cuda_probe_shows_the_cuda_policy(fake_cuda_rows):
    policy = policy_of(fake_cuda_rows)
    assert policy["matmul"] == policy["linear"] == "lower_precision"
    assert policy["softmax"] == policy["layer_norm"] == policy["mse_loss"] == "fp32"
    assert policy["binary_cross_entropy"] == "banned"
    assert policy["batch_norm"] == policy["relu"] == "unchanged"
    assert policy["atan2"] == "promote"
    note = next(r.note for r in fake_cuda_rows if r.op == "binary_cross_entropy")
    assert "unsafe to autocast" in note


def test_fake_cuda_probe_leaves_autocast_state_as_it_was(fake_cuda_rows):
    assert not torch.is_autocast_enabled("cuda")
    assert torch.get_autocast_dtype("cuda") == torch.float16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_real_cuda_probe_matches_the_fake_one(dtype):
    real = ap.probe_policy("cuda", dtype)
    assert policy_of(real)["binary_cross_entropy"] == "banned"
    if FAKE_CUDA:
        assert ap.compare_policies(real, ap.probe_policy("cuda", dtype, fake=True)) == []


def test_fake_requires_cuda_device():
    with pytest.raises(ValueError):
        ap.probe_policy("cpu", fake=True)


def test_params_grads_and_optimizer_state_stay_fp32_and_in_place():
    torch.manual_seed(0)
    model = SimpleCNN(in_channels=1)
    opt = torch.optim.AdamW(model.parameters())
    ptrs = [p.data_ptr() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, 1, 12, 12))
        loss = F.cross_entropy(out, torch.zeros(4, dtype=torch.long))
        assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    opt.step()
    report = ad.dtype_report(model, opt)
    assert set(report["params"]) == set(report["grads"]) == set(report["optimizer state"]) == {"fp32"}
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_saved_activations_are_bf16_and_about_half_the_bytes_and_autocast_adds_weight_copies():
    torch.manual_seed(0)
    mem = ad.memory_comparison(
        SimpleCNN(in_channels=1), torch.randn(16, 1, 16, 16), torch.randint(0, 10, (16,)), dtype=torch.bfloat16
    )
    assert mem["fp32"]["peak"] is None  # no allocator statistics off CUDA
    by_dtype = mem["bf16"]["activations_by_dtype"]
    assert by_dtype["bf16"] > 0.9 * mem["bf16"]["activations"]
    assert "bf16" not in mem["fp32"]["activations_by_dtype"]
    assert 0.4 < mem["bf16"]["activations"] / mem["fp32"]["activations"] < 0.6
    n_weights = sum(p.numel() for p in SimpleCNN(in_channels=1).parameters() if p.dim() > 1)
    assert mem["fp32"]["weight_copies"] == 0 and mem["bf16"]["weight_copies"] >= 2 * n_weights * 0.9
    assert mem["fp32"]["existing"] > mem["bf16"]["existing"]  # fp32 saves the parameters themselves


def _regression():
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    return nn.Linear(16, 4), x, x @ torch.randn(4, 16).T


def test_an_optimizer_step_inside_one_region_leaves_the_cast_cache_stale():
    layer, x, y = _regression()
    before = [p.detach().clone() for p in layer.parameters()]
    res = {lay: ad.after_step_in_region(layer, x, y, lay, dtype=torch.bfloat16) for lay in ad.REGION_LAYOUTS}
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))  # works on a copy
    assert res["one region"]["moved"] == 0 and res["one region"]["error"] > 0.1
    for lay in ad.REGION_LAYOUTS[:1] + ad.REGION_LAYOUTS[2:]:
        assert res[lay]["moved"] > 0.1 and res[lay]["error"] == 0, lay
    with pytest.raises(ValueError):
        ad.after_step_in_region(layer, x, y, "two regions")


def test_training_in_one_region_logs_the_same_loss_every_step():
    layer, x, y = _regression()
    losses = {lay: ad.losses_by_layout(layer, x, y, lay, steps=4, dtype=torch.bfloat16) for lay in ad.REGION_LAYOUTS}
    assert len(set(losses["one region"])) == 1
    fresh = losses["a new region per step"]
    assert all(b < a for a, b in zip(fresh, fresh[1:]))
    assert losses["one region + torch.clear_autocast_cache()"] == losses["one region, cache_enabled=False"] == fresh


def test_memory_rows_and_cli(tmp_path, capsys):
    rows = ad.mlp_memory_rows("cpu", dtypes=(torch.bfloat16,), width=64, batch=16)
    assert rows[0]["dtype"] == "bf16" and rows[0]["peak_fp32"] is None
    # 16 bits take half the bytes, but the bf16 step also saves its cast of the input batch, which the
    # fp32 step saves as the input itself (existing memory): three layers, 4 casts against 3 outputs
    assert abs(rows[0]["activations_low"] / rows[0]["activations_fp32"] - 4 / 6) < 0.02
    assert rows[0]["weight_copies_low"] > 0 and rows[0]["existing_fp32"] > 0
    assert ad.format_mlp_memory_rows(rows).splitlines()[1].split()[-2:] == ["-", "-"]  # no peaks off CUDA
    out = tmp_path / "mem.json"
    assert ad.main(["--device", "cpu", "--width", "64", "--json", str(out)]) == 0
    assert "activations fp32" in capsys.readouterr().out
    assert {r["dtype"] for r in json.loads(out.read_text())["rows"]} == {"fp16", "bf16"}


def test_module_dtypes_shows_where_autocast_casts():
    model = nn.Sequential(nn.ReLU(), nn.Linear(8, 8), nn.ReflectionPad1d(1), nn.ReLU())
    rows = ad.module_dtypes(model, torch.randn(2, 3, 8), device_type="cpu", dtype=torch.bfloat16)
    assert [r.name for r in rows] == ["0", "1", "2", "3"]
    assert (rows[0].in_dtype, rows[0].out_dtype) == (torch.float32, torch.float32)
    assert (rows[1].in_dtype, rows[1].out_dtype) == (torch.float32, torch.bfloat16)
    assert "cast down" in ad.format_module_dtypes(rows)
    assert not model[0]._forward_hooks  # hooks removed


def test_weight_cast_cache_casts_each_parameter_once_per_region():
    layer, x = nn.Linear(16, 16), torch.randn(4, 16)
    counts = {}
    for cache in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            counts[cache] = disp.casts(disp.dispatch_trace(lambda: layer(layer(layer(x)))))[("fp32", "bf16")]
    assert counts[True] == 3 and counts[False] == 7  # x, weight, bias once / x + 3 x (weight, bias)


def test_policy_rows_round_trip_through_json(cpu_rows):
    back = [ap.PolicyRow.from_dict(json.loads(json.dumps(r.as_dict()))) for r in cpu_rows]
    assert back == cpu_rows
    text = ap.format_policy(cpu_rows)
    assert "linear" in text and "lower_precision" in text


def test_tables_fit_in_100_columns_and_keep_long_notes_as_numbered_notes(cpu_rows):
    long = ap.PolicyRow(
        "index_put",
        "layout",
        "cpu",
        torch.bfloat16,
        torch.float32,
        torch.bfloat16,
        None,
        "unchanged",
        "mixed inputs raise RuntimeError: " + "a long message " * 10,
    )
    for text in (ap.format_policy([*cpu_rows, long]), ap.format_by_policy(cpu_rows)):
        assert max(len(line) for line in text.splitlines()) <= 100
    text = ap.format_policy([*cpu_rows, long])
    assert "(see note 1)" in text and "a long message" in text.split("(see note 1)")[1]
    by_policy = ap.format_by_policy(cpu_rows)
    assert all(r.op in by_policy for r in cpu_rows)


def test_backward_ops_run_in_the_dtype_of_their_forward_ops():
    torch.manual_seed(0)
    layer, x = nn.Linear(16, 4), torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fwd = disp.dispatch_trace(lambda: F.mse_loss(F.softmax(layer(x), dim=-1), torch.zeros(8, 4)))
        loss = F.mse_loss(F.softmax(layer(x), dim=-1), torch.zeros(8, 4))
    bwd = disp.dispatch_trace(loss.backward)
    pairs = {f.op: (f.out_dtype, b.out_dtype) for f, b in disp.backward_pairs(fwd, bwd)}
    assert pairs == {"mse_loss": (torch.float32,) * 2, "_softmax": (torch.bfloat16,) * 2}
    assert disp.casts(bwd)[("bf16", "fp32")] == 2  # the weight's and the bias's gradients come back as fp32


def test_backward_under_autocast_casts_an_fp32_island_down():
    lin, x = nn.Linear(8, 8), torch.randn(4, 8)

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cpu", enabled=False):
            return lin(x).sum()

    outside = disp.dispatch_trace(loss().backward)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = disp.dispatch_trace(loss().backward)
    assert {e.out_dtype for e in outside if e.op == "mm"} == {torch.float32}
    assert {e.out_dtype for e in inside if e.op == "mm"} == {torch.bfloat16}


def test_registered_ops_lists_the_dispatcher_registrations():
    cpu = disp.registered_ops("cpu")
    assert "mm" in cpu and "mse_loss" in cpu and "relu" not in cpu


def test_cli_prints_tables_and_writes_json(tmp_path, capsys):
    out = tmp_path / "policy.json"
    assert ap.main(["--device", "cpu", "--json", str(out)]) == 0
    assert "lower_precision" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert {"device", "torch", "date", "command"} <= set(data["provenance"])
    assert set(data["policy"]) == {"fp16", "bf16"}


def test_the_memory_reading_follows_the_numbers_and_flags_rows_that_disagree():
    from course_lib.chapters.ch02.autocast_dtypes import read_mlp_memory_rows

    # the H100 MLP: autocast saves 8 MiB of activations and adds 64 MiB of weight copies
    mlp = {
        "dtype": "bf16",
        "activations_fp32": 24.0,
        "activations_low": 16.0,
        "weight_copies_low": 64.0,
        "peak_fp32": 465.4,
        "peak_low": 489.4,
    }
    text = " ".join(read_mlp_memory_rows([mlp]).split())
    assert "spared 8.0 MiB of activations" in text and "added 64.0 MiB of 16-bit weight copies" in text
    assert "keeps 56.0 MiB more" in text and "from 465.4 to 489.4 MiB (+24.0 MiB)" in text
    heavy = {**mlp, "activations_fp32": 800.0, "activations_low": 400.0, "peak_low": 300.0}
    text = " ".join(read_mlp_memory_rows([heavy]).split())
    assert "keeps 336.0 MiB less" in text and "(-165.4 MiB)" in text and "gradient" not in text
    recorded_before_kinds = {"dtype": "fp16", "peak_fp32": 465.4, "peak_low": 489.4}
    expected = "fp16: The step's peak went from 465.4 to 489.4 MiB (+24.0 MiB)."
    assert read_mlp_memory_rows([recorded_before_kinds]) == expected
    cpu = {**mlp, "peak_fp32": None, "peak_low": None}
    assert "peak" not in read_mlp_memory_rows([cpu])
    text = read_mlp_memory_rows([mlp, {**mlp, "dtype": "fp16", "peak_fp32": 794.0, "peak_low": 898.0}])
    assert "differ (465 to 794 MiB)" in " ".join(text.split())  # the same fp32 step, measured twice: one count is off
    assert all(len(line) <= 100 for line in text.splitlines())
