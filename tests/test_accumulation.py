"""course_lib.chapters.ch04.accumulation and accumulation_pitfalls: the loop is the large batch; the demonstrations
show what chapter 04 says."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.chapters.ch04 import accumulation as A
from course_lib.chapters.ch04 import accumulation_pitfalls as P
from course_lib.chapters.ch04 import accumulation_tokens as T


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
        lambda o, args, kw: captured.update(g=torch.cat([p.grad.flatten() for p in model.parameters()]))
    )
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
    skipped = A.accumulation_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        scaler,
        list(zip(x.split(8), y.split(8))),
        dtype=torch.float16,
    )
    assert skipped is True and scaler.get_scale() == 128.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_clipping_unscales_once_at_the_boundary():
    x, y = data(16)
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    A.accumulation_step(model, opt, scaler, list(zip(x.split(4), y.split(4))), dtype=torch.float16, clip_grad_norm=1e-3)
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    assert norm == pytest.approx(1e-3, rel=1e-3)  # clipped on true, unscaled gradients


def test_equivalence_rows_are_within_a_few_eps_in_every_precision():
    rows = A.equivalence_rows(batch=32, splits=(2, 4))
    assert {r["precision"] for r in rows} == {"fp32", "bf16", "fp16"}
    assert all(r["vs_large"] <= 4 * r["eps"] for r in rows)
    assert all(r["vs_large"] < r["large_vs_fp64"] for r in rows if r["precision"] != "fp32")
    assert "yes" in A.format_equivalence_rows(rows) and "NO" not in A.format_equivalence_rows(rows)


def test_scale_trajectories_show_what_update_per_micro_batch_does():
    right, every, step_every = (
        P.scale_trajectory(v, steps=6, accum=4, bad=(5,), init_scale=2.0**10, growth_interval=2)
        for v in P.LOOP_VARIANTS
    )

    def halvings(r):
        before = [2.0**10] + r["scale"][:-1]
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
    assert calls == {
        "no no_sync": [0, 1, 2, 3],
        "no_sync around forward and backward": [3],
        "no_sync around backward only": [0, 1, 2, 3],
        "flag set between forward and backward": [0],
        "course_lib.train.Trainer.train_step": [3],
    }


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
        A.accumulation_step(
            ddp,
            torch.optim.SGD(ddp.parameters(), lr=0.1),
            torch.amp.GradScaler("cpu", enabled=False),
            list(zip(x.split(4), y.split(4))),
        )
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
    from course_lib.chapters.ch02.saved_tensors import saved_tensor_bytes

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
    assert (
        A.main(
            [
                "--device",
                "cpu",
                "--model",
                "simplecnn",
                "--batch",
                "4",
                "--accum",
                "1",
                "2",
                "--precisions",
                "fp32",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    saved = json.loads(out.read_text())
    assert saved["provenance"]["command"].startswith("python -m course_lib.chapters.ch04.accumulation")
    assert len(saved["rows"]) == 2 and saved["batch"] == 4 and saved["saved_counts"] == A.SAVED_COUNTS
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


# --------------------------------------------------------------------------- the recorded table, read


def test_recount_saved_takes_off_what_an_older_recording_also_counted():
    from course_lib.reference import load_references

    refs = load_references("accumulation_*.json")
    if not refs:
        pytest.skip("no accumulation recording")
    for ref in refs:
        rows, extra = A.recount_saved(ref)
        if not extra:  # recorded with today's count: nothing to take off
            assert rows == ref["rows"] and ref.get("saved_counts") == A.SAVED_COUNTS
            continue
        assert extra["fp32"] > 40 * 2**20  # a ResNet-18's parameters (43 MiB) and the input batch
        fp32 = [r for r in rows if r["precision"] == "fp32"]
        per_sample = [r["saved_micro"] / r["micro_size"] for r in fp32]
        assert max(per_sample) < 1.001 * min(per_sample), "left: activations only, in proportion to the micro-batch"
        old = [r["saved_micro"] / r["micro_size"] for r in ref["rows"] if r["precision"] == "fp32"]
        assert max(old) > 1.05 * min(old)  # as recorded, they were not
    assert A.recount_saved({"saved_counts": A.SAVED_COUNTS, "rows": [{"saved_micro": 1}]}) == ([{"saved_micro": 1}], {})


def test_saved_kinds_counts_the_whole_input_batch_as_existing_in_fp32_only():
    fp32, bf16 = (A.saved_kinds("simplecnn", batch=64, precision=p) for p in ("fp32", "bf16"))
    inputs = 64 * 28 * 28 * 4
    assert fp32["existing"] > inputs and fp32["weight copies"] == 0
    assert bf16["existing"] < inputs and bf16["weight copies"] > 0  # the input cast to bf16 is a new tensor
    more = A.saved_kinds("simplecnn", batch=128)["existing"] - fp32["existing"]
    assert more == inputs + 64 * 8  # the input batch's storage and its labels' (int64), whole, for any micro-batch


def memory_row(p, n, ms, q, saved=800.0, rest=100.0):
    return {
        "precision": p,
        "micro_batches": n,
        "micro_size": 512 // n,
        "saved_micro": saved / n,
        "peak_saved": saved / n,
        "peak": rest + saved / n,
        "ms": ms,
        "ms_q": q,
    }


def test_read_memory_rows_reads_the_ratios_and_the_times_with_their_spread():
    rows = [
        memory_row("fp32", 1, 26.2, [26.1, 26.3]),
        memory_row("fp32", 8, 47.8, [47.5, 64.5]),
        memory_row("fp32", 16, 107.6, [106.3, 107.7]),
        memory_row("bf16", 1, 22.0, [21.9, 22.1]),
        memory_row("bf16", 8, 62.7, [56.2, 85.0]),
        memory_row("bf16", 16, 98.9, [94.7, 107.8]),
    ]
    text = A.read_memory_rows(rows)
    assert "fp32, 1 -> 16 micro-batches: peak saved 16.0x smaller, peak CUDA 6.00x smaller, step 4.1x longer" in text
    assert "hardly moved" not in text
    assert "1 x 512  0.84, faster (the middle halves do not overlap)" in text
    assert "8 x 64   1.31, slower by the medians, but the middle halves overlap" in text
    assert "16 x 32   0.92, the same within the spread" in text
    assert "fp32 8 -> 16" not in text  # micro-batch sizes, not counts
    assert "fp32 64 -> 32, bf16 64 -> 32" in text  # a micro-batch half as large, hardly quicker
    assert f"{A.TIMED_STEPS} timed steps per row; the widest middle half spans 46% of its median (bf16, 8 x 64)" in text
    cpu = [{**r, "peak": None, "ms": None, "ms_q": None} for r in rows]
    assert A.read_memory_rows(cpu).splitlines() == [
        "fp32, 1 -> 16 micro-batches: peak saved 16.0x smaller",
        "bf16, 1 -> 16 micro-batches: peak saved 16.0x smaller",
    ]
    stuck = [memory_row("fp32", 1, 26.2, [26.1, 26.3], rest=3000.0), memory_row("fp32", 16, 30, [29, 31], rest=3000.0)]
    assert "the peak hardly moved" in A.read_memory_rows(stuck)


# --------------------------------------------------------------------------- token-level losses


def large_token_grad(micro):
    """The large batch's gradient, written out: every sequence in one batch, the mean over all real tokens."""
    tokens, targets = (torch.cat(t) for t in zip(*micro))
    model = T.token_model()
    logits = model(tokens)
    real = targets != T.IGNORE_INDEX
    F.cross_entropy(logits[real], targets[real]).backward()
    return torch.cat([p.grad.flatten().double() for p in model.parameters()])


