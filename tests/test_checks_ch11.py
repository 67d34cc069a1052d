"""Exercise 11's checks. 11.fp8_matmul accepts FP8 scales and products computed by hand or with
torch._scaled_mm, and names the usual wrong ones: an inverted scale, the wrong axis, e5m2 for a
forward operand, a product never scaled back, operands never rounded to e4m3. 11.mx_quantize accepts
MX bytes equal to the reference's bit for bit on fresh tensors and names each plausible mistake."""

import random

import pytest
import torch
from checking import fails, judged_cells, passes, verdict

from course_lib.device import torch_at_least
from course_lib.tooling.checks import get_check  # (registers the check as it loads chapter 11)

NEEDS = get_check("11.fp8_matmul").needs_torch
needs_torch = pytest.mark.skipif(not torch_at_least(NEEDS), reason=f"the check's reference needs torch >= {NEEDS}")

TOP = torch.finfo(torch.float8_e4m3fn).max


def scales(a, b, granularity):
    if granularity == "tensorwise":
        return TOP / a.abs().amax(), TOP / b.abs().amax()
    return TOP / a.abs().amax(dim=1, keepdim=True), TOP / b.abs().amax(dim=0, keepdim=True)


def by_hand(a, b, granularity):
    sa, sb = scales(a, b, granularity)
    a8 = (a * sa).clamp(-TOP, TOP).to(torch.float8_e4m3fn)
    b8 = (b * sb).clamp(-TOP, TOP).to(torch.float8_e4m3fn)
    return sa, sb, (a8.float() @ b8.float()) / (sa * sb)


def with_scaled_mm(a, b, granularity):
    sa, sb = scales(a, b, granularity)
    a8 = (a * sa).clamp(-TOP, TOP).to(torch.float8_e4m3fn)
    b8 = (b * sb).clamp(-TOP, TOP).to(torch.float8_e4m3fn).t().contiguous().t()
    return sa, sb, torch._scaled_mm(a8, b8, scale_a=1 / sa, scale_b=1 / sb, out_dtype=torch.float32)


@needs_torch
def test_by_hand_and_with_scaled_mm_both_pass():
    passes("11.fp8_matmul", by_hand, times=2)
    passes("11.fp8_matmul", with_scaled_mm, times=2)


@needs_torch
def test_an_inverted_scale_is_named():
    def inverted(a, b, granularity):
        sa, sb, out = by_hand(a, b, granularity)
        return 1 / sa, 1 / sb, out

    assert "inverted" in fails("11.fp8_matmul", inverted)


@needs_torch
def test_the_wrong_axis_and_one_scale_for_all_are_named():
    def wrong_axis(a, b, granularity):
        if granularity == "rowwise":
            return TOP / a.abs().amax(dim=0, keepdim=True), TOP / b.abs().amax(dim=1, keepdim=True), a @ b
        return by_hand(a, b, granularity)

    def one_for_all(a, b, granularity):
        return by_hand(a, b, "tensorwise")

    def one_for_all_expanded(a, b, granularity):
        sa, sb, out = by_hand(a, b, "tensorwise")
        if granularity == "rowwise":
            return sa.expand(a.shape[0], 1), sb.expand(1, b.shape[1]), out
        return sa, sb, out

    assert "wrong axis" in fails("11.fp8_matmul", wrong_axis)
    assert "one per row of a" in fails("11.fp8_matmul", one_for_all)
    assert "one amax for the whole operand" in fails("11.fp8_matmul", one_for_all_expanded)


@needs_torch
def test_e5m2_for_the_weights_is_named():
    def e5m2_weights(a, b, granularity):
        sa, sb, out = by_hand(a, b, granularity)
        return sa, sb * torch.finfo(torch.float8_e5m2).max / TOP, out

    assert "e5m2" in fails("11.fp8_matmul", e5m2_weights)


@needs_torch
def test_a_product_not_scaled_back_or_never_rounded_is_named():
    def not_scaled_back(a, b, granularity):
        sa, sb, out = by_hand(a, b, granularity)
        return sa, sb, out * sa * sb

    def never_rounded(a, b, granularity):
        sa, sb, _ = by_hand(a, b, granularity)
        return sa, sb, a @ b

    assert "not yet scaled back" in fails("11.fp8_matmul", not_scaled_back)
    assert "exact fp32 product" in fails("11.fp8_matmul", never_rounded)


