"""Checks for exercise 01 (floating-point formats). torch's own conversions are the reference,
computed in the grader's process; every check draws fresh inputs, so a hard-coded answer fails.
The task side is course_lib/tooling/probes/ch01.py."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from ...chapters.ch01.format_limits import overflow_threshold
from ...chapters.ch01.formats import all_values, bit_string, get_format
from ..checkbase import Check, CheckFailure, expect_list, expect_numbers, register

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

BY_HAND = ("torch", "numpy", "struct", "array", "course_lib")
BY_HAND_WHY = (
    "work it out with plain Python integers and floats (math.ldexp, >>, &), which is the point of "
    "the task; the grader reads your function, and what it uses, for torch, numpy, struct, array and course_lib"
)

_FP16_HINTS = {
    "normal": "normal numbers are (-1)^S × 1.M × 2^(E - 15), with M the 10-bit field divided by 2^10.",
    "subnormal": "exponent field 0 means a subnormal: 0.M × 2^-14 — no implicit leading 1, and the exponent "
    "is 1 - bias = -14 (not 0 - 15).",
    "zero": "0x0000 and 0x8000 are +0.0 and -0.0: keep the sign (e.g. math.copysign(0.0, -1) or -0.0).",
    "inf": "exponent field 31 (all ones) with mantissa 0 is ±inf.",
    "nan": "exponent field 31 with a non-zero mantissa is NaN (any NaN will do: float('nan')).",
}


def _kinds(patterns: np.ndarray) -> np.ndarray:
    e, m = (patterns >> 10) & 0x1F, patterns & 0x3FF
    return np.where(
        e == 0, np.where(m == 0, "zero", "subnormal"), np.where(e == 31, np.where(m == 0, "inf", "nan"), "normal")
    )


@register
class DecodeFp16(Check):
    name, args, points = "01.decode_fp16", ("decode_fp16",), 3
    hint = (
        "Split the 16 bits: sign = bits >> 15, exponent = (bits >> 10) & 0x1F, mantissa = bits & 0x3FF. "
        "E == 0: subnormal or zero, 0.M × 2^-14; E == 31: inf or NaN; otherwise 1.M × 2^(E - 15)."
    )
    forbidden, forbidden_why = BY_HAND, BY_HAND_WHY

    def cases(self, rng: random.Random) -> list:
        patterns = list(range(2**16))
        rng.shuffle(patterns)  # every pattern, in an order that must not matter
        return patterns

    def describe(self, case: int) -> str:
        return f"decode_fp16({case:#06x})"

    def judge(self, cases: list, results: list) -> None:
        expect_list(results, "decode_fp16's answers", len(cases))
        bad_type = next(
            (c for c, r in zip(cases, results) if isinstance(r, bool) or not isinstance(r, (int, float))), None
        )
        if bad_type is not None:
            got = results[cases.index(bad_type)]
            raise CheckFailure(f"decode_fp16({bad_type:#06x}) returned {got!r}, which is not a number")
        want = all_values("fp16").numpy()  # torch decodes every pattern: the reference
        got = np.empty(2**16)
        got[np.asarray(cases)] = np.asarray(results, dtype=np.float64)
        w_nan, g_nan = np.isnan(want), np.isnan(got)
        with np.errstate(invalid="ignore"):
            wrong = (w_nan != g_nan) | (~w_nan & ((got != want) | (np.signbit(got) != np.signbit(want))))
        if not wrong.any():
            return
        bad = np.flatnonzero(wrong)
        kind = _kinds(bad)
        counts = {k: int((kind == k).sum()) for k in _FP16_HINTS if (kind == k).any()}
        worst = max(counts, key=lambda k: counts[k])  # the kind with the most wrong patterns is representative
        examples = bad[kind == worst]
        positive = examples[examples < 0x8000]
        examples = positive if len(positive) else examples
        p = int(examples[len(examples) // 2])  # a typical pattern, not the edge of the range
        summary = ", ".join(f"{k} {v}" for k, v in counts.items())
        raise CheckFailure(
            f"wrong for {len(bad)} of 65536 patterns ({summary}); for example decode_fp16({p:#06x}) "
            f"returned {float(got[p])!r}, but the bits {bit_string(p, 'fp16', ' ')} ({worst}) mean "
            f"{float(want[p])!r}. {_FP16_HINTS[worst]}"
        )


@register
class RoundToBf16(Check):
    name, args, points = "01.round_to_bf16", ("round_to_bf16",), 2
    hint = (
        "Round to nearest, ties to even: add 0x7FFF plus bit 16 of the input, then keep the top 16 bits. "
        "Handle NaN first (exponent all ones, mantissa not 0): the carry could turn it into inf or -0."
    )
    forbidden, forbidden_why = BY_HAND, BY_HAND_WHY

    def cases(self, rng: random.Random) -> list:
        crafted_upper = [
            0x7F7F,
            0xFF7F,
            0x0000,
            0x8000,
            0x0001,
            0x007F,
            0x0080,
            0x3F80,
            0x3F81,
            0x4780,
            0x7F80,
            0xFF80,
            0x7FC0,
            0x7F80,
            0xFF80,
            0x7F81,
            0x0000,
            0x8000,
            0x477F,
            0x4000,
        ]
        crafted_lower = [
            0x8000,
            0x8000,
            0x8000,
            0x8000,
            0x8000,
            0xFFFF,
            0x7FFF,
            0x8000,
            0x8000,
            0x8000,
            0x0001,
            0xFFFF,
            0x0000,
            0x0000,
            0x0000,
            0x0000,
            0x0000,
            0x0000,
            0x8000,
            0x0001,
        ]
        # ties (0x8000) with even and odd upper halves, and their neighbours, tell RNE from other roundings
        lowers = [0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF, 0x0001]
        tricky = [rng.getrandbits(16) << 16 | rng.choice(lowers) for _ in range(3000)]
        cases = [u << 16 | lo for u, lo in zip(crafted_upper, crafted_lower)] + tricky
        cases += [rng.getrandbits(32) for _ in range(20000)]
        rng.shuffle(cases)
        return cases

    def describe(self, case: int) -> str:
        return f"round_to_bf16({case:#010x})"

    def judge(self, cases: list, results: list) -> None:
        inputs = torch.tensor(cases, dtype=torch.int64)
        x = torch.where(inputs >= 2**31, inputs - 2**32, inputs).to(torch.int32).view(torch.float32)
        want = (x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
        expect_list(results, "round_to_bf16's answers", len(cases))
        for u, r, w, nan, xf in zip(cases, results, want, torch.isnan(x).tolist(), x.tolist()):
            if isinstance(r, bool) or not isinstance(r, int):
                raise CheckFailure(f"round_to_bf16({u:#010x}) returned {r!r}, not an int bit pattern")
            if not 0 <= r < 2**16:
                raise CheckFailure(f"round_to_bf16({u:#010x}) returned {r:#x}: a bf16 pattern is 16 bits (0..0xFFFF)")
            if nan and (r & 0x7F80) == 0x7F80 and (r & 0x7F):
                continue  # any NaN is a right answer for a NaN
            if nan:
                raise CheckFailure(
                    f"round_to_bf16({u:#010x}) (an fp32 NaN) returned {r:#06x} "
                    f"({bit_string(r, 'bf16', ' ')}), which is not a NaN: expected exponent bits all "
                    "ones and a non-zero mantissa, e.g. 0x7fc0"
                )
            if r != w:
                tie = (u & 0xFFFF) == 0x8000
                raise CheckFailure(
                    f"round_to_bf16({u:#010x}) (fp32 {xf!r}) returned {r:#06x} "
                    f"({bit_string(r, 'bf16', ' ')}), expected {w:#06x} ({bit_string(w, 'bf16', ' ')})"
                    + (
                        ": this input is exactly halfway, so it goes to the neighbour whose last bit is 0"
                        if tie
                        else ""
                    )
                )


def _fp32_nudged(value: float, ulps: int) -> float:
    """value rounded to fp32, moved by `ulps` fp32 units in the last place."""
    v = np.float32(value)
    for _ in range(abs(ulps)):
        v = np.nextafter(v, np.float32(np.inf if ulps > 0 else 0))
    return float(v)


def _torch_fate(x: float, fmt: str) -> tuple[str, float]:
    f = get_format(fmt)
    r = float(torch.tensor([x], dtype=torch.float32).to(f.dtype).to(torch.float64)[0])
    if math.isinf(r):
        return "overflow", r
    if r == 0:
        return "underflow", r
    return ("subnormal" if abs(r) < f.smallest_normal else "normal"), r


@register
class FpFate(Check):
    name, args, points = "01.fp_fate", ("fp_fate",), 2
    hint = (
        "Compare |x| with the format's thresholds, remembering that rounding happens first: fp16 overflows "
        "only from 65520 (65519 rounds to 65504), and a non-zero x becomes 0 only when |x| <= half the "
        "smallest subnormal (2^-25 for fp16). bf16 has fp32's exponent range."
    )
    forbidden, forbidden_why = BY_HAND, "derive the thresholds from the formats (bias, mantissa bits), not torch"

    def cases(self, rng: random.Random) -> list:
        cases = []
        for fmt in ("fp16", "bf16"):
            f = get_format(fmt)
            anchors = [
                f.max,
                overflow_threshold(f),
                f.smallest_normal,
                f.smallest_normal - f.smallest_subnormal / 2,
                f.smallest_subnormal,
                f.smallest_subnormal / 2,
                1.5 * f.smallest_subnormal,
                1.0,
            ]
            xs = [_fp32_nudged(a, k) for a in anchors for k in [0] + rng.sample(range(-6, 7), 6)]
            if fmt == "fp16":
                xs += [65519.0 + rng.random() * 0.9, 65504.0 + rng.random() * 15.9, 1e5 * (1 + rng.random())]
            xs += [float(np.float32(2.0 ** rng.uniform(-149, 128))) for _ in range(300)]  # all of fp32's range
            cases += [[x if rng.random() < 0.5 else -x, fmt] for x in xs if x != 0 and math.isfinite(x)]
        rng.shuffle(cases)
        return cases

    def describe(self, case: list) -> str:
        return f"fp_fate({case[0]!r}, {case[1]!r})"

    def judge(self, cases: list, results: list) -> None:
        for (x, fmt), got in zip(cases, expect_list(results, "fp_fate's answers", len(cases))):
            want, stored = _torch_fate(x, fmt)
            if got != want:
                raise CheckFailure(
                    f"fp_fate({x!r}, {fmt!r}) returned {got!r}, but {fmt} stores this number as "
                    f"{stored!r}, so the answer is {want!r}"
                )


def _naive_bf16_dot(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    s = torch.zeros((), dtype=torch.bfloat16)
    for a, b in zip(xb, yb):
        s = s + a * b
    return s


@register
class Bf16DotErrors(Check):
    name, args, points = "01.bf16_dot_errors", ("bf16_dot_errors",), 2
    hint = (
        "Reference: the float64 dot of the float32 inputs. mixed: round x and y to bf16, then multiply and sum "
        "in float32. naive: s = bf16 zero; s = s + xb[i] * yb[i] in a Python loop over bf16 scalars "
        "(torch.dot/sum on bf16 tensors accumulate in fp32 on CPU). Relative: |got - ref| / |ref|."
    )

    def cases(self, rng: random.Random) -> list:
        out = []
        for _ in range(4):
            n, scale = rng.randint(300, 1500), 10.0 ** rng.uniform(-3, 3)
            g = torch.Generator().manual_seed(rng.getrandbits(31))
            x, y = torch.rand(n, generator=g) * scale, torch.rand(n, generator=g) * scale  # positive: no cancellation
            out.append({"x": x.tolist(), "y": y.tolist(), "scale": scale})  # float32 values, exact as Python floats
        return out

    def describe(self, case: dict) -> str:
        return f"bf16_dot_errors on {len(case['x'])} values of scale {case['scale']:.3g}"

    def judge(self, cases: list, results: list) -> None:
        for case, got in zip(cases, expect_list(results, "bf16_dot_errors's answers", len(cases))):
            x, y = torch.tensor(case["x"], dtype=torch.float32), torch.tensor(case["y"], dtype=torch.float32)
            where = self.describe(case)
            if not (isinstance(got, list) and len(got) == 2):
                raise CheckFailure(f"{where}: returned {got!r}; expected a pair of numbers (mixed_error, naive_error)")
            # finite too: a NaN is never "further than the tolerance" from the reference
            got_mixed, got_naive = expect_numbers(got, f"{where}: the pair (mixed_error, naive_error)", 2)
            ref = (x.double() * y.double()).sum().item()
            xb, yb = x.bfloat16(), y.bfloat16()
            prods = xb.double() * yb.double()  # exact: 8-bit times 8-bit significands
            floor = abs(prods.sum().item() - ref) / ref  # mixed with an exact accumulator
            # fp32 accumulation in any order lies near the floor: measure the spread of two extreme orders
            orders = [float(np.add.accumulate(prods.float().numpy())[-1]), float(torch.dot(xb.float(), yb.float()))]
            spread = max(abs(abs(o - ref) / ref - floor) for o in orders)
            naive = abs(_naive_bf16_dot(xb, yb).item() - ref) / ref
            if abs(got_mixed - floor) > 3 * spread + 0.02 * floor + 1e-7:
                why = (
                    "much smaller than bf16 rounding allows: are the inputs rounded to bf16?"
                    if got_mixed < floor / 4
                    else "is it relative (divided by |reference|), kept in float32?"
                )
                raise CheckFailure(f"{where}: mixed error {got_mixed!r}, expected about {floor:.3e}; {why}")
            if abs(got_naive - naive) > 1e-6 * naive + 1e-12:
                why = (
                    "an fp32 accumulator (torch.dot/sum/cumsum accumulate in fp32 on CPU)?"
                    if got_naive < naive / 2
                    else "every product and every addition should round to bf16, in order"
                )
                raise CheckFailure(f"{where}: naive error {got_naive!r}, expected {naive:.4e}: {why}")
