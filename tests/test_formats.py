"""course_lib.chapters.ch01.formats (chapter 01) against torch's own conversions, and the chapter 01 checks."""

import math
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from course_lib.chapters.ch01 import format_limits as FL
from course_lib.chapters.ch01 import formats as F

STORAGE = F.STORAGE_FORMATS


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


# --------------------------------------------------------------------------- bit patterns


@pytest.mark.parametrize(
    "x, fmt, bits, kind",
    [
        (1.0, "fp16", "0011110000000000", "normal"),
        (-2.0, "fp16", "1100000000000000", "normal"),
        (65504.0, "fp16", "0111101111111111", "normal"),
        (2.0**-24, "fp16", "0000000000000001", "subnormal"),
        (2.0**-14, "fp16", "0000010000000000", "normal"),
        (-0.0, "fp16", "1000000000000000", "zero"),
        (math.inf, "fp16", "0111110000000000", "inf"),
        (-math.inf, "fp16", "1111110000000000", "inf"),
        (1.0, "bf16", "0011111110000000", "normal"),
        (2.0**-133, "bf16", "0000000000000001", "subnormal"),
        (1.0, "fp32", format(0x3F800000, "032b"), "normal"),
        (2.0**-149, "fp32", "0" * 31 + "1", "subnormal"),
        (448.0, "fp8_e4m3fn", "01111110", "normal"),
        (2.0**-9, "fp8_e4m3fn", "00000001", "subnormal"),
        (57344.0, "fp8_e5m2", "01111011", "normal"),
        (math.inf, "fp8_e5m2", "01111100", "inf"),
    ],
)
def test_known_values_have_known_bit_patterns(x, fmt, bits, kind):
    d = F.decompose(x, fmt)
    assert (d.bits, d.kind) == (bits, kind)
    assert d.pattern == int(bits, 2)
    assert d.value == x and d.error == 0.0
    assert math.copysign(1, d.value) == math.copysign(1, x)  # -0.0 keeps its sign


@pytest.mark.parametrize("fmt", STORAGE)
def test_nan_decomposes_as_nan_in_every_format(fmt):
    d = F.decompose(math.nan, fmt)
    assert d.kind == "nan" and math.isnan(d.value) and math.isnan(d.error) and d.exponent is None


def test_fields_and_exponent_of_a_normal_and_a_subnormal():
    d = F.decompose(0.1, "bf16")
    assert (d.sign, d.exponent_field, d.exponent, d.mantissa) == (0, 123, -4, 77)
    assert d.significand == 1 + 77 / 128 and d.value == 0.10009765625
    assert d.pretty_bits == "0 01111011 1001101"
    s = F.decompose(3 * 2.0**-24, "fp16")
    assert (s.kind, s.exponent_field, s.exponent, s.mantissa, s.significand) == ("subnormal", 0, -14, 3, 3 / 1024)


@pytest.mark.parametrize(
    "x, want",
    [
        (1 + 2.0**-8, 1.0),  # tie between 1 (even) and 1 + 2^-7 (odd): down
        (1 + 3 * 2.0**-8, 1 + 2.0**-6),  # tie between 1 + 2^-7 (odd) and 1 + 2^-6 (even): up
        (1 + 2.0**-8 + 2.0**-20, 1 + 2.0**-7),  # just above the tie: up
        (1 + 2.0**-8 - 2.0**-20, 1.0),  # just below the tie: down
        (-(1 + 3 * 2.0**-8), -(1 + 2.0**-6)),  # symmetric for negatives
        ((2 - 2.0**-8) * 2.0**127, math.inf),  # the tie above bf16's max (odd mantissa) goes to inf
    ],
)
def test_bf16_rounds_to_nearest_ties_to_even(x, want):
    assert F.decompose(x, "bf16").value == want


@pytest.mark.parametrize(
    "x, want",
    [
        (2049.0, 2048.0),
        (2051.0, 2052.0),
        (65519.0, 65504.0),
        (65520.0, math.inf),
        (2.0**-25, 0.0),
        (2.0**-25 * (1 + 2.0**-10), 2.0**-24),
        (3 * 2.0**-26, 2.0**-24),
    ],
)
def test_fp16_rounding_at_ties_overflow_and_underflow(x, want):
    assert F.decompose(x, "fp16").value == want


def test_subnormal_mantissa_bits_are_worth_2_to_the_minus_15_to_24_and_half_the_smallest_is_zero():
    for i in range(1, 11):  # bit i from the left of an fp16 subnormal's mantissa: 2^-14 * 2^-i
        d = F.decompose(2.0 ** -(14 + i), "fp16")
        assert d.kind == "subnormal" and d.mantissa == 1 << (10 - i)
    assert F.decompose(2.0**-24, "fp16").mantissa == 1  # only the last bit is worth 2^-24
    half = torch.tensor(2.0**-25)
    assert FL.fate(half.item(), "fp16") == "underflow" and F.decompose(half.item(), "fp16").value == 0
    above = torch.nextafter(half, torch.tensor(1.0)).item()  # the next fp32 number: rounds up
    assert FL.fate(above, "fp16") == "subnormal" and F.decompose(above, "fp16").value == 2.0**-24