@needs_torch
def test_a_product_in_bf16_fails_and_junk_is_refused():
    def bf16_out(a, b, granularity):
        sa, sb, out = by_hand(a, b, granularity)
        return sa, sb, out.bfloat16()

    assert "differs from torch._scaled_mm" in fails("11.fp8_matmul", bf16_out)
    assert "not numbers" in fails("11.fp8_matmul", lambda a, b, g: ("x", "y", "z"))
    assert "(scale_a, scale_b, out)" in fails("11.fp8_matmul", lambda a, b, g: 3.0)


@pytest.mark.skipif(torch_at_least(NEEDS), reason=f"torch >= {NEEDS} judges the task")
def test_an_older_torch_says_the_check_cannot_judge_here_instead_of_blaming_the_learner():
    status, message = verdict("11.fp8_matmul", by_hand)
    assert status == "not graded" and f"needs torch >= {NEEDS}" in message and "no point is lost" in message


# --------------------------------------------------------------------------- 11.mx_quantize

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mx(x, fmt, rule, *, exponents=None, axis=-1, apply=False, clamp=True, nan_beyond=False, pack="low"):
    """An MX quantizer as the solution writes it, with one of the plausible mistakes switched on."""
    top, emax = {"mxfp8": (448.0, 8), "mxfp4": (6.0, 2)}[fmt]
    if axis == 0:
        x = x.t()
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1)
    if exponents is not None:
        e = exponents(amax, top, emax)
    elif rule == "floor":
        e = torch.where(amax > 0, torch.frexp(amax).exponent - 1 - emax, -127)
    else:
        e = torch.ceil(torch.log2(amax / top))
    e = e.clamp(-127, 127).to(torch.int32)
    scale = torch.exp2(e.float()).unsqueeze(-1)
    scaled = (blocks * scale if apply else blocks / scale).reshape(x.shape)
    if clamp:
        scaled = scaled.clamp(-top, top)
    scales = (e + 127).to(torch.uint8)
    if axis == 0:
        scales = scales.t()
    if fmt == "mxfp8":
        if nan_beyond:  # what an unclamped cast gives on a torch before 2.13
            scaled = torch.where(scaled.abs() > top, torch.nan, scaled)
        return scales, scaled.to(torch.float8_e4m3fn)
    mag = scaled.abs().contiguous()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    mag = torch.round(mag / step) * step
    codes = (torch.bucketize(mag, E2M1) + 8 * torch.signbit(scaled)).to(torch.uint8)
    if pack == "none":
        return scales, codes
    first, second = codes[:, 0::2], codes[:, 1::2]
    return scales, (first | (second << 4)) if pack == "low" else ((first << 4) | second)


def test_the_solution_passes_on_fresh_draws_and_every_format_and_rule_is_drawn():
    passes("11.mx_quantize", mx, times=4)
    cases = get_check("11.mx_quantize").cases(random.Random(0))
    assert {(c["fmt"], c["rule"]) for c in cases} == {(f, r) for f in ("mxfp8", "mxfp4") for r in ("floor", "rceil")}


