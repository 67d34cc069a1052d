"""course_lib.chapters.ch02.saved_tensors: what autograd saves for backward, by kind and dtype, in bytes."""

import torch

from course_lib.chapters.ch02 import saved_tensors as ST


def test_saved_bytes_tell_activations_autocast_weight_copies_and_existing_tensors_apart():
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)  # a leaf that requires grad, but no parameter

    def forward():
        return lin(x).relu().sum()

    fp32 = ST.saved_bytes_by_kind(forward)
    # fp32: Linear saves its input and its weight, which both existed before; ReLU saves its output
    assert fp32["activations"] == {torch.float32: 64 * 256 * 4}
    assert fp32["weight copies"] == {}
    assert fp32["existing"] == {torch.float32: 256 * 256 * 4 + 64 * 256 * 4}
    assert ST.saved_activation_bytes(forward) == 64 * 256 * 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = ST.saved_bytes_by_kind(forward)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a new region: the last one's cast cache is gone
        cost = ST.saved_tensor_bytes(forward)
    # autocast: the input's bf16 cast and ReLU's output are new activations, the weight's cast a copy
    assert low["activations"] == {torch.bfloat16: 2 * 64 * 256 * 2}
    assert low["weight copies"] == {torch.bfloat16: 256 * 256 * 2}
    assert low["existing"] == {}
    assert cost == {torch.bfloat16: 2 * 64 * 256 * 2 + 256 * 256 * 2}  # what the saved tensors cost


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

    assert ST.saved_activation_bytes(forward) > 0
    gc.collect()
    assert kept[0]() is None, "the graph saved for backward outlived the count"