@pytest.mark.parametrize("fmt", STORAGE)
def test_random_patterns_round_trip_and_fields_rebuild_the_value(fmt):
    f = F.get_format(fmt)
    rng = random.Random(0)
    patterns = range(2**f.bits) if f.bits == 8 else [rng.randrange(2**f.bits) for _ in range(3000)]
    for p in patterns:
        d = F.decode(p, fmt)
        if d.kind == "nan":
            continue  # NaN payloads are not preserved by conversions (see the chapter)
        assert F.decompose(d.value, fmt).pattern == p
        if d.kind not in ("inf",):
            assert (-1) ** d.sign * math.ldexp(d.significand, d.exponent) == d.value


@pytest.mark.parametrize("fmt", STORAGE)
def test_decompose_rounds_like_torch_and_the_error_is_at_most_half_a_gap(fmt):
    f = F.get_format(fmt)
    rng = random.Random(1)
    for _ in range(500):
        x = float(np.float32(rng.uniform(-1, 1) * 2.0 ** rng.uniform(math.log2(f.smallest_normal), math.log2(f.max))))
        d = F.decompose(x, fmt)
        assert d.value == float(torch.tensor(x).to(f.dtype).double())
        assert d.error == d.value - x
        assert abs(d.error) <= FL.spacing(x, fmt).item() / 2


def test_all_values_lists_every_pattern_in_order():
    v = F.all_values("fp16")
    assert v.shape == (65536,) and v[0x3C00] == 1.0 and v[0x7BFF] == 65504.0 and v[0x0001] == 2.0**-24
    assert torch.isnan(v).sum() == 2 * 1023 and torch.isinf(v).sum() == 2
    assert int(torch.isnan(F.all_values("fp8_e4m3fn")).sum()) == 2  # only S.1111.111


# --------------------------------------------------------------------------- formats and ranges


@pytest.mark.parametrize(
    "fmt, max_, normal, subnormal, eps",
    [
        ("fp32", 3.4028234663852886e38, 2.0**-126, 2.0**-149, 2.0**-23),
        ("fp16", 65504.0, 2.0**-14, 2.0**-24, 2.0**-10),
        ("bf16", 3.3895313892515355e38, 2.0**-126, 2.0**-133, 2.0**-7),
        ("fp8_e4m3fn", 448.0, 2.0**-6, 2.0**-9, 2.0**-3),
        ("fp8_e5m2", 57344.0, 2.0**-14, 2.0**-16, 2.0**-2),
    ],
)
def test_limits_table_has_the_exact_limits_and_agrees_with_the_layout(fmt, max_, normal, subnormal, eps):
    row = next(r for r in FL.limits_table() if r["format"] == fmt)
    assert (row["max"], row["smallest_normal"], row["smallest_subnormal"], row["eps"]) == (max_, normal, subnormal, eps)
    assert row["source"] == "torch.finfo"
    f = F.get_format(fmt)
    assert (f.max, f.smallest_normal, f.smallest_subnormal, f.eps) == (max_, normal, subnormal, eps)


def test_tf32_is_described_but_is_not_a_storage_dtype():
    row = next(r for r in FL.limits_table() if r["format"] == "tf32")
    assert (row["exponent_bits"], row["mantissa_bits"], row["bits"], row["eps"]) == (8, 10, 19, 2.0**-10)
    assert row["smallest_subnormal"] is None and "layout" in row["source"]
    with pytest.raises(ValueError, match="not a storage dtype"):
        F.decompose(1.0, "tf32")
    assert "tf32" in FL.format_limits_table() and "n/a" in FL.format_limits_table()


@pytest.mark.parametrize(
    "name, want",
    [
        ("half", "fp16"),
        (torch.bfloat16, "bf16"),
        ("e4m3", "fp8_e4m3fn"),
        ("float8_e5m2", "fp8_e5m2"),
        ("torch.float32", "fp32"),
    ],
)
def test_formats_are_found_by_alias_and_by_dtype(name, want):
    assert F.get_format(name).name == want


def test_unknown_format_names_the_known_ones():
    with pytest.raises(ValueError, match="fp16"):
        F.get_format("fp12")


# --------------------------------------------------------------------------- spacing and fate