def test_a_right_quantizer_matches_the_reference_bit_for_bit_on_1000_fresh_tensors():
    from course_lib.chapters.ch11.microscaling import mx_quantize
    from course_lib.tooling.checks.ch11 import _mx_case_tensor

    rng = random.Random()
    for i in range(1000):
        x = _mx_case_tensor(rng)
        fmt, rule = ("mxfp8", "mxfp4")[i % 2], ("floor", "rceil")[(i // 2) % 2]
        scales, data = mx(x, fmt, rule)
        want = mx_quantize(x, fmt, rule)
        assert torch.equal(scales, want.scales) and torch.equal(data.view(torch.uint8), want.data), (i, fmt, rule)


def test_the_other_rule_is_named_both_ways():
    def swapped(x, fmt, rule):
        return mx(x, fmt, "rceil" if rule == "floor" else "floor")

    message = fails("11.mx_quantize", swapped)
    assert "the floor rule where round-up ('rceil') was asked" in message or "round-up rule where 'floor'" in message
    for seed in range(3):  # both names come up, whichever case is judged first
        message = fails("11.mx_quantize", swapped, seed=seed)
        assert "rule" in message and "was asked" in message


def test_blocks_down_the_wrong_axis_and_one_scale_per_row_are_named():
    assert "blocks of 32 down the columns" in fails("11.mx_quantize", lambda x, f, r: mx(x, f, r, axis=0))

    def per_row(x, fmt, rule):
        scales, data = mx(x, fmt, rule)
        return scales[:, :1], data

    assert "one scale per row" in fails("11.mx_quantize", per_row)


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="torch.float8_e8m0fnu arrived in torch 2.7")
def test_e8m0_rounded_by_a_cast_is_named():
    def cast(amax, top, emax):  # the scale amax / max rounded to e8m0 by PyTorch's cast: to the nearest
        return (amax / top).to(torch.float8_e8m0fnu).view(torch.uint8).to(torch.int32) - 127

    assert "cast to torch.float8_e8m0fnu" in fails("11.mx_quantize", lambda x, f, r: mx(x, f, r, exponents=cast))


def test_448_for_2_to_the_8_and_a_ceil_for_the_floor_are_named():
    def over_max(amax, top, emax):
        return torch.floor(torch.log2(amax.clamp(min=1e-38) / top))

    def ceil_floor(amax, top, emax):
        return torch.ceil(torch.log2(amax.clamp(min=1e-38))) - emax

    def sometimes(mistake):  # the mistake where the floor rule is asked, the right rule where it is not
        def quantize(x, fmt, rule):
            return mx(x, fmt, rule, exponents=mistake if rule == "floor" else None)

        return quantize

    assert "not 448" in fails("11.mx_quantize", sometimes(over_max))
    assert "rounds log2 amax down" in fails("11.mx_quantize", sometimes(ceil_floor))


def test_unbiased_exponents_and_float_scales_are_refused_with_their_reason():
    def unbiased(x, fmt, rule):
        scales, data = mx(x, fmt, rule)
        return scales.to(torch.int32) - 127, data

    def as_floats(x, fmt, rule):
        scales, data = mx(x, fmt, rule)
        return torch.exp2(scales.float() - 127), data

    assert "unbiased exponents" in fails("11.mx_quantize", unbiased)
    assert "return e8m0 bytes" in fails("11.mx_quantize", as_floats)


def test_a_scale_applied_instead_of_divided_is_named():
    assert "applied instead of divided" in fails("11.mx_quantize", lambda x, f, r: mx(x, f, r, apply=True))


def test_saturation_forgotten_is_named():
    def no_clamp(x, fmt, rule):  # e2m1 by hand without the clamp: 7 rounds to 8, code 8, a negative zero
        return mx(x, fmt, rule, clamp=False)

    def nan_beyond(x, fmt, rule):  # an unclamped e4m3 cast on a torch before 2.13
        return mx(x, fmt, rule, clamp=False, nan_beyond=True)

    for quantize in (no_clamp, nan_beyond):
        for seed in range(3):
            assert "saturation forgotten" in fails("11.mx_quantize", quantize, seed=seed)


def test_codes_unpacked_or_in_the_wrong_nibble_are_named():
    assert "packed two a byte" in fails("11.mx_quantize", lambda x, f, r: mx(x, f, r, pack="none"))
    assert "the first element goes in the low nibble" in fails(
        "11.mx_quantize", lambda x, f, r: mx(x, f, r, pack="high")
    )


def test_a_hard_coded_answer_and_junk_fail():
    fixed = mx(torch.ones(32, 64), "mxfp8", "floor")
    fails("11.mx_quantize", lambda x, f, r: fixed)
    assert "not a tensor" in fails("11.mx_quantize", lambda x, f, r: ("a", "b"))
    assert "(scales, data)" in fails("11.mx_quantize", lambda x, f, r: 3)


def test_torchao_and_the_course_are_absent_from_the_task():
    status, message = judged_cells(
        "11.mx_quantize",
        "from course_lib.chapters.ch11.microscaling import mx_quantize as course\n"
        "def mx_quantize(x, fmt, rule):\n"
        "    q = course(x, fmt, rule)\n"
        "    return q.scales, q.data",
    )
    assert status == "failed" and "course_lib" in message and "yourself" in message
