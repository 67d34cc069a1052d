"""course_lib.chapters.accumulation and accumulation_pitfalls: the loop is the large batch; the demonstrations
show what chapter 04 says."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.chapters import accumulation as A
from course_lib.chapters import accumulation_pitfalls as P


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_accumulation_step_gives_the_large_batch_gradient_on_ragged_micro_batches():
    x, y = data(23)
    micro = list(zip(x.split(7), y.split(7)))  # 7, 7, 7, 2
    model, large_model = mlp(), mlp()
    captured = {}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    opt.register_step_pre_hook(
        lambda o, args, kw: captured.update(g=torch.cat([p.grad.flatten() for p in model.parameters()])))
    skipped = A.accumulation_step(model, opt, torch.amp.GradScaler("cpu", enabled=False), micro)
    large = A.accumulated_grad(large_model, [(x, y)])
    assert skipped is False
    assert A.rel_diff(captured["g"], large) < 4 * torch.finfo(torch.float32).eps
    wrong = A.accumulated_grad(mlp(), micro, weights=[1 / 4] * 4)  # the mean of means
    assert A.rel_diff(wrong, large) > 0.05


def test_accumulation_step_zeroes_old_gradients_and_skips_a_step_with_an_inf():
    x, y = data(16)
    model = mlp()
    for p in model.parameters():
        p.grad = torch.full_like(p, 100.0)
    before = [p.detach().clone() for p in model.parameters()]
    x[3, 0] = float("inf")
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    skipped = A.accumulation_step(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler,
                                  list(zip(x.split(8), y.split(8))), dtype=torch.float16)
    assert skipped is True and scaler.get_scale() == 128.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_clipping_unscales_once_at_the_boundary():
    x, y = data(16)
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    A.accumulation_step(model, opt, scaler, list(zip(x.split(4), y.split(4))), dtype=torch.float16,
                        clip_grad_norm=1e-3)
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    assert norm == pytest.approx(1e-3, rel=1e-3)  # clipped on true, unscaled gradients


def test_equivalence_rows_are_within_a_few_eps_in_every_precision():
    rows = A.equivalence_rows(batch=32, splits=(2, 4))
    assert {r["precision"] for r in rows} == {"fp32", "bf16", "fp16"}
    assert all(r["vs_large"] <= 4 * r["eps"] for r in rows)
    assert all(r["vs_large"] < r["large_vs_fp64"] for r in rows if r["precision"] != "fp32")
    assert "yes" in A.format_equivalence_rows(rows) and "NO" not in A.format_equivalence_rows(rows)


def test_scale_trajectories_show_what_update_per_micro_batch_does():
    right, every, step_every = (P.scale_trajectory(v, steps=6, accum=4, bad=(5,), init_scale=2.0 ** 10,
                                                   growth_interval=2) for v in P.LOOP_VARIANTS)

    def halvings(r):
        before = [2.0 ** 10] + r["scale"][:-1]
        return sum(b > a for b, a in zip(before, r["scale"]))

    assert right["skipped"] == [7] and len(right["stepped"]) == 5 and halvings(right) == 1
    scale = right["scale"]
    assert all(scale[i] == scale[i - 1] for i in range(1, len(scale)) if i % 4 != 3)  # changes only at boundaries
    assert halvings(every) == 3 and halvings(step_every) == 3  # micro-batches 5, 6, 7 all see the NaN
    assert len(step_every["stepped"]) + len(step_every["skipped"]) == 24
    assert max(every["scale"]) > max(right["scale"])  # growth counted per micro-batch
    with pytest.raises(ValueError):
        P.scale_trajectory("update whenever")


def test_only_the_right_loop_hands_the_optimizer_the_large_batch_gradient():
    errors = {v: P.scale_trajectory(v, steps=1, bad=(), lr=0.0)["errors"] for v in P.LOOP_VARIANTS}
    right, every, step_every = errors.values()
    assert len(right) == 1 and right[0] < 4 * torch.finfo(torch.float16).eps
    assert len(every) == 1 and every[0] > 0.3
    assert len(step_every) == 4 and min(step_every) > 0.3


def test_batchnorm_is_not_equivalent_but_per_sample_norms_are():
    rows = P.norm_rows(batch=32, micro_sizes=(16, 4))
    for r in rows:
        if r["norm"] == "BatchNorm":
            assert r["grad"] > 0.05 and r["running_mean"] > 0.1
        else:
            assert r["grad"] < 1e-6 and r["running_mean"] is None
    bn = [r["grad"] for r in rows if r["norm"] == "BatchNorm"]
    assert bn[0] < bn[1]  # smaller micro-batches, larger gap
    assert "GroupNorm" in P.format_norm_rows(rows)


def test_ddp_all_reduces_where_the_forward_said_so():
    calls = {p: P.allreduce_calls(p, accum=4) for p in P.SYNC_PATTERNS}
    assert calls == {"no no_sync": [0, 1, 2, 3], "no_sync around forward and backward": [3],
                     "no_sync around backward only": [0, 1, 2, 3], "flag set between forward and backward": [0],
                     "course_lib.train.Trainer.train_step": [3]}


def test_accumulation_step_under_ddp_all_reduces_once():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    x, y = data(16)
    hits = []

    def hook(state, bucket):
        hits.append(1)
        return allreduce_hook(None, bucket)

    with P._one_process_group():
        ddp = nn.parallel.DistributedDataParallel(mlp())
        ddp.register_comm_hook(None, hook)
        A.accumulation_step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), torch.amp.GradScaler("cpu", enabled=False),
                            list(zip(x.split(4), y.split(4))))
    assert len(hits) == 1


def test_article_001_loop_leaks_the_epoch_tail_into_the_next_step():
    log = P.article_001_loop([16] * 9 + [5], epochs=2, iters_to_accumulate=4, gradient_accumulation_steps=4)
    assert [len(s["batches"]) for s in log] == [4, 4, 6, 4, 2]
    assert log[2]["batches"][:2] == [(0, 8), (0, 9)] and log[2]["max_weight"] == pytest.approx(85 / 20)
    assert log[-1]["stepped"] is False and all(s["stepped"] for s in log[:-1])
    assert log[0]["min_weight"] == log[0]["max_weight"] == 1.0
    mismatched = P.article_001_loop([16] * 8, epochs=1, iters_to_accumulate=1, gradient_accumulation_steps=4)
    assert [s["min_weight"] for s in mismatched] == [4.0, 4.0]


def test_peak_saved_bytes_follows_the_micro_batch_not_their_number():
    from course_lib.timing import saved_tensor_bytes
    model = mlp()
    x, y = data(32)
    opt, off = torch.optim.SGD(model.parameters(), lr=0.0), torch.amp.GradScaler("cpu", enabled=False)
    micro = list(zip(x.split(4), y.split(4)))
    one = A.peak_saved_bytes(lambda: A.accumulation_step(model, opt, off, micro[:1]))
    eight = A.peak_saved_bytes(lambda: A.accumulation_step(model, opt, off, micro))
    large = A.peak_saved_bytes(lambda: A.accumulation_step(model, opt, off, [(x, y)]))
    assert one == eight < large
    assert one == sum(saved_tensor_bytes(lambda: F.cross_entropy(model(micro[0][0]), micro[0][1])).values())


def test_memory_rows_on_a_cpu_and_the_recording_cli(tmp_path, capsys):
    rows = A.memory_rows("cpu", "simplecnn", batch=8, accum=(1, 2), precisions=("fp32",))
    assert [r["micro_batches"] for r in rows] == [1, 2]
    assert all(r["peak"] is None and r["ms"] is None for r in rows)
    assert rows[1]["peak_saved"] < rows[0]["peak_saved"] and rows[1]["saved_micro"] < rows[0]["saved_micro"]
    assert "n/a" in A.format_memory_rows(rows)
    out = tmp_path / "accumulation_test.json"
    assert A.main(["--device", "cpu", "--model", "simplecnn", "--batch", "4", "--accum", "1", "2",
                   "--precisions", "fp32", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["provenance"]["command"].startswith("python -m course_lib.chapters.accumulation")
    assert len(saved["rows"]) == 2 and saved["batch"] == 4
    assert "wrote" in capsys.readouterr().out


def test_peak_saved_bytes_frees_a_graph_that_never_ran_backward():
    import gc
    import weakref

    lin, kept = torch.nn.Linear(16, 16), []

    def forward():
        h = lin(torch.randn(4, 16)).relu()
        kept.append(weakref.ref(h))
        h.sum()

    assert A.peak_saved_bytes(forward) > 0
    gc.collect()
    assert kept[0]() is None, "the saved ReLU output outlived the measurement"