@pytest.mark.parametrize(
    "x, fmt, gap",
    [
        (1.0, "fp16", 2.0**-10),
        (2048.0, "fp16", 2.0),
        (65504.0, "fp16", 32.0),
        (1e-7, "fp16", 2.0**-24),
        (1.0, "bf16", 2.0**-7),
        (1.0, "fp8_e4m3fn", 0.125),
        (448.0, "fp8_e4m3fn", 32.0),
        (1.0, "fp8_e5m2", 0.25),
    ],
)
def test_spacing_is_one_ulp(x, fmt, gap):
    assert FL.spacing(x, fmt).item() == gap


@pytest.mark.parametrize("x, fmt", [(70000.0, "fp16"), (500.0, "fp8_e4m3fn"), (math.nan, "bf16"), (1e39, "fp32")])
def test_spacing_is_nan_outside_the_range(x, fmt):
    assert math.isnan(FL.spacing(x, fmt).item())


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
def test_spacing_matches_torch_nextafter(fmt):
    dt = F.get_format(fmt).dtype
    x = (torch.rand(2000, generator=torch.Generator().manual_seed(0)) * 2 - 1) * 1e4
    v = x.to(dt).abs()
    want = torch.nextafter(v, torch.full_like(v, math.inf)).double() - v.double()
    assert torch.equal(FL.spacing(x, fmt), want)


def _fp32_values(fmt: str, seed: int) -> list[float]:
    f = F.get_format(fmt)
    rng = random.Random(seed)
    xs = [float(np.float32(2.0 ** rng.uniform(-149, 128))) for _ in range(3000)]
    for a in [
        f.max,
        FL.overflow_threshold(f),
        f.smallest_normal,
        f.smallest_normal - f.smallest_subnormal / 2,
        f.smallest_subnormal,
        f.smallest_subnormal / 2,
    ]:
        v = np.float32(a)
        xs += [float(v), float(np.nextafter(v, np.float32(0))), float(np.nextafter(v, np.float32(np.inf)))]
    return [x for x in xs if x != 0 and math.isfinite(x)]


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e5m2"])
def test_fate_agrees_with_torch_across_the_range_and_at_every_threshold(fmt):
    f = F.get_format(fmt)
    for x in _fp32_values(fmt, seed=2):
        r = float(torch.tensor([x]).to(f.dtype).double()[0])
        want = (
            "overflow"
            if math.isinf(r)
            else "underflow"
            if r == 0
            else "subnormal"
            if abs(r) < f.smallest_normal
            else "normal"
        )
        assert FL.fate(x, fmt) == want == FL.fate(-x, fmt), x


def _float64_near_thresholds(fmt: str) -> list[float]:
    """float64 numbers that are not float32 numbers, on both sides of every threshold of the format."""
    f = F.get_format(fmt)
    xs = []
    for a in [FL.overflow_threshold(f), f.smallest_normal - f.smallest_subnormal / 2, f.smallest_subnormal / 2]:
        xs += [a * (1 + k * 2.0**-40) for k in (-3, -2, -1, 1, 2, 3)]
    return [x for x in xs if float(np.float32(x)) != x]


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e5m2", "fp8_e4m3fn"])
def test_fate_of_a_float64_is_what_torch_stores_after_rounding_it_to_float32_first(fmt):
    # A float64 just below fp16's midpoint 65520 is exactly rounded to 65504, but torch converts
    # through float32, where it becomes the tie 65520.0 and then inf. fate() must say what torch does
    # (judging the float64 once, it said "normal" for 65519.99999 while the bit explorer showed inf).
    f = F.get_format(fmt)
    xs = _float64_near_thresholds(fmt)
    assert len(xs) >= 12
    for x in xs:
        stored = torch.tensor([x], dtype=torch.float64).to(f.dtype)
        assert torch.equal(stored, torch.tensor([x], dtype=torch.float32).to(f.dtype)), x  # one path in torch
        r = float(stored.double()[0])
        # e4m3fn saturates to 448 (or gives NaN): out of range is its float32 beyond the tie 464
        out = math.isinf(r) or math.isnan(r) or (not f.has_inf and float(np.float32(x)) > FL.overflow_threshold(f))
        want = "overflow" if out else "underflow" if r == 0 else "subnormal" if abs(r) < f.smallest_normal else "normal"
        assert FL.fate(x, fmt) == want, x


def test_65519_99999_is_inf_in_fp16_for_fate_and_the_bit_explorer_alike():
    x = 65519.99999
    assert FL.fate(x, "fp16") == "overflow" and F.decompose(x, "fp16").kind == "inf"
    assert math.isinf(torch.tensor(x, dtype=torch.float32).half().item())  # an fp32 tensor: 65520.0, a tie
    assert FL.fate(65519.99, "fp16") == "normal" == F.decompose(65519.99, "fp16").kind  # its float32 is < 65520


