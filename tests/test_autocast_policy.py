"""course_lib.chapters.autocast_policy (chapter 02) and the chapter 02 checks.

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

from course_lib.chapters import autocast_dtypes as ad
from course_lib.chapters import autocast_policy as ap
from course_lib.models import SimpleCNN
from course_lib.tooling.grading import CheckFailure, get_check

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
        direct = {"softmax": F.softmax(x, -1).dtype, "layer_norm": F.layer_norm(x, (16,)).dtype,
                  "sum": x.sum().dtype, "mse_loss": F.mse_loss(x, x).dtype, "matmul": (x.float() @ x.float().T).dtype}
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
        assert ap.casts(ap.dispatch_trace(lambda: torch.cat([a, b])))[("bf16", "fp32")] == 1
        assert not ap.casts(ap.dispatch_trace(lambda: a + b))


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


def test_saved_activations_are_bf16_and_about_half_the_bytes():
    torch.manual_seed(0)
    mem = ad.memory_comparison(SimpleCNN(in_channels=1), torch.randn(16, 1, 16, 16), torch.randint(0, 10, (16,)),
                               dtype=torch.bfloat16)
    assert mem["fp32"]["peak"] is None  # no allocator statistics off CUDA
    by_dtype = mem["bf16"]["saved_by_dtype"]
    assert by_dtype["bf16"] > 0.9 * mem["bf16"]["saved"]
    assert "bf16" not in mem["fp32"]["saved_by_dtype"]
    assert 0.4 < mem["bf16"]["saved"] / mem["fp32"]["saved"] < 0.6


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
            counts[cache] = ap.casts(ap.dispatch_trace(lambda: layer(layer(layer(x)))))[("fp32", "bf16")]
    assert counts[True] == 3 and counts[False] == 7  # x, weight, bias once / x + 3 x (weight, bias)


def test_policy_rows_round_trip_through_json(cpu_rows):
    back = [ap.PolicyRow.from_dict(json.loads(json.dumps(r.as_dict()))) for r in cpu_rows]
    assert back == cpu_rows
    text = ap.format_policy(cpu_rows)
    assert "linear" in text and "lower_precision" in text


def test_registered_ops_lists_the_dispatcher_registrations():
    cpu = ap.registered_ops("cpu")
    assert "mm" in cpu and "mse_loss" in cpu and "relu" not in cpu


def test_cli_prints_tables_and_writes_json(tmp_path, capsys):
    out = tmp_path / "policy.json"
    assert ap.main(["--device", "cpu", "--json", str(out)]) == 0
    assert "lower_precision" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert {"device", "torch", "date", "command"} <= set(data["provenance"])
    assert set(data["policy"]) == {"fp16", "bf16"}


# --------------------------------------------------------------------------- chapter 02 checks

def _passes(name, obj):
    get_check(name).fn(obj)


def _fails(name, obj):
    with pytest.raises(CheckFailure):
        get_check(name).fn(obj)


def predict_ref(op, device_type, autocast_dtype, input_dtypes):
    if op in ("linear", "matmul"):
        return autocast_dtype
    if op == "mse_loss" or (device_type == "cuda" and op in ("softmax", "layer_norm", "sum")):
        return torch.float32
    return torch.float32 if torch.float32 in input_dtypes else input_dtypes[0]


def test_predict_dtype_accepts_the_reference_and_rejects_wrong_rules():
    _passes("02.predict_dtype", predict_ref)
    _fails("02.predict_dtype", lambda op, d, dt, ins: dt)  # "everything runs in 16 bits"
    _fails("02.predict_dtype", lambda op, d, dt, ins: ins[0])  # "autocast changes nothing"
    # "losses are fp32, the rest follows the input": misses the lower-precision list
    _fails("02.predict_dtype",
           lambda op, d, dt, ins: torch.float32 if op == "mse_loss" else predict_ref("add", d, dt, ins))
    if FAKE_CUDA or torch.cuda.is_available():  # the CUDA lists applied on the CPU too
        _fails("02.predict_dtype", lambda op, d, dt, ins: predict_ref(op, "cuda", dt, ins))


def _sqdist_factory(cast_inputs=True, fwd=True, bwd=True, grad_factor=1.0, swap_device=False):
    def make(device_type):
        dev = ("cuda" if device_type == "cpu" else "cpu") if swap_device else device_type

        class SqDist(torch.autograd.Function):
            @staticmethod
            def forward(ctx, a, b):
                ctx.save_for_backward(a, b)
                return (a * a).sum(1, keepdim=True) + (b * b).sum(1) - 2 * a @ b.T

            @staticmethod
            def backward(ctx, g):
                a, b = ctx.saved_tensors
                return (grad_factor * 2 * (g.sum(1, keepdim=True) * a - g @ b),
                        2 * (g.sum(0)[:, None] * b - g.T @ a))

        if fwd:
            deco = torch.amp.custom_fwd(device_type=dev, cast_inputs=torch.float32 if cast_inputs else None)
            SqDist.forward = staticmethod(deco(SqDist.__dict__["forward"].__func__))
        if bwd:
            SqDist.backward = staticmethod(torch.amp.custom_bwd(device_type=dev)(SqDist.__dict__["backward"].__func__))
        return SqDist
    return make


def test_make_sqdist_accepts_the_reference_and_rejects_unsafe_versions():
    _passes("02.make_sqdist", _sqdist_factory())
    _fails("02.make_sqdist", _sqdist_factory(fwd=False, bwd=False))      # no decorators: bf16 output
    _fails("02.make_sqdist", _sqdist_factory(cast_inputs=False))         # forward runs under autocast
    _fails("02.make_sqdist", _sqdist_factory(bwd=False))                 # backward runs under autocast
    _fails("02.make_sqdist", _sqdist_factory(swap_device=True))          # decorated for the other device
    _fails("02.make_sqdist", _sqdist_factory(grad_factor=0.5))           # wrong gradient
    _fails("02.make_sqdist", lambda device_type: "not a Function")


def islands_ref(model, x, device_type, dtype):
    found = []
    def hook(mod, args, out, n):
        if args[0].dtype in (torch.float16, torch.bfloat16) and out.dtype == torch.float32:
            found.append(n)

    hooks = [m.register_forward_hook(lambda mod, args, out, n=n: hook(mod, args, out, n))
             for n, m in model.named_modules() if not list(m.children())]
    with torch.autocast(device_type, dtype=dtype):
        model(x)
    for h in hooks:
        h.remove()
    return found


def test_find_fp32_islands_accepts_the_reference_and_rejects_wrong_answers():
    _passes("02.find_fp32_islands", islands_ref)

    def every_fp32_output(model, x, device_type, dtype):  # forgets to look at the input dtype
        rows = ad.module_dtypes(model, x, device_type=device_type, dtype=dtype)
        return [r.name for r in rows if r.out_dtype == torch.float32]

    def by_type(model, x, device_type, dtype):  # the CUDA list, by module type
        return [n for n, m in model.named_modules() if isinstance(m, (nn.GroupNorm, nn.Softmax, nn.Upsample))]

    _fails("02.find_fp32_islands", every_fp32_output)
    if not torch.cuda.is_available():  # on a GPU machine the check may draw CUDA, where by_type is sometimes right
        _fails("02.find_fp32_islands", by_type)
    _fails("02.find_fp32_islands", lambda model, x, device_type, dtype: [])
