"""Checks for exercise 11 (predicting speed; FP8; microscaling).

11.fp8_matmul: the reference is PyTorch itself: the grader quantizes each case's operands to e4m3 with
fp8_max / amax scales and multiplies them with `torch._scaled_mm`, which runs on a CPU; the learner's
scales must match and the product must match `_scaled_mm`'s to rounding. The usual mistakes are
named: an inverted scale, the amax of the wrong axis, e5m2 for a forward operand, a product never
scaled back, operands never rounded.

11.mx_quantize: the learner's MXFP8 or MXFP4 bytes (e8m0 scales, e4m3 elements or packed e2m1 codes)
must equal, bit for bit, what the course's microscaling module computes in the grader (the same bytes
as torchao's `to_mx`) on fresh tensors whose blocks differ in size along both axes. Named: the floor
rule for the round-up one and back, e8m0 rounded by a cast, 448 for 2^8, blocks down the wrong axis or
one scale per row, unbiased exponents, a scale applied instead of divided, saturation forgotten,
unpacked or swapped nibbles."""

from __future__ import annotations

import math
import random

import torch

from ...chapters.ch11.fp8 import SCALED_MM_ON_CPU
from ...chapters.ch11.microscaling import (
    ELEMENTS,
    FORMATS,
    e2m1_codes,
    mx_quantize,
    pack_fp4,
    scale_exponents,
    unpack_fp4,
)
from ..checkbase import Check, CheckFailure, describe_value, expect_list, register

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E8M0 = getattr(torch, "float8_e8m0fnu", None)  # torch 2.7 and newer


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


# --------------------------------------------------------------------------- 11.mx_quantize


def _e_variants(amax: torch.Tensor, elem: str) -> dict[str, torch.Tensor]:
    """Unbiased block exponents by the two rules and by the plausible ways to get them wrong."""
    top, emax = ELEMENTS[elem]
    safe = amax.clamp(min=torch.finfo(torch.float32).tiny)

    def clamp(e: torch.Tensor) -> torch.Tensor:
        return e.clamp(-127, 127).to(torch.int32)

    cast = (amax / top).to(torch.float8_e8m0fnu).view(torch.uint8).to(torch.int32) - 127 if E8M0 else None
    out = {
        "floor": scale_exponents(amax, elem, "floor"),
        "rceil": scale_exponents(amax, elem, "rceil"),
        "floor of log2(amax / max)": clamp(torch.floor(torch.log2(safe / top))),
        "ceil of log2(amax) - emax": clamp(torch.ceil(torch.log2(safe)) - emax),
    }
    if cast is not None:
        out["e8m0 cast"] = cast
    return out


def _bytes(value: object, where: str) -> tuple[torch.Tensor | None, str]:
    """(the bytes as a uint8 tensor, or None where the answer holds values instead; its dtype name)."""
    if not isinstance(value, dict) or "dtype" not in value or not isinstance(value.get("shape"), list):
        raise CheckFailure(f"{where} is {describe_value(value)}, not a tensor")
    if "bytes" not in value:
        return None, str(value["dtype"])
    try:
        t = torch.tensor(value["bytes"], dtype=torch.int64).reshape(value["shape"])
    except (TypeError, ValueError, RuntimeError):
        raise CheckFailure(f"{where} could not be read as bytes") from None
    return t.to(torch.uint8), str(value["dtype"])