def test_e4m3fn_overflow_starts_after_the_tie_at_464():
    assert FL.fate(464.0, "e4m3") == "normal" and F.decompose(464.0, "e4m3").value == 448.0
    assert FL.fate(464.0001, "e4m3") == "overflow"


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2"])
def test_fate_of_inf_is_what_torch_stores_for_it(fmt):
    # e4m3fn has no inf: fate() said "inf" for it, as the bit explorer's row said "inf (overflow)"
    # beside the 448.0 this torch stores. Out of its range, inf is an overflow like 1e6.
    f = F.get_format(fmt)
    for x in (math.inf, -math.inf):
        stored = torch.tensor([x]).to(f.dtype).double().item()
        if f.has_inf:
            assert stored == x and FL.fate(x, fmt) == "inf"
        else:  # saturates to 448 with x's sign, or NaN on older torch
            assert stored == math.copysign(448.0, x) or math.isnan(stored)
            assert FL.fate(x, fmt) == "overflow" == FL.fate(1e6, fmt)


def test_e4m3fn_beyond_its_range_saturates_or_gives_nan_and_chapter_01_compares_neither():
    # torch 2.14 saturates to +-448; torch 2.6 and 2.11 (the GPU run of 2026-11-26) gave NaN. Chapter 01's
    # table of fates prints what this torch stores, in a cell nbval does not compare and git does not
    # keep (its section 7 says which behaviour is which), so an older torch changes nothing git sees.
    import nbformat

    out = torch.tensor([465.0, 1e6, math.inf, -math.inf]).to(torch.float8_e4m3fn).float().tolist()
    assert out == [448.0, 448.0, 448.0, -448.0] or all(math.isnan(v) for v in out)
    nb = nbformat.read(Path(__file__).parents[1] / "notebooks" / "01_formats.ipynb", as_version=4)
    compared = [c for c in nb.cells if "nbval-check-output" in c.metadata.get("tags", [])]
    assert compared and not [c.id for c in compared if "fp8_e4m3fn" in c.source and "fate" in c.source]


def test_fates_counts_fractions_of_nonzero_finite_entries():
    t = torch.tensor([1e5, 1.0, 1e-6, 1e-9, 0.0, math.nan])
    assert FL.fates(t, "fp16") == {"overflow": 0.25, "underflow": 0.25, "subnormal": 0.25, "normal": 0.25}
    assert FL.fates(t, "bf16") == {"overflow": 0.0, "underflow": 0.0, "subnormal": 0.0, "normal": 1.0}


def test_fates_judges_e4m3fn_out_of_range_on_the_float32_torch_converts():
    # 464 + 1e-5 as a float64 is above e4m3fn's threshold 464, but its float32 is 464.0, the tie
    # that torch rounds to 448: no overflow, as torch stores it.
    t = torch.tensor([464.00001], dtype=torch.float64)
    assert t.to(torch.float8_e4m3fn).float().item() == 448.0
    assert FL.fates(t, "e4m3") == {"overflow": 0.0, "underflow": 0.0, "subnormal": 0.0, "normal": 1.0}
    assert FL.fate(464.00001, "e4m3") == "normal"


# --------------------------------------------------------------------------- accumulation and matmul


def test_naive_sums_stall_where_the_increment_is_below_half_the_gap():
    rows = {(r["format"], r["how"]): r for r in FL.sum_experiment(1e-4, 10_000)}
    assert rows[("fp16", "naive")]["final"] == 0.25 and rows[("fp16", "naive")]["stalled_value"] == 0.25
    assert rows[("bf16", "naive")]["final"] == 0.03125
    assert rows[("fp32", "naive")]["stalled_after_step"] is None
    assert rows[("fp16", "fp32 acc")]["rel_error"] < 1e-3 and rows[("bf16", "fp32 acc")]["rel_error"] < 2e-3
    assert rows[("bf16", "torch.sum")]["final"] == 1.0  # CPU reductions accumulate in fp32


def test_running_sum_rounds_after_every_addition():
    partial = FL.running_sum([2048.0, 1.0, 1.0], "fp16")
    assert partial.tolist() == [2048.0, 2048.0, 2048.0]  # each +1 is a tie that rounds back to even
    assert FL.running_sum([2048.0, 1.0, 1.0], "fp16", accumulator="fp32").tolist() == [2048.0, 2049.0, 2050.0]


def test_fp8_needs_a_per_tensor_scale():
    t = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 1e-3
    rel = lambda back: ((back - t).norm() / t.norm()).item()  # noqa: E731
    unscaled, _ = FL.fp8_roundtrip(t, "fp8_e4m3fn", scaled=False)
    scaled, scale = FL.fp8_roundtrip(t, "fp8_e4m3fn")
    assert rel(unscaled) > 0.3 and rel(scaled) < 0.05
    assert scale == pytest.approx(448.0 / t.abs().max().item())
