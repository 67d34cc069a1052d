"""What a format's range and precision do to numbers: fp32, tf32, fp16, bf16 and fp8 side by side.

Chapter 01 introduces everything here, after the bit layouts of `formats`. torch is the oracle
again: a number goes through torch's own conversion, so a table, a gap or a fate is what
PyTorch does, not what a textbook says it should.

    print(format_limits_table())    # range and precision of every format, from torch.finfo
    spacing(1000.0, "bf16")         # the gap to the next number up: one ulp
    fate(70000.0, "fp16")           # "overflow" | "underflow" | "subnormal" | "normal" ...
    sum_experiment()                # adding 1e-4 ten thousand times: the sum that stalls
    fp8_roundtrip(t, "e4m3")        # fp8 and back, scaled so that amax lands on the format's max
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from course_lib.chapters.ch01.formats import Format, from_unsigned, get_format, storage_format, to_unsigned
from course_lib.tables import table

__all__ = ["limits_table", "format_limits_table", "spacing", "fate", "fates", "sum_experiment", "fp8_roundtrip"]


# --------------------------------------------------------------------------- range and precision


def limits_table(names: Iterable[str] = ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")) -> list[dict]:
    """Chapter 01: range and precision of each format, one dict per format, read from torch.finfo
    where torch has the dtype (format_limits_table prints them).

    torch.finfo has no smallest subnormal; it is smallest_normal * eps (2^(1-bias) * 2^-m),
    exact because both are powers of two. tf32 has no dtype, so its row comes from its layout.
    """
    rows = []
    for name in names:
        f = get_format(name)
        if f.dtype is not None:
            fi = torch.finfo(f.dtype)
            row = {
                "max": fi.max,
                "smallest_normal": fi.smallest_normal,
                "smallest_subnormal": fi.smallest_normal * fi.eps,
                "eps": fi.eps,
                "source": "torch.finfo",
            }
        else:
            row = {
                "max": f.max,
                "smallest_normal": f.smallest_normal,
                "smallest_subnormal": None,
                "eps": f.eps,
                "source": "layout only",
            }
        rows.append(
            {
                "format": f.name,
                "bits": f.bits,
                "exponent_bits": f.exponent_bits,
                "mantissa_bits": f.mantissa_bits,
                "bias": f.bias,
                **row,
                "decimal_digits": f.decimal_digits,
                "has_inf": f.has_inf,
                "dtype": str(f.dtype),
            }
        )
    return rows


def format_limits_table(names: Iterable[str] = ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")) -> str:
    """Chapter 01: limits_table as fixed-width text, lines under 100 characters (deterministic, so
    the notebook test compares it). "layout only": tf32 has no dtype, its row comes from its bits."""
    columns = [
        ("format", "format", ""),
        ("layout", lambda r: f"1+{r['exponent_bits']}+{r['mantissa_bits']}", ""),
        ("bias", "bias", ""),
        ("max", "max", ".4e"),
        ("min normal", "smallest_normal", ".3e"),
        ("min subnormal", "smallest_subnormal", ".3e"),
        ("eps", "eps", ".3e"),
        ("digits", "decimal_digits", ".2f"),
        ("source", "source", "<"),
    ]
    return table(limits_table(names), columns)


def spacing(x: float | Sequence[float] | torch.Tensor, fmt: str | torch.dtype | Format) -> torch.Tensor:
    """Chapter 01: the gap between |x| (rounded to the format) and the next representable number up
    (at the format's max, the gap below it). This is one 'unit in the last place' (ulp).

    Computed from the bits: for positive numbers the next pattern is the next value, which also
    works for fp8, where torch.nextafter is not implemented. NaN where x is out of the format's
    range (including e4m3fn, which saturates instead of overflowing) or is NaN.
    """
    f = storage_format(fmt)
    x = torch.as_tensor(x, dtype=torch.float64).abs()
    t = x.to(f.dtype)
    p = to_unsigned(t.view(f.int_dtype), f)
    v = t.to(torch.float64)
    up = from_unsigned(p + 1, f).to(torch.float64)
    down = from_unsigned(torch.clamp(p - 1, min=0), f).to(torch.float64)
    gap = torch.where(torch.isfinite(up), up - v, v - down)
    # out of range: inf, or (e4m3fn, which saturates) beyond the rounding threshold
    inside = torch.isfinite(v) & (x <= overflow_threshold(f))
    return torch.where(inside, gap, torch.full_like(v, math.nan))


def overflow_threshold(fmt: str | torch.dtype | Format) -> float:
    """The magnitude from which round-to-nearest leaves the format's range:
    max + half a gap at the top (fp16: 65504 + 16 = 65520). At exactly this value the tie goes
    to the even neighbour: beyond max (overflow) when max's last mantissa bit is 1 (fp16, bf16,
    fp32, e5m2), back to max when it is 0 (e4m3fn's max 448 = 1.110b × 2^8)."""
    f = get_format(fmt)
    e_top = math.frexp(f.max)[1] - 1
    return f.max + math.ldexp(1.0, e_top - f.mantissa_bits - 1)


def fate(x: float, fmt: str | torch.dtype | Format) -> str:
    """Chapter 01: what torch's conversion to the format does to the number x, from the format's thresholds.

    "overflow"   becomes inf (e4m3fn has none: torch saturates to ±448 or gives NaN, by version)
    "underflow"  a non-zero number becomes 0: |x| <= smallest_subnormal / 2 (the tie goes to 0, even)
    "subnormal"  survives, but with fewer significant bits than a normal number
    "normal"     full precision; and "zero", "inf", "nan" for those inputs. Tested against torch's conversion.
    e4m3fn has no inf, so inf is out of its range like any number past 464: "overflow", not "inf"
    (torch stores ±448 or NaN, by version; the bit explorer and section 7 of chapter 01 show which).
    torch converts a float64 (a Python float) to the 16- and 8-bit formats through float32, so x is
    judged as the float32 it rounds to, as decompose() and an fp32 tensor holding x see it: 65519.99999
    is below fp16's midpoint 65520, but its float32 is 65520.0, a tie, and torch stores inf.
    """
    f = get_format(fmt)
    a = abs(float(x))
    if math.isnan(a) or a == 0:
        return "nan" if math.isnan(a) else "zero"
    if math.isinf(a):  # stays inf where the format has one; e4m3fn has none
        return "inf" if f.has_inf else "overflow"
    a = float(torch.tensor(a, dtype=torch.float32))  # torch's first rounding; inf or 0 outside fp32's range
    t_over = overflow_threshold(f)
    max_is_odd = f.has_inf  # max has mantissa all ones (odd) when inf exists; e4m3fn's 1.110b is even
    if a > t_over or (a == t_over and max_is_odd):
        return "overflow"
    if a <= f.smallest_subnormal / 2:
        return "underflow"
    # Between the largest subnormal and the smallest normal the tie rounds up (to the even mantissa 0).
    if a < f.smallest_normal - f.smallest_subnormal / 2:
        return "subnormal"
    return "normal"


def fates(t: torch.Tensor, fmt: str | torch.dtype | Format, scale: float | None = None) -> dict[str, float]:
    """Chapter 01: the fraction of the non-zero finite entries of t that overflow, underflow (become 0),
    become subnormal or stay normal when converted to the format (by torch): `fate`'s classes, counted.

    With `scale`, each entry is first multiplied by it as GradScaler's scale() does: a float32 times
    the scale held as a float32, rounded once to float32 (chapter 03's `fates_at_scales`). An entry
    whose product is 0 or inf still counts, as "underflow" or "overflow".
    """
    f = storage_format(fmt)
    t = t[(t != 0) & torch.isfinite(t)]
    if scale is not None:
        t = t.float() * torch.tensor(scale, dtype=torch.float32)  # float32 x float32 -> float32
    r = t.to(f.dtype).to(torch.float64)
    # e4m3fn has no inf: out of range is beyond the threshold (the tie 464 goes to 448), judged on the float32
    over = torch.isinf(r) if f.has_inf else t.abs().float().double() > overflow_threshold(f)  # torch converts
    zero = r == 0
    sub = (r.abs() < f.smallest_normal) & ~zero
    n = max(t.numel(), 1)
    return {
        "overflow": over.sum().item() / n,
        "underflow": zero.sum().item() / n,
        "subnormal": sub.sum().item() / n,
        "normal": (~(over | zero | sub)).sum().item() / n,
    }


# --------------------------------------------------------------------------- accumulation


def running_sum(
    values: Sequence[float] | torch.Tensor,
    fmt: str | torch.dtype | Format,
    accumulator: str | torch.dtype | Format | None = None,
) -> torch.Tensor:
    """The partial sums of a naive left-to-right loop `s = s + v[i]`, as float64.

    The values are rounded to `fmt`; the running sum is kept (rounded after every addition) in
    `accumulator`, which defaults to `fmt` itself. One Python-level addition per value, so
    nothing (no vectorised kernel, no hidden fp32 accumulator) changes the order or precision.
    """
    f = storage_format(fmt)
    acc = storage_format(accumulator) if accumulator is not None else f
    v = torch.as_tensor(values, dtype=torch.float64).to(f.dtype).to(acc.dtype)
    s = torch.zeros((), dtype=acc.dtype)
    out = torch.empty(len(v), dtype=torch.float64)
    for i in range(len(v)):
        s = s + v[i]
        out[i] = s
    return out


def sum_experiment(
    increment: float = 1e-4, n: int = 10_000, formats: Sequence[str] = ("fp32", "bf16", "fp16")
) -> list[dict]:
    """Chapter 01: add `increment` n times in each format, three ways, against the exact n * increment.

    "naive"      running_sum in the format: the sum stops growing (stalls) once the increment is
                 at most half the spacing of the sum
    "fp32 acc"   the values in the format, the running sum in fp32 (what GEMMs and reductions do)
    "torch.sum"  torch's own reduction on a tensor of that dtype
    """
    rows = []
    exact = n * increment
    for name in formats:
        f = storage_format(name)
        ways = {"naive": running_sum([increment] * n, f)}
        if name != "fp32":
            ways["fp32 acc"] = running_sum([increment] * n, f, "fp32")
        values = torch.full((n,), increment, dtype=torch.float64).to(f.dtype)
        ways["torch.sum"] = values.sum().to(torch.float64).reshape(1)
        for way, partial in ways.items():
            final = float(partial[-1])
            stalled_after, stalled_value = None, None
            if len(partial) == n:  # the sum never changes after the step that last changed it
                changed = torch.nonzero(partial[1:] != partial[:-1]).flatten()
                last = int(changed[-1]) + 1 if len(changed) else 0
                if last < n - 1:
                    stalled_after, stalled_value = last + 1, float(partial[last])
            rows.append(
                {
                    "format": name,
                    "how": way,
                    "final": final,
                    "rel_error": abs(final - exact) / exact,
                    "stalled_after_step": stalled_after,
                    "stalled_value": stalled_value,
                }
            )
    return rows


def fp8_roundtrip(
    t: torch.Tensor, fmt: str | torch.dtype | Format = "fp8_e4m3fn", scaled: bool = True
) -> tuple[torch.Tensor, float]:
    """Chapter 01: t cast to an fp8 format and back, returning (t_hat, scale).

    With scaled=True the tensor is first multiplied by format.max / amax(t), so its largest
    entry lands on the format's max (the per-tensor scaling of fp8 training recipes), and the
    scale is divided out after the round trip.
    """
    f = storage_format(fmt)
    amax = t.abs().max().item()
    scale = f.max / amax if scaled and amax > 0 else 1.0
    return (t * scale).to(f.dtype).to(t.dtype) / scale, scale