def _mx_case_tensor(rng: random.Random) -> torch.Tensor:
    """A tensor for 11.mx_quantize: 32 or 64 rows (so that blocks down the columns would fit too) by 64 to
    128 columns, never square; rows and groups of 8 columns scaled by random powers of two, so that blocks
    differ in size along both axes; one all-zero block."""
    rows, cols = rng.choice([(32, 64), (32, 96), (64, 96), (64, 128), (32, 128)])
    gen = torch.Generator().manual_seed(rng.randrange(10**6))
    row_size = torch.exp2(torch.randint(-12, 12, (rows, 1), generator=gen).float())
    col_size = torch.exp2(torch.randint(-6, 6, (1, cols // 8), generator=gen).float()).repeat_interleave(8, 1)
    x = torch.randn(rows, cols, generator=gen) * row_size * col_size
    x[rng.randrange(rows), :32] = 0.0
    return x


@register
class MXQuantize(Check):
    name, args, points = "11.mx_quantize", ("mx_quantize",), 3
    hint = (
        "Chapter 11, section 11: cut each row into blocks of 32 along the last axis; amax = each block's largest "
        "|x|; the exponent e is floor(log2 amax) - emax (emax 8 for e4m3, 2 for e2m1) under 'floor' and "
        "ceil(log2(amax / max)) (max 448 or 6) under 'rceil', clamped to -127..127; the scales are e + 127 as "
        "torch.uint8 (or torch.float8_e8m0fnu). The elements are x / 2^e, clamped to +-max, then rounded: "
        "torch.float8_e4m3fn for 'mxfp8'; e2m1 codes for 'mxfp4' (sign in bit 3, values 0, 0.5, 1, 1.5, 2, 3, 4, "
        "6, ties to the even code), two a byte, the first element in the low nibble."
    )
    forbidden = ("course_lib", "torchao")
    forbidden_why = "write the block scales and elements yourself, as chapter 11 does, instead of calling a library's"

    def cases(self, rng: random.Random) -> list:
        combos = [("mxfp8", "floor"), ("mxfp8", "rceil"), ("mxfp4", "floor"), ("mxfp4", "rceil")]
        rng.shuffle(combos)
        return [{"x": _mx_case_tensor(rng).tolist(), "fmt": fmt, "rule": rule} for fmt, rule in combos]

    def describe(self, case: dict) -> str:
        return f"mx_quantize(x: {len(case['x'])}x{len(case['x'][0])}, {case['fmt']!r}, {case['rule']!r})"

    def judge(self, cases: list, results: list) -> None:
        for case, got in zip(cases, expect_list(results, "mx_quantize's answers", len(cases))):
            self._judge_one(case, got)

    def _judge_one(self, case: dict, got: object) -> None:
        what = self.describe(case)
        scales_got, data_got = expect_list(got, f"{what}'s answer (scales, data)", 2)
        x = torch.tensor(case["x"])
        fmt, rule = case["fmt"], case["rule"]
        elem = FORMATS[fmt][0]
        rows, cols = x.shape
        want = mx_quantize(x, fmt, rule)
        scales, dtype = _bytes(scales_got, f"{what}: scales")
        shape = tuple(scales_got["shape"])
        if shape != (rows, cols // 32):
            named = {
                (rows // 32, cols): "blocks of 32 down the columns (dim 0): MX blocks run along the last axis",
                (cols, rows // 32): "blocks of 32 down the columns (dim 0): MX blocks run along the last axis",
                (rows, 1): "one scale per row: MX has one per block of 32 along the row",
                (rows,): "one scale per row: MX has one per block of 32 along the row",
                (): "one scale for the whole tensor: MX has one per block of 32 along each row",
                (1,): "one scale for the whole tensor: MX has one per block of 32 along each row",
            }
            because = f": {named[shape]}" if shape in named else ""
            raise CheckFailure(f"{what}: scales have shape {shape}; expected {(rows, cols // 32)}{because}")
        amax = x.reshape(rows, cols // 32, 32).abs().amax(dim=-1)
        variants = _e_variants(amax, elem)
        if scales is None:
            values = torch.tensor(scales_got.get("values", []), dtype=torch.float64).reshape(shape)
            if torch.equal(values, variants[rule].double()):
                raise CheckFailure(f"{what}: scales are the unbiased exponents e: e8m0 stores e + 127, as torch.uint8")
            raise CheckFailure(
                f"{what}: scales came back as {dtype} values; return e8m0 bytes: e + 127 as torch.uint8, or "
                "torch.float8_e8m0fnu"
            )
        if not torch.equal(scales, want.scales):
            got_e = scales.to(torch.int32) - 127
            reasons = {
                "floor": "the floor rule where round-up ('rceil') was asked",
                "rceil": "the round-up rule where 'floor' was asked",
                "e8m0 cast": "amax / max cast to torch.float8_e8m0fnu, which rounds to the nearest power of two "
                f"(ties up); the '{rule}' rule rounds {'down' if rule == 'floor' else 'up'}",
                "floor of log2(amax / max)": "floor(log2(amax / max)): the floor rule subtracts emax, the exponent "
                "of the largest power of two in the format (8 for e4m3: 256, not 448)",
                "ceil of log2(amax) - emax": "ceil(log2 amax) - emax: the floor rule rounds log2 amax down",
            }
            same = [key for key, e in variants.items() if key != rule and torch.equal(got_e, e)]
            because = [why for key, why in reasons.items() if key in same]
            bad = tuple((scales != want.scales).nonzero()[0].tolist())
            raise CheckFailure(
                f"{what}: the scale of block {list(bad)} is {int(scales[bad])}, expected {int(want.scales[bad])} "
                f"(amax {amax[bad].item():.6g})" + (f": {because[0]}" if because else "")
            )
        self._judge_data(case, what, data_got, want, x)

    def _judge_data(self, case: dict, what: str, data_got: object, want: object, x: torch.Tensor) -> None:
        elem = FORMATS[case["fmt"]][0]
        rows, cols = x.shape
        data, dtype = _bytes(data_got, f"{what}: data")
        expected = (rows, cols) if elem == "e4m3" else (rows, cols // 2)
        shape = tuple(data_got["shape"])
        if data is None:
            raise CheckFailure(
                f"{what}: data came back as {dtype} values; return "
                + ("torch.float8_e4m3fn (or its bytes)" if elem == "e4m3" else "the packed codes as torch.uint8")
            )
        if shape != expected:
            unpacked = elem == "e2m1" and shape == (rows, cols)
            because = ": e2m1 codes are packed two a byte, the first element in the low nibble" if unpacked else ""
            raise CheckFailure(f"{what}: data has shape {shape}; expected {expected}{because}")
        if torch.equal(data, want.data):
            return
        top = ELEMENTS[elem][0]
        e = want.scales.to(torch.int32) - 127
        blocks = x.reshape(rows, cols // 32, 32)
        scale = torch.exp2(e.float()).unsqueeze(-1)

        def encode(values: torch.Tensor) -> torch.Tensor:
            values = values.reshape(rows, cols)
            if elem == "e4m3":
                return values.clamp(-top, top).to(torch.float8_e4m3fn).view(torch.uint8)
            return pack_fp4(e2m1_codes(values))

        named = {
            "the scale applied instead of divided: the elements are x / 2^e": encode(blocks * scale),
        }
        if elem == "e2m1":
            named["the two codes of a byte swapped: the first element goes in the low nibble"] = (want.data >> 4) | (
                (want.data & 15) << 4
            )
        because = [why for why, alt in named.items() if torch.equal(data, alt)]
        scaled = (blocks / scale).reshape(rows, cols)
        if elem == "e2m1":  # element by element
            wrong = (unpack_fp4(data) != unpack_fp4(want.data)).reshape(rows, cols)
        else:
            wrong = (data != want.data).reshape(rows, cols)
        beyond = wrong & (scaled.abs() > top)  # a value beyond the format's largest, stored as something else
        if not because and bool(beyond.any()):
            wrong = beyond
            because = [f"saturation forgotten: a value beyond {top:g} after scaling is stored as {top:g}: clamp first"]
        i, j = wrong.nonzero()[0].tolist()
        exp_codes = want.data.reshape(rows, -1) if elem == "e4m3" else unpack_fp4(want.data).reshape(rows, cols)
        got_codes = data.reshape(rows, -1) if elem == "e4m3" else unpack_fp4(data).reshape(rows, cols)
        raise CheckFailure(
            f"{what}: element [{i}, {j}] (x = {x[i, j].item():.6g}, x / 2^e = {scaled[i, j].item():.6g}) is stored "
            f"as {int(got_codes[i, j]):#04x}, expected {int(exp_codes[i, j]):#04x}"
            + (f": {because[0]}" if because else "")
        )
