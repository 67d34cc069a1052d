"""course_lib.models: shapes, the seed's SimpleCNN fixes, and name lookup."""

import pytest
import torch

from course_lib.models import MLP, SimpleCNN, build_model, small_resnet


def test_simplecnn_accepts_one_channel_and_channels_last_input():
    m = SimpleCNN(in_channels=1)
    x = torch.randn(4, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    assert m(x).shape == (4, 10)


def test_simplecnn_registers_its_pooling_layer_once():
    # The seed built nn.AdaptiveAvgPool2d inside forward(); ours is a registered submodule.
    assert isinstance(SimpleCNN().pool, torch.nn.AdaptiveAvgPool2d)


def test_mlp_output_shape():
    assert MLP(in_features=784, hidden=32)(torch.randn(3, 1, 28, 28)).shape == (3, 10)


def test_small_resnet_keeps_resolution_for_small_images():
    m = small_resnet(in_channels=1)
    assert m.maxpool.__class__.__name__ == "Identity"
    assert m(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_build_model_rejects_unknown_names():
    with pytest.raises(ValueError, match="simplecnn"):
        build_model("vgg")


def test_gpt_sdpa_and_explicit_attention_agree_and_initial_loss_is_chance():
    import math

    from course_lib.models import GPT, GPTConfig

    small = dict(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)
    explicit, fused = GPT(GPTConfig(**small, sdpa=False)), GPT(GPTConfig(**small))
    fused.load_state_dict(explicit.state_dict())
    idx = torch.randint(0, 128, (2, 16))
    loss_a, loss_b = explicit(idx, idx)[1], fused(idx, idx)[1]
    assert torch.allclose(loss_a, loss_b, atol=1e-5)
    assert abs(loss_a.item() - math.log(128)) < 0.5  # GPT-2's init: no token is favoured yet
    assert explicit.lm_head.weight is explicit.wte.weight  # tied, as in GPT-2


def test_gpt2_small_has_124m_parameters_and_nanogpts_flop_count():
    from course_lib.models import GPT

    model = GPT()
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 124.5
    assert round(model.flops_per_token(1024) / 1e6) == 855  # 6N + 12 L E T
