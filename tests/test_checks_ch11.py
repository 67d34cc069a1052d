"""Exercise 11's check accepts FP8 scales and products computed by hand or with torch._scaled_mm, and
names the usual wrong ones: an inverted scale, the wrong axis, e5m2 for a forward operand, a product
never scaled back, operands never rounded to e4m3."""
import pytest
import torch
from checking import fails, passes, verdict

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
