"""course_lib.timing: warm-up + median timing with its spread, and bytes saved for backward."""
import pytest
import torch

from course_lib import timing


def test_time_fn_runs_warmup_plus_iters_and_reports_median():
    calls = []
    t = timing.time_fn(lambda: calls.append(1), warmup=2, iters=5, device="cpu")
    assert len(calls) == 7 and len(t.times_ms) == 5 and t.median_ms >= 0


def test_timing_reports_the_median_and_the_middle_half_not_the_outlier():
    t = timing.Timing([10.0, 11.0, 10.5, 10.2, 95.0])
    assert t.median_ms == 10.5
    lo, hi = t.quartiles_ms
    assert 10.0 <= lo <= 10.5 <= hi <= 11.0  # the 95 ms outlier moves neither
    assert t.rel_spread == pytest.approx((hi - lo) / 10.5)
    assert "median 10.500 ms" in str(t) and "n=5" in str(t)


def test_compare_names_the_faster_by_its_factor_and_admits_when_the_spread_hides_it():
    base = timing.Timing([10.0, 10.5, 11.0, 11.5, 12.0])
    text = timing.compare({"fp32": base, "fast": timing.Timing([4.0, 4.5, 5.0, 5.5, 6.0]),
                           "same": timing.Timing([10.2, 10.8, 11.2, 11.6, 12.4])}, "fp32")
    fast, same = text.split("\nsame")
    assert "2.20x faster" in fast and "larger than the spread" in fast
    assert "slower" in same and "cannot tell them apart" in same
    assert all(len(line) <= 100 for line in text.splitlines())


def test_saved_bytes_tell_activations_autocast_weight_copies_and_existing_tensors_apart():
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)  # a leaf that requires grad, but no parameter

    def forward():
        return lin(x).relu().sum()

    fp32 = timing.saved_bytes_by_kind(forward)
    # fp32: Linear saves its input and its weight, which both existed before; ReLU saves its output
    assert fp32["activations"] == {torch.float32: 64 * 256 * 4}
    assert fp32["weight copies"] == {}
    assert fp32["existing"] == {torch.float32: 256 * 256 * 4 + 64 * 256 * 4}
    assert timing.saved_activation_bytes(forward) == 64 * 256 * 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = timing.saved_bytes_by_kind(forward)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a new region: the last one's cast cache is gone
        cost = timing.saved_tensor_bytes(forward)
    # autocast: the input's bf16 cast and ReLU's output are new activations, the weight's cast a copy
    assert low["activations"] == {torch.bfloat16: 2 * 64 * 256 * 2}
    assert low["weight copies"] == {torch.bfloat16: 256 * 256 * 2}
    assert low["existing"] == {}
    assert cost == {torch.bfloat16: 2 * 64 * 256 * 2 + 256 * 256 * 2}  # what the saved tensors cost


def test_peak_memory_is_none_off_cuda_but_the_function_still_runs():
    calls = []
    assert timing.peak_memory_bytes(lambda: calls.append(1), "cpu") is None and calls == [1]


def test_counting_saved_bytes_frees_the_graph_even_when_no_backward_runs():
    # ReLU saves its own output; a pack hook that kept that tensor (not a detached view) made a cycle
    # through C++ that gc cannot collect, so every forward-only count leaked its whole graph and
    # inflated the next peak-memory measurement by it (pytorch/pytorch#115255).
    import gc
    import weakref

    lin = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64)
    kept = []

    def forward():
        h = lin(x).relu()
        kept.append(weakref.ref(h))
        h.sum()  # the loss is dropped at once: nothing outside holds the graph

    assert timing.saved_activation_bytes(forward) > 0
    gc.collect()
    assert kept[0]() is None, "the graph saved for backward outlived the count"
