"""course_lib.device: the precision policy and the errors it gives."""
import pytest
import torch

from course_lib import device as D


@pytest.mark.parametrize("cc, precision, scaler", [
    ((7, 0), "fp16", True),   # V100
    ((7, 5), "fp16", True),   # T4: bf16 would be emulated
    ((8, 0), "bf16", False),  # A100
    ((8, 6), "bf16", False),  # RTX 30xx / A10
    ((8, 9), "bf16", False),  # L4 / RTX 40xx
    ((9, 0), "bf16", False),  # H100 / H200
    ((6, 1), "fp32", False),  # Pascal: no Tensor Cores
])
def test_recommend_precision_follows_compute_capability(cc, precision, scaler):
    rec = D.recommend_precision(capability=cc)
    assert (rec.precision, rec.use_grad_scaler) == (precision, scaler)
    assert rec.reason


def test_native_bf16_is_decided_by_capability_not_emulation():
    assert D.has_native_bf16(capability=(7, 5)) is False
    assert D.has_native_bf16(capability=(8, 0)) is True


def test_tensor_core_generation_names_turing_and_none_before_volta():
    assert "Turing" in D.tensor_core_generation((7, 5))
    assert "Hopper" in D.tensor_core_generation((9, 0))
    assert D.tensor_core_generation((6, 1)) is None


def test_bf16_on_a_gpu_without_native_bf16_raises_a_clear_error(monkeypatch):
    monkeypatch.setattr(D, "has_native_bf16", lambda *a, **k: False)
    monkeypatch.setattr(D, "cuda_capability", lambda *a, **k: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    with pytest.raises(D.PrecisionError, match=r"Tesla T4.*sm_75.*precision='fp16'"):
        D.check_precision("bf16", torch.device("cuda"))


def test_unknown_precision_is_rejected_with_the_valid_names():
    with pytest.raises(D.PrecisionError, match="'fp32', 'bf16', 'fp16'"):
        D.check_precision("fp8", torch.device("cpu"))


def test_cpu_recommendation_warns_about_speed():
    rec = D.recommend_precision("cpu")
    assert rec.precision == "bf16" and not rec.use_grad_scaler and rec.warning


def test_hardware_report_names_torch_version_and_recommendation():
    text = D.hardware_report("cpu")
    assert torch.__version__ in text and "recommended precision" in text
