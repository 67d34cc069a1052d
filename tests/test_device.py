"""course_lib.device: the precision policy and the errors it gives."""

import pytest
import torch

from course_lib import device as D
from course_lib.chapters.ch01 import matmul as MM


@pytest.mark.parametrize(
    "cc, precision, scaler",
    [
        ((7, 0), "fp16", True),  # V100
        ((7, 5), "fp16", True),  # T4: bf16 would be emulated
        ((8, 0), "bf16", False),  # A100
        ((8, 6), "bf16", False),  # RTX 30xx / A10
        ((8, 9), "bf16", False),  # L4 / RTX 40xx
        ((9, 0), "bf16", False),  # H100 / H200
        ((6, 1), "fp32", False),  # Pascal: no Tensor Cores
    ],
)
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


CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f {extra}\n"


@pytest.mark.parametrize(
    "extra, native",
    [
        ("avx512_bf16", ["avx512_bf16"]),
        ("amx_bf16 amx_tile", ["amx_bf16"]),
        ("avx512_fp16 amx_fp16", []),  # fp16 instructions are no evidence of bf16 ones
        ("", []),
    ],
)
def test_cpu_bf16_flags_count_only_bf16_instruction_sets(extra, native):
    assert D.cpu_bf16_flags(CPUINFO.format(extra=extra)) == native


@pytest.mark.parametrize("flags, precision", [(["avx512_bf16"], "bf16"), ([], "fp32")])
def test_one_cpu_rule_for_recommendation_trainer_auto_and_hardware_report(monkeypatch, flags, precision):
    from course_lib.models import MLP
    from course_lib.train import TrainConfig, Trainer

    monkeypatch.setattr(D, "cpu_bf16_flags", lambda cpuinfo=None: flags)
    rec = D.recommend_precision("cpu")
    assert (rec.precision, rec.use_grad_scaler) == (precision, False)
    assert D.has_native_bf16("cpu") is bool(flags)
    model = MLP(in_features=4, hidden=8, depth=1)
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TrainConfig(precision="auto", device="cpu", progress=False)
    )
    assert trainer.precision == precision
    assert f"recommended precision: {precision}" in D.hardware_report("cpu")


@pytest.mark.parametrize(
    "name, dtype, peak",
    [
        ("Tesla T4", "fp16", 65.0),
        ("Tesla T4", "bf16", None),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "tf32", 378.0),
        ("NVIDIA H200", "fp32", 66.9),
        ("NVIDIA L4", "fp16", 121.0),
        ("NVIDIA A10", "bf16", 125.0),
        ("NVIDIA H100 NVL", "bf16", 835.5),
        ("NVIDIA H200 NVL", "bf16", 835.5),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA A10G", "bf16", None),
        ("NVIDIA GeForce RTX 4090", "bf16", None),
    ],
)
def test_peak_table_knows_datasheet_gpus_and_says_unknown_for_the_rest(name, dtype, peak):
    assert MM.peak_tflops(name, dtype) == peak


def test_hardware_report_names_torch_version_and_recommendation():
    text = D.hardware_report("cpu")
    assert torch.__version__ in text and "recommended precision" in text


@pytest.mark.parametrize("flags", [["amx_bf16", "avx512_bf16"], []])
def test_hardware_report_lines_fit_a_notebook_without_wrapping(monkeypatch, flags):
    monkeypatch.setattr(D, "cpu_bf16_flags", lambda cpuinfo=None: flags)
    assert max(len(line) for line in D.hardware_report("cpu").splitlines()) <= 100


@pytest.mark.parametrize("cc, says", [((7, 5), True), ((9, 0), False)])
def test_the_report_shows_torchs_emulation_inclusive_bf16_answer_only_where_bf16_is_emulated(cc, says):
    from unittest import mock

    props = mock.Mock(total_memory=16 * 2**30, multi_processor_count=40)
    props.name = "a GPU"
    with (
        mock.patch.object(D, "cuda_capability", return_value=cc),
        mock.patch("torch.cuda.get_device_properties", return_value=props),
        mock.patch("torch.cuda.is_bf16_supported", return_value=True),
    ):
        line = next(x for x in D.hardware_report("cuda").splitlines() if x.startswith("native bf16"))
    assert line == ("native bf16: False (is_bf16_supported(): True, emulated)" if says else "native bf16: True")


@pytest.mark.parametrize(
    "installed, needed, expected",
    [
        ("2.6.0+cu124", "2.6", True),  # the floor: a local build is its release
        ("2.6.0+cu124", "2.8", False),  # CPU torch._scaled_mm (chapter 11) arrived in 2.8
        ("2.10.0", "2.9", True),  # numbers, not strings: "2.10" < "2.9" as text
        ("2.9.1", "2.10", False),
        ("2.12.0+cu130", "2.12", True),  # rowwise scales in torch._scaled_mm on a CPU
        ("2.8.0a0+git1234567", "2.8", False),  # a pre-release may predate the feature
    ],
)
def test_torch_at_least_compares_releases_as_numbers(installed, needed, expected, capsys):
    assert D.torch_at_least(needed, installed=installed) is expected
    assert capsys.readouterr().out == ""  # without `what`, it only answers


def test_a_guard_says_in_one_line_what_needs_which_torch_and_the_torch_found(capsys):
    what = "rowwise scales in torch._scaled_mm on a CPU"
    assert D.torch_at_least("2.12", what, installed="2.11.0+cu130") is False
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"skipped: needs torch >= 2.12 for {what}; this is 2.11.0+cu130"]
    assert len(lines[0]) <= 100
    assert D.torch_at_least("2.6", what) is True and capsys.readouterr().out == ""  # the floor itself


def test_tf32_context_switches_both_flags_and_restores_them():
    assert not D.has_tf32(torch.device("cpu"))  # TF32 is an NVIDIA Ampere-and-newer mode
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    with D.tf32(True):
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
    with D.tf32(False):
        assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before
