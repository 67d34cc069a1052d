"""Checks for exercise 01 (floating-point formats). torch's own conversions are the reference;
every check draws fresh random inputs, so a hard-coded answer fails."""
from __future__ import annotations

import math
import random

import numpy as np
import torch

from ...chapters.formats import all_values, bit_string, get_format, overflow_threshold
from ..grading import CheckFailure, register

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

_FP16_HINTS = {
    "zero": "0x0000 and 0x8000 are +0.0 and -0.0: keep the sign (e.g. math.copysign(0.0, -1) or -0.0).",
    "subnormal": "exponent field 0 means a subnormal: 0.M × 2^-14 — no implicit leading 1, and the exponent "
                 "is 1 - bias = -14 (not 0 - 15).",
    "normal": "normal numbers are (-1)^S × 1.M × 2^(E - 15), with M the 10-bit field divided by 2^10.",
    "inf": "exponent field 31 (all ones) with mantissa 0 is ±inf.",
    "nan": "exponent field 31 with a non-zero mantissa is NaN (any NaN will do: float('nan')).",
}


def _as_float(fn_name: str, arg: object, result: object) -> float:
    try:
        return float(result)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise CheckFailure(f"{fn_name}({arg}) returned {result!r}, which is not a number") from None


@register("01.decode_fp16", args=("decode_fp16",), points=3,
          hint="Split the 16 bits: sign = bits >> 15, exponent = (bits >> 10) & 0x1F, mantissa = bits & 0x3FF. "
               "E == 0: subnormal or zero, 0.M × 2^-14; E == 31: inf or NaN; otherwise 1.M × 2^(E - 15).")
