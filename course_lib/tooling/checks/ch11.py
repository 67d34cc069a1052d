"""Checks for exercise 11 (predicting speed; FP8). The reference is PyTorch itself: the grader
quantizes each case's operands to e4m3 with fp8_max / amax scales and multiplies them with
`torch._scaled_mm`, which runs on a CPU; the learner's scales must match and the product must
match `_scaled_mm`'s to rounding. The usual mistakes are named: an inverted scale, the amax of the
wrong axis, e5m2 for a forward operand, a product never scaled back, operands never rounded."""

from __future__ import annotations

import math
import random

import torch

from ...chapters.ch11.fp8 import SCALED_MM_ON_CPU
from ..checkbase import Check, CheckFailure, describe_value, expect_list, register

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _operands(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(case["a"]), torch.tensor(case["b"])


def _scales(a: torch.Tensor, b: torch.Tensor, granularity: str, fmt: torch.dtype = E4M3) -> tuple:
    top = torch.finfo(fmt).max
    if granularity == "tensorwise":
        return top / a.abs().amax(), top / b.abs().amax()
    return top / a.abs().amax(dim=1, keepdim=True), top / b.abs().amax(dim=0, keepdim=True)


def reference(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The right scales and `torch._scaled_mm`'s fp32 product for one case."""
    a, b = _operands(case)
    scale_a, scale_b = _scales(a, b, case["granularity"])
    top = torch.finfo(E4M3).max
    a8 = (a * scale_a).clamp(-top, top).to(E4M3)
    b8 = (b * scale_b).clamp(-top, top).to(E4M3).t().contiguous().t()
    out = torch._scaled_mm(a8, b8, scale_a=1 / scale_a, scale_b=1 / scale_b, out_dtype=torch.float32)
    return scale_a, scale_b, out


def _tensor(value: object, where: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A plain answer ({"array": ..., "dtype": ...}, a list or a number) as a float64 tensor of `shape`."""
    data = value["array"] if isinstance(value, dict) and "array" in value else value
    try:
        t = torch.tensor(data, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise CheckFailure(f"{where} is {describe_value(value)}, not numbers") from None
    if t.numel() == 1 and math.prod(shape) == 1:
        return t.reshape(shape)
    if tuple(t.shape) != shape:
        raise CheckFailure(f"{where} has shape {tuple(t.shape)}; expected {shape}")
    if not torch.isfinite(t).all():
        raise CheckFailure(f"{where} holds inf or NaN")
    return t


def _shape(value: object) -> tuple[int, ...] | None:
    data = value["array"] if isinstance(value, dict) and "array" in value else value
    try:
        return tuple(torch.tensor(data).shape)
    except (TypeError, ValueError, RuntimeError):
        return None


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> bool:
    return bool(torch.allclose(got, want.double(), rtol=rtol, atol=0.0))


def _near(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    """Within `tol` in relative norm: single entries near zero may differ more (summation order)."""
    want = want.double()
    return ((got - want).norm() / want.norm()).item() < tol


@register
class FP8Matmul(Check):
    name, args, points = "11.fp8_matmul", ("fp8_matmul",), 3
    needs_torch = SCALED_MM_ON_CPU["rowwise"]  # the reference: torch._scaled_mm, rowwise too, on the grader's CPU
    hint = (
        "Chapter 11, section 8: scale = 448 / amax (e4m3's largest number over the largest magnitude); "
        "tensorwise: one amax per operand; rowwise: one per row of a and one per column of b. Round a * scale_a "
        "and b * scale_b to torch.float8_e4m3fn (clamp first), multiply in fp32, and divide by scale_a * scale_b "
        "(or pass 1 / scale to torch._scaled_mm)."
    )
    forbidden = ("course_lib",)
    forbidden_why = "compute the scales and the product yourself, as chapter 11 does, instead of calling the course's"

    def cases(self, rng: random.Random) -> list:
        cases = []
        for granularity in ("tensorwise", "rowwise", "rowwise", "tensorwise"):
            m, k, n = rng.choice([8, 16, 24]), rng.choice([16, 32, 48]), rng.choice([8, 16, 32])
            gen = torch.Generator().manual_seed(rng.randrange(10**6))
            a = torch.randn(m, k, generator=gen)
            a[rng.randrange(m)] *= rng.choice([1.0, 30.0])  # sometimes one row of activations far larger
            b = torch.randn(k, n, generator=gen) * rng.choice([0.02, 0.05, 1.0])  # weights are small
            cases.append({"a": a.tolist(), "b": b.tolist(), "granularity": granularity})
        return cases

    def describe(self, case: dict) -> str:
        m, k, n = len(case["a"]), len(case["b"]), len(case["b"][0])
        return f"fp8_matmul(a: {m}x{k}, b: {k}x{n}, {case['granularity']!r})"

    def judge(self, cases: list, results: list) -> None:
        for case, got in zip(cases, expect_list(results, "fp8_matmul's answers", len(cases))):
            self._judge_one(case, got)

    def _judge_one(self, case: dict, got: object) -> None:
        what = self.describe(case)
        answer = expect_list(got, f"{what}'s answer (scale_a, scale_b, out)", 3)
        m, k, n = len(case["a"]), len(case["b"]), len(case["b"][0])
        rowwise = case["granularity"] == "rowwise"
        want_a, want_b, want_out = reference(case)
        a, b = _operands(case)
        shape_a, shape_b = ((m, 1), (1, n)) if rowwise else ((1,), (1,))
        if rowwise:  # the wrong axis, or one scale for all, shows first as the wrong shape
            for value, shape, wrong, side in ((answer[0], shape_a, (1, k), "a"), (answer[1], shape_b, (k, 1), "b")):
                got_shape = _shape(value)
                if got_shape == wrong:
                    axis = (
                        "one per row of a (amax over dim 1)" if side == "a" else "one per column of b (amax over dim 0)"
                    )
                    raise CheckFailure(
                        f"{what}: scale_{side} has shape {got_shape}, the amax of the wrong axis: {axis}"
                    )
                if got_shape is not None and math.prod(got_shape) == 1:
                    per = "one per row of a and one per column of b"
                    raise CheckFailure(f"{what}: scale_{side} is one number: rowwise scaling has {per}")
        scale_a = _tensor(answer[0], f"{what}: scale_a", shape_a)
        scale_b = _tensor(answer[1], f"{what}: scale_b", shape_b)
        out = _tensor(answer[2], f"{what}: out", (m, n))
        for side, got_scale, want_scale, x in (("a", scale_a, want_a, a), ("b", scale_b, want_b, b)):
            if _close(got_scale, want_scale.reshape(got_scale.shape), 1e-5):
                continue
            amax = (torch.finfo(E4M3).max / want_scale).double().reshape(got_scale.shape)
            named = {
                "inverted: amax / 448 is what to multiply the product by, 448 / amax is the scale": amax / 448,
                "e5m2's range (57,344): forward operands, activations and weights, use e4m3 (448)": 57344 / amax,
            }
            if rowwise:
                whole = _scales(a, b, "tensorwise")[0 if side == "a" else 1].double()
                named["one amax for the whole operand: rowwise needs one per row of a and column of b"] = whole.expand(
                    got_scale.shape
                )
            because = [why for why, value in named.items() if _close(got_scale, value, 1e-5)]
            raise CheckFailure(
                f"{what}: scale_{side} is off (first value {got_scale.flatten()[0].item():.6g}, expected "
                f"{want_scale.flatten()[0].item():.6g})" + (f": {because[0]}" if because else "")
            )
        if _near(out, want_out, 1e-5):
            return
        scaled = want_out.double() * (want_a * want_b).double()
        exact = (a.double() @ b.double()).float()
        if _near(out, scaled, 1e-5):
            raise CheckFailure(f"{what}: out is (a8 @ b8) not yet scaled back: divide by scale_a * scale_b")
        if _near(out, exact, 1e-5):
            first = "round a * scale_a and b * scale_b to e4m3 first"
            raise CheckFailure(f"{what}: out is the exact fp32 product: {first}")
        err = ((out - want_out.double()).norm() / want_out.double().norm()).item()
        raise CheckFailure(f"{what}: out differs from torch._scaled_mm's product by {err:.2%} (relative norm)")
