"""Chapter 11's microscaling by hand: MXFP8 and MXFP4 bytes equal, bit for bit, to a pure-Python
reference (and to torchao's to_mx where torchao is installed), e2m1 codes and their packing, the two
scale rules, NVFP4, and the tables the chapter reads."""

import math

import pytest
import torch

from course_lib.chapters.ch11 import microscaling as M
from course_lib.reference import load_references

COMBOS = [(fmt, rule) for fmt in ("mxfp8", "mxfp4") for rule in ("floor", "rceil")]


def awkward(seed: int, rows: int = 8, cols: int = 128) -> torch.Tensor:
    """Blocks of very different sizes, an all-zero block, a tiny block and exact powers of two."""
    g = torch.Generator().manual_seed(seed)
    size = torch.exp2(torch.randint(-60, 60, (rows, cols // 32, 1), generator=g).float())  # each block its own
    x = (torch.randn(rows, cols // 32, 32, generator=g) * size).reshape(rows, cols)
    x[0, :32] = 0.0
    x[1, 32:64] *= 1e-30
    x[2, 64] = 448.0
    x[3, 96] = 6.0
    return x


@pytest.mark.parametrize("fmt,rule", COMBOS)
def test_the_vectorized_quantizer_and_the_pure_python_reference_make_the_same_bytes(fmt, rule):
    for seed in range(6):
        x = awkward(seed)
        fast, slow = M.mx_quantize(x, fmt, rule), M.mx_quantize_by_hand(x, fmt, rule)
        assert torch.equal(fast.scales, slow.scales) and torch.equal(fast.data, slow.data), seed
        assert fast.scales.shape == (8, 4) and fast.data.shape == ((8, 128) if fmt == "mxfp8" else (8, 64))


@pytest.mark.skipif(not M.TORCHAO, reason="torchao is not installed (the fp8 extra installs it)")
@pytest.mark.parametrize("fmt,rule", COMBOS)
def test_the_bytes_equal_torchaos_to_mx(fmt, rule):
    for seed in range(6):
        x = awkward(seed)
        ours, theirs = M.mx_quantize(x, fmt, rule), M.torchao_to_mx(x, fmt, rule)
        assert torch.equal(ours.scales, theirs.scales) and torch.equal(ours.data, theirs.data), seed


def test_without_torchao_the_torchao_calls_say_so_by_returning_none(monkeypatch):
    monkeypatch.setattr(M, "TORCHAO", False)
    assert M.torchao_to_mx(torch.ones(1, 32)) is None and M.torchao_mxfp8_training() is None


def test_the_scale_rules_floor_and_round_up():
    amax = torch.tensor([0.0, 1.0, 255.0, 256.0, 448.0, 449.0, 480.0, 1e-40, 3e38])
    floor = M.scale_exponents(amax, "e4m3", "floor").tolist()
    rceil = M.scale_exponents(amax, "e4m3", "rceil").tolist()
    assert floor == [-127, -8, -1, 0, 0, 0, 0, -127, 119]  # floor(log2 amax) - 8, clamped
    assert rceil == [-127, -8, 0, 0, 0, 1, 1, -127, 120]  # ceil(log2(amax / 448))
    assert M.scale_exponents(torch.tensor([6.0, 6.5, 7.9]), "e2m1", "floor").tolist() == [0, 0, 0]
    assert M.scale_exponents(torch.tensor([6.0, 6.5, 7.9]), "e2m1", "rceil").tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="unknown rule"):
        M.scale_exponents(amax, "e4m3", "even")


def test_the_floor_rule_saturates_what_the_round_up_rule_keeps():
    x = torch.full((1, 32), 1.0)
    x[0, 0] = 480.0
    floor, rceil = (M.mx_dequantize(M.mx_quantize(x, "mxfp8", rule)) for rule in ("floor", "rceil"))
    assert floor[0, 0] == 448.0 and rceil[0, 0] == 480.0  # 480 saturates at 448; 480 / 2 = 240 is exact
    assert floor[0, 1] == 1.0 and rceil[0, 1] == 1.0


def test_e2m1_codes_round_to_nearest_ties_to_even_and_saturate():
    values = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.0, -0.1, -5.5])
    assert M.e2m1_values(M.e2m1_codes(values)).tolist() == [
        0.0,
        1.0,
        1.0,
        2.0,
        2.0,
        4.0,
        4.0,
        6.0,
        6.0,
        -0.0,
        -0.0,
        -6.0,
    ]
    assert M.e2m1_codes(torch.tensor([-0.0, 0.0])).tolist() == [8, 0]  # the sign bit, even of a zero
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(M.e2m1_codes(M.e2m1_values(codes)), codes)


def test_two_codes_a_byte_the_first_in_the_low_nibble():
    assert M.pack_fp4(M.e2m1_codes(torch.tensor([0.5, -3.0, 6.0, 1.5]))).tolist() == [209, 55]
    codes = torch.randint(0, 16, (4, 64), dtype=torch.uint8)
    assert torch.equal(M.unpack_fp4(M.pack_fp4(codes)), codes)


def test_quantizing_keeps_each_value_within_half_a_step_of_its_format():
    x = torch.randn(16, 256)
    for fmt, rule in COMBOS:
        back = M.mx_dequantize(M.mx_quantize(x, fmt, rule))
        bound = 2.0**-4 if fmt == "mxfp8" else 2.0**-2  # half the relative step of a normal e4m3 or e2m1 number
        big = x.abs() > x.abs().amax() / 4  # away from the subnormals
        if rule == "rceil":
            assert ((back - x).abs()[big] <= bound * x.abs()[big] + 1e-12).all(), (fmt, rule)


def test_a_block_size_that_does_not_divide_the_row_is_refused():
    with pytest.raises(ValueError, match="multiple of the block size"):
        M.mx_quantize(torch.ones(2, 48))


def test_nvfp4_scales_are_e4m3_under_one_tensor_scale():
    x = torch.randn(8, 64)
    q = M.nvfp4_quantize(x)
    assert q.scales.shape == (8, 4) and q.data.shape == (8, 32)
    assert q.tensor_scale == pytest.approx(x.abs().amax().item() / (448 * 6), rel=1e-6)
    top = q.scales.view(torch.float8_e4m3fn).float().amax().item()
    assert top == 448.0  # the block holding the tensor's largest value gets e4m3's largest scale
    back = M.nvfp4_dequantize(q)
    assert ((back - x).norm() / x.norm()).item() < 0.15


def test_the_six_decade_tensor_spans_six_decades_across_its_columns():
    x = M.six_decades(rows=64, cols=512)
    ratio = x[:, -32:].abs().median() / x[:, :32].abs().median()
    assert x.shape == (64, 512) and 10**5 < ratio < 10**7


def test_the_tables_show_floor_saturation_and_that_blocks_buy_range_not_precision():
    x = M.six_decades(rows=64, cols=512)
    rules = {(r["format"], r["rule"]): r for r in M.rule_rows(x)}
    assert rules[("mxfp8", "floor")]["saturated"] > 0 and rules[("mxfp8", "rceil")]["saturated"] == 0
    grains = {r["scaling"]: r for r in M.granularity_rows(x)}
    assert grains["tensorwise"]["flushed"] > 0.05 and grains["MXFP8, 1 x 32"]["flushed"] == 0
    assert grains["tensorwise"]["error"] == pytest.approx(grains["MXFP8, 1 x 32"]["error"], rel=0.1)
    torch.manual_seed(0)
    w = torch.nn.Linear(256, 64).weight.detach()
    calm = {r["scaling"]: r for r in M.granularity_rows(torch.randn(64, 256), w)}
    assert min(r["same"] for r in calm.values()) > 0.99
    assert max(r["matmul"] for r in calm.values()) == pytest.approx(min(r["matmul"] for r in calm.values()), rel=0.02)
    fp4 = {r["format"]: r for r in M.fp4_rows(torch.randn(64, 256))}
    assert fp4["NVFP4"]["error"] < min(fp4["MXFP4, floor"]["error"], fp4["MXFP4, rceil"]["error"])
    assert fp4["MXFP4, floor"]["bits"] == 4.25
    for rows in (M.rule_rows(x), M.granularity_rows(x), M.fp4_rows(x)):
        assert all(len(line) <= 100 for line in M.format_rows(rows).splitlines())


def test_the_published_table_carries_its_sources_and_the_course_s_own_run_beside_it():
    text = M.published_rows(load_references("fp8gpt_*.json"))
    assert "torchao mx_formats README" in text and "pytorch/ao#3163" in text and "1.20" in text
    assert all(len(line) <= 100 for line in text.splitlines())
    for ref in load_references("fp8gpt_*.json"):
        runs = {r["recipe"]: r["ms_per_step"] for r in ref["rows"] if "ms_per_step" in r}
        assert f"{runs['bf16'] / runs['tensorwise']:.2f}" in text and ref["file"] in text
    assert math.isclose(M.PUBLISHED_MX[0][3], 10417.0 / 8307.5)