def _decode_fp16(decode_fp16) -> None:
    want = all_values("fp16").numpy()  # torch decodes every pattern: the reference
    patterns = list(range(2 ** 16))
    random.shuffle(patterns)  # order must not matter
    got = np.empty(2 ** 16)
    for p in patterns:
        got[p] = _as_float("decode_fp16", hex(p), decode_fp16(p))
    w_nan, g_nan = np.isnan(want), np.isnan(got)
    with np.errstate(invalid="ignore"):
        wrong = (w_nan != g_nan) | (~w_nan & ((got != want) | (np.signbit(got) != np.signbit(want))))
    if not wrong.any():
        return
    bad = np.flatnonzero(wrong)
    e, m = (bad >> 10) & 0x1F, bad & 0x3FF
    kind = np.where(e == 0, np.where(m == 0, "zero", "subnormal"),
                    np.where(e == 31, np.where(m == 0, "inf", "nan"), "normal"))
    counts = {k: int((kind == k).sum()) for k in _FP16_HINTS if (kind == k).any()}
    first = next(iter(counts))  # report the most basic kind that is wrong: zero, subnormal, normal, ...
    examples = bad[kind == first]
    positive = examples[examples < 0x8000]
    examples = positive if len(positive) else examples
    p = int(examples[len(examples) // 2])  # a typical pattern, not the edge of the range
    summary = ", ".join(f"{k} {v}" for k, v in counts.items())
    raise CheckFailure(f"wrong for {len(bad)} of 65536 patterns ({summary}). For example "
                       f"decode_fp16({p:#06x}) returned {float(got[p])!r}, but the bits {bit_string(p, 'fp16', ' ')} "
                       f"({first}) mean {float(want[p])!r}. {_FP16_HINTS[first]}")


@register("01.round_to_bf16", args=("round_to_bf16",), points=2,
          hint="Round to nearest, ties to even: add 0x7FFF plus bit 16 of the input, then keep the top 16 bits. "
               "Handle NaN first (exponent all ones, mantissa not 0): the carry could turn it into inf or -0.")
def _round_to_bf16(round_to_bf16) -> None:
    g = torch.Generator().manual_seed(random.getrandbits(31))
    upper = torch.randint(0, 2 ** 16, (3000,), generator=g, dtype=torch.int64)
    upper[:20] = torch.tensor([0x7F7F, 0xFF7F, 0x0000, 0x8000, 0x0001, 0x007F, 0x0080, 0x3F80, 0x3F81, 0x4780,
                               0x7F80, 0xFF80, 0x7FC0, 0x7F80, 0xFF80, 0x7F81, 0x0000, 0x8000, 0x477F, 0x4000])
    # ties (0x8000) with even and odd upper halves, and their neighbours, decide RNE vs other roundings
    lower = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF, 0x0001])[torch.randint(0, 6, (3000,), generator=g)]
    lower[:20] = torch.tensor([0x8000, 0x8000, 0x8000, 0x8000, 0x8000, 0xFFFF, 0x7FFF, 0x8000, 0x8000, 0x8000,
                               0x0001, 0xFFFF, 0x0000, 0x0000, 0x0000, 0x0000, 0x0000, 0x0000, 0x8000, 0x0001])
    crafted = upper * 2 ** 16 + lower
    rand = torch.randint(0, 2 ** 32, (20000,), generator=g, dtype=torch.int64)
    inputs = torch.cat([crafted, rand])
    x = torch.where(inputs >= 2 ** 31, inputs - 2 ** 32, inputs).to(torch.int32).view(torch.float32)
    want = (x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
    for u, w, nan, xf in zip(inputs.tolist(), want, torch.isnan(x).tolist(), x.tolist()):
        r = round_to_bf16(u)
        try:
            r = int(r)
        except (TypeError, ValueError):
            raise CheckFailure(f"round_to_bf16({u:#010x}) returned {r!r}, not an int bit pattern") from None
        if not 0 <= r < 2 ** 16:
            raise CheckFailure(f"round_to_bf16({u:#010x}) returned {r:#x}: a bf16 pattern is 16 bits (0..0xFFFF)")
        if nan and (r & 0x7F80) == 0x7F80 and (r & 0x7F):
            continue  # any NaN is a right answer for a NaN
        if nan:
            raise CheckFailure(f"round_to_bf16({u:#010x}) (an fp32 NaN) returned {r:#06x} "
                               f"({bit_string(r, 'bf16', ' ')}), which is not a NaN: expected exponent bits all "
                               "ones and a non-zero mantissa, e.g. 0x7fc0")
        if r != w:
            tie = (u & 0xFFFF) == 0x8000
            raise CheckFailure(f"round_to_bf16({u:#010x}) (fp32 {xf!r}) returned {r:#06x} "
                               f"({bit_string(r, 'bf16', ' ')}), expected {w:#06x} ({bit_string(w, 'bf16', ' ')})"
                               + (": this input is exactly halfway, so it goes to the neighbour whose last bit is 0"
                                  if tie else ""))


def _fp32_nudged(value: float, ulps: int) -> float:
    """value rounded to fp32, moved by `ulps` fp32 units in the last place."""
    v = np.float32(value)
    for _ in range(abs(ulps)):
        v = np.nextafter(v, np.float32(np.inf if ulps > 0 else 0))
    return float(v)


def _fate_cases(fmt: str, rng: random.Random) -> list[float]:
    f = get_format(fmt)
    anchors = [f.max, overflow_threshold(f), f.smallest_normal, f.smallest_normal - f.smallest_subnormal / 2,
               f.smallest_subnormal, f.smallest_subnormal / 2, 1.5 * f.smallest_subnormal, 1.0]
    cases = []
    for a in anchors:  # the thresholds themselves and random neighbours of them
        cases += [_fp32_nudged(a, k) for k in [0] + rng.sample(range(-6, 7), 6)]
    if fmt == "fp16":
        cases += [65519.0 + rng.random() * 0.9, 65504.0 + rng.random() * 15.9, 1e5 * (1 + rng.random())]
    for _ in range(300):  # log-uniform over all of fp32's positive range
        cases.append(float(np.float32(2.0 ** rng.uniform(-149, 128))))
    cases = [c for c in cases if c != 0 and math.isfinite(c)]
    return [c if rng.random() < 0.5 else -c for c in cases]


def _torch_fate(x: float, fmt: str) -> tuple[str, float]:
    f = get_format(fmt)
    r = float(torch.tensor([x], dtype=torch.float32).to(f.dtype).to(torch.float64)[0])
    if math.isinf(r):
        return "overflow", r
    if r == 0:
        return "underflow", r
    return ("subnormal" if abs(r) < f.smallest_normal else "normal"), r


@register("01.fp_fate", args=("fp_fate",), points=2,
          hint="Compare |x| with the format's thresholds, remembering that rounding happens first: fp16 overflows "
               "only from 65520 (65519 rounds to 65504), and a non-zero x becomes 0 only when |x| <= half the "
               "smallest subnormal (2^-25 for fp16). bf16 has fp32's exponent range.")
def _fp_fate(fp_fate) -> None:
    rng = random.Random()
    for fmt in ("fp16", "bf16"):
        for x in _fate_cases(fmt, rng):
            want, stored = _torch_fate(x, fmt)
            got = fp_fate(x, fmt)
            if got != want:
                raise CheckFailure(f"fp_fate({x!r}, {fmt!r}) returned {got!r}, but {fmt} stores this number as "
                                   f"{stored!r}, so the answer is {want!r}")


def _naive_bf16_dot(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    s = torch.zeros((), dtype=torch.bfloat16)
    for a, b in zip(xb, yb):
        s = s + a * b
    return s


@register("01.bf16_dot_errors", args=("bf16_dot_errors",), points=2,
          hint="Reference: the float64 dot of the float32 inputs. mixed: round x and y to bf16, then multiply "
               "and sum in float32. naive: s = bf16 zero; s = s + xb[i] * yb[i] in a Python loop over bf16 "
               "scalars (torch.dot/sum on bf16 tensors accumulate in fp32 on CPU). Relative: |got - ref| / |ref|.")
def _bf16_dot_errors(bf16_dot_errors) -> None:
    rng = random.Random()
    for _ in range(4):
        n, scale = rng.randint(300, 1500), 10.0 ** rng.uniform(-3, 3)
        g = torch.Generator().manual_seed(rng.getrandbits(31))
        x, y = torch.rand(n, generator=g) * scale, torch.rand(n, generator=g) * scale  # positive: no cancellation
        ref = (x.double() * y.double()).sum().item()
        xb, yb = x.bfloat16(), y.bfloat16()
        prods = xb.double() * yb.double()  # exact: 8-bit times 8-bit significands
        floor = abs(prods.sum().item() - ref) / ref  # mixed with an exact accumulator
        # fp32 accumulation in any order lies near the floor: measure the spread of two extreme orders
        p32 = prods.float().numpy()
        orders = [float(np.add.accumulate(p32)[-1]), float(torch.dot(xb.float(), yb.float()))]
        spread = max(abs(abs(o - ref) / ref - floor) for o in orders)
        naive = abs(_naive_bf16_dot(xb, yb).item() - ref) / ref
        try:
            got_mixed, got_naive = (float(v) for v in bf16_dot_errors(x.clone(), y.clone()))
        except (TypeError, ValueError):
            raise CheckFailure("bf16_dot_errors should return a pair of numbers (mixed_error, naive_error)") from None
        if abs(got_mixed - floor) > 3 * spread + 0.02 * floor + 1e-7:
            why = ("much smaller than bf16 rounding allows: are the inputs rounded to bf16?" if got_mixed < floor / 4
                   else "is it relative (divided by |reference|), with the result kept in float32?")
            raise CheckFailure(f"n={n}, scale {scale:.3g}: mixed error {got_mixed:.3e}, "
                               f"expected about {floor:.3e}; {why}")
        if abs(got_naive - naive) > 1e-6 * naive + 1e-12:
            why = ("an fp32 accumulator (torch.dot/sum/cumsum accumulate in fp32 on CPU)?" if got_naive < naive / 2
                   else "every product and every addition should round to bf16, in order")
            raise CheckFailure(f"n={n}, scale {scale:.3g}: naive error {got_naive:.4e}, expected {naive:.4e}: {why}")