def test_padded_micro_batches_pad_with_the_ignore_index():
    micro = T.padded_micro_batches([[5, 2], [1]], vocab=16, seed=3)
    assert [tuple(t.shape) for t, _ in micro] == [(2, 5), (1, 5)]  # padded to the longest of them all
    assert [T.real_tokens(y) for _, y in micro] == [7, 1]
    tokens, targets = micro[0]
    assert (tokens[1, 2:] == T.PAD).all() and (targets[1, 2:] == T.IGNORE_INDEX).all()
    assert (tokens[1, :2] != T.PAD).all() and (targets[1, :2] >= 0).all()


@pytest.mark.parametrize("lengths", [[[9, 2], [3, 1]], [[12, 3, 2], [11, 12, 9], [2, 1, 4]]])
def test_dividing_by_all_real_tokens_is_the_large_batch_and_the_mean_per_micro_batch_is_not(lengths):
    micro = T.padded_micro_batches(lengths)
    counts = [T.real_tokens(y) for _, y in micro]
    assert len(set(counts)) > 1  # the micro-batches hold different numbers of real tokens
    large = large_token_grad(micro)
    tol = 8 * torch.finfo(torch.float32).eps * large.abs().max()
    right = T.token_grad(T.token_model(), micro, T.NORMALISATIONS[1])
    wrong = T.token_grad(T.token_model(), micro, T.NORMALISATIONS[0])
    assert (right - large).abs().max() < tol
    assert (wrong - large).abs().max() > 0.05 * large.abs().max()


def test_with_equal_real_tokens_per_micro_batch_both_normalisations_agree():
    micro = T.padded_micro_batches([[6, 4, 2], [5, 5, 2], [8, 3, 1]])  # 12 real tokens each, in ragged sequences
    assert [T.real_tokens(y) for _, y in micro] == [12, 12, 12]
    large = large_token_grad(micro)
    tol = 8 * torch.finfo(torch.float32).eps * large.abs().max()
    for n in T.NORMALISATIONS:
        assert (T.token_grad(T.token_model(), micro, n) - large).abs().max() < tol
    with pytest.raises(ValueError):
        T.token_grad(T.token_model(), micro, "mean")


def test_token_rows_report_both_normalisations_against_the_large_batch():
    rows = T.token_rows({"different": [[9, 2], [3, 1]], "equal": [[3, 1], [2, 2]]})
    assert [r["tokens"] for r in rows] == [[11, 4], [4, 4]]
    different, equal = rows
    assert different[T.NORMALISATIONS[0]] > 0.05 * different["largest"]
    eps = torch.finfo(torch.float32).eps
    assert different[T.NORMALISATIONS[1]] < 8 * eps * different["largest"]
    assert max(equal[n] for n in T.NORMALISATIONS) < 8 * eps * equal["largest"]


def test_amp_step_weights_by_tokens_when_y_holds_the_real_targets_only():
    from course_lib.train import amp_step

    micro = T.padded_micro_batches([[9, 2], [3, 1]])
    large = large_token_grad(micro)

    def course_loop(batches):
        net = T.token_model()
        amp_step(
            net,
            torch.optim.SGD(net.parameters(), lr=0.0),
            torch.amp.GradScaler("cpu", enabled=False),
            batches,
            None,
            forward=lambda x, y: T.token_loss(net, *x),
        )
        return torch.cat([p.grad.flatten().double() for p in net.parameters()])

    by_tokens = course_loop([((t, y), y[y != T.IGNORE_INDEX]) for t, y in micro])
    by_sequences = course_loop([((t, y), y) for t, y in micro])
    assert (by_tokens - large).abs().max() < 8 * torch.finfo(torch.float32).eps * large.abs().max()
    assert (by_sequences - large).abs().max() > 0.05 * large.abs().max()
