"""Floating-point formats bit by bit: fp32, fp16, bf16, fp8 (e4m3fn, e5m2), and tf32 described.

Chapter 01 introduces everything here. torch itself is the oracle: a number is rounded by
`torch.tensor(x).to(dtype)` and its bits are read back with `.view(int dtype)`, so what you
see is exactly what PyTorch stores, not what a textbook says it should.

    decompose(0.1, "bf16")          # sign / exponent / mantissa, kind, stored value, error
    print(format_table_text())      # range and precision of every format, from torch.finfo

A value of a format with e exponent bits and m mantissa bits is
    normal     (-1)^s * 2^(E - bias) * 1.M      for 0 < E < all ones   (bias = 2^(e-1) - 1)
    subnormal  (-1)^s * 2^(1 - bias) * 0.M      for E == 0 (M == 0 is a signed zero)
    inf / NaN  E all ones (e4m3fn has no inf: only S.1111.111 is NaN, the rest are numbers)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

__all__ = ["FORMATS", "STORAGE_FORMATS", "get_format", "all_values", "decompose", "format_table",
           "format_table_text", "spacing", "fate", "fates", "sum_experiment", "fp8_roundtrip"]


@dataclass(frozen=True)
class Format:
    """The bit layout of one floating-point format."""
    name: str
    dtype: torch.dtype | None   # None for tf32: a matmul compute mode, never a tensor's dtype
    exponent_bits: int
    mantissa_bits: int
    has_inf: bool = True        # fp8 e4m3fn ("fn" = finite, NaN only) spends inf's codes on numbers
    note: str = ""

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def int_dtype(self) -> torch.dtype:
        """The integer dtype of the same width, for tensor.view(): how we read the bits."""
        return {32: torch.int32, 16: torch.int16, 8: torch.uint8}[self.bits]

    # The numbers below are computed exactly from the layout (Python floats are doubles,
    # and every one of these is a power of two or a short binary fraction).
    @property
    def max(self) -> float:
        e_max = 2 ** self.exponent_bits - 2 - self.bias if self.has_inf else 2 ** self.exponent_bits - 1 - self.bias
        top_mantissa = 2 ** self.mantissa_bits - (1 if self.has_inf else 2)  # e4m3fn: all ones is NaN
        return math.ldexp(1 + top_mantissa / 2 ** self.mantissa_bits, e_max)

    @property
    def smallest_normal(self) -> float:
        return math.ldexp(1.0, 1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        return math.ldexp(1.0, 1 - self.bias - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Distance from 1.0 to the next larger number: 2^-mantissa_bits."""
        return math.ldexp(1.0, -self.mantissa_bits)

    @property
    def decimal_digits(self) -> float:
        """Significant decimal digits: (mantissa_bits + 1 implicit bit) * log10(2)."""
        return (self.mantissa_bits + 1) * math.log10(2)


FORMATS: dict[str, Format] = {
    "fp32": Format("fp32", torch.float32, 8, 23, note="IEEE binary32: torch.float32, the default"),
    "tf32": Format("tf32", None, 8, 10, note="NVIDIA TensorFloat-32: how Ampere+ Tensor Cores read fp32 "
                                              "matmul inputs when allowed; 19 bits used, 32 stored"),
    "fp16": Format("fp16", torch.float16, 5, 10, note="IEEE binary16: torch.float16 / half"),
    "bf16": Format("bf16", torch.bfloat16, 8, 7, note="brain float: fp32's exponent, 7 mantissa bits"),
    "fp8_e5m2": Format("fp8_e5m2", torch.float8_e5m2, 5, 2,
                       note="OCP fp8, IEEE-like: inf and NaN; range for gradients"),
    "fp8_e4m3fn": Format("fp8_e4m3fn", torch.float8_e4m3fn, 4, 3, has_inf=False,
                         note="OCP fp8, finite: no inf, max 448; precision for weights/activations"),
}
STORAGE_FORMATS = ("fp32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")  # the ones a tensor can have

_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
            "e4m3": "fp8_e4m3fn", "e4m3fn": "fp8_e4m3fn", "fp8_e4m3": "fp8_e4m3fn", "float8_e4m3fn": "fp8_e4m3fn",
            "e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2", "tensorfloat32": "tf32"}


def get_format(fmt: str | torch.dtype | Format) -> Format:
    """Chapter 01: a Format from its name ('bf16', 'e4m3', 'float16', ...) or its torch dtype."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        for f in FORMATS.values():
            if f.dtype == fmt:
                return f
        raise ValueError(f"{fmt} is not one of the formats of chapter 01: {', '.join(STORAGE_FORMATS)}")
    key = str(fmt).lower().replace("torch.", "").replace(" ", "_")
    key = _ALIASES.get(key, key)
    if key not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    return FORMATS[key]


def _storage(fmt: str | torch.dtype | Format) -> Format:
    f = get_format(fmt)
    if f.dtype is None:
        raise ValueError("tf32 is not a storage dtype: no tensor is ever tf32. Ampere+ GPUs read fp32 matmul "
                         "inputs with 10 mantissa bits when torch.backends.cuda.matmul.fp32_precision = 'tf32' "
                         "(older spelling: torch.set_float32_matmul_precision('high')); the result is fp32.")
    return f


# --------------------------------------------------------------------------- bits <-> values

def _to_unsigned(p: torch.Tensor, f: Format) -> torch.Tensor:
    """Bit patterns read with view() (int16/int32 are signed) as non-negative int64."""
    return p.to(torch.int64) & (2 ** f.bits - 1)


def _from_unsigned(p: torch.Tensor, f: Format) -> torch.Tensor:
    """Non-negative int64 patterns -> tensor of the format (values, not conversions)."""
    p = p.to(torch.int64) % 2 ** f.bits
    if f.int_dtype != torch.uint8:  # signed view: patterns with the top bit set are negative ints
        p = torch.where(p >= 2 ** (f.bits - 1), p - 2 ** f.bits, p)
    return p.to(f.int_dtype).view(f.dtype)


def round_to(x: float | Sequence[float] | torch.Tensor, fmt: str | torch.dtype | Format) -> torch.Tensor:
    """X rounded to the format by torch's own conversion, as float64 (exact) values.

    Python floats are float64. torch converts float64 to the 16- and 8-bit formats through
    float32, so a float64 that is not also a float32 can be rounded twice (off by one unit in the
    last place, only within 2^-24 relative of a tie). Pass float32 tensors to avoid that.
    """
    f = _storage(fmt)
    t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64)
    return t.to(f.dtype).to(torch.float64)


def to_bits(x: float, fmt: str | torch.dtype | Format) -> int:
    """The bit pattern (as an unsigned int) torch stores for x in the format."""
    f = _storage(fmt)
    stored = torch.tensor([float(x)], dtype=torch.float64).to(f.dtype)
    return int(_to_unsigned(stored.view(f.int_dtype), f)[0])


def from_bits(pattern: int, fmt: str | torch.dtype | Format) -> float:
    """The value a bit pattern means in the format (decoded by torch)."""
    f = _storage(fmt)
    if not 0 <= pattern < 2 ** f.bits:
        raise ValueError(f"{f.name} patterns are {f.bits}-bit: 0 <= pattern < {2 ** f.bits}, got {pattern}")
    return float(_from_unsigned(torch.tensor([pattern]), f).to(torch.float64)[0])


def all_values(fmt: str | torch.dtype | Format) -> torch.Tensor:
    """Chapter 01: the value of every bit pattern 0 .. 2^bits - 1 of an 8- or 16-bit format (float64)."""
    f = _storage(fmt)
    if f.bits > 16:
        raise ValueError(f"{f.name} has 2^{f.bits} patterns: too many to list")
    return _from_unsigned(torch.arange(2 ** f.bits), f).to(torch.float64)


def split_bits(pattern: int, fmt: str | torch.dtype | Format) -> tuple[int, int, int]:
    """(sign, exponent field, mantissa field) of a bit pattern."""
    f = get_format(fmt)
    m, e = f.mantissa_bits, f.exponent_bits
    return pattern >> (e + m), (pattern >> m) & (2 ** e - 1), pattern & (2 ** m - 1)


def bit_string(pattern: int, fmt: str | torch.dtype | Format, sep: str = "") -> str:
    """The pattern as '0' and '1' characters; sep goes between sign, exponent and mantissa."""
    f = get_format(fmt)
    s = format(pattern, f"0{f.bits}b")
    return sep.join([s[0], s[1:1 + f.exponent_bits], s[1 + f.exponent_bits:]]) if sep else s


@dataclass(frozen=True)
class Decomposed:
    """One number as a format stores it."""
    format: str
    input: float            # the number that was asked for
    pattern: int            # the stored bits as an unsigned integer
    bits: str               # the same bits as a string, sign first
    sign: int               # 0 or 1
    exponent_field: int     # the biased exponent E as stored
    exponent: int | None    # the power of two it means: E - bias (normal), 1 - bias (subnormal, zero); None for inf/NaN
    mantissa: int           # the stored fraction field M (without the implicit leading bit)
    kind: str               # "normal" | "subnormal" | "zero" | "inf" | "nan"
    value: float            # what is stored, exactly (every format here fits in a Python float)
    error: float            # value - input: the rounding error (inf on overflow, nan for NaN)

    @property
    def rel_error(self) -> float:
        """|value - input| / |input| (0 for an exact zero, nan when undefined)."""
        if self.input == 0:
            return 0.0 if self.value == 0 else math.inf
        return abs(self.error) / abs(self.input)

    @property
    def pretty_bits(self) -> str:
        """'0 01111 0000000000': sign, exponent and mantissa fields separated."""
        return bit_string(self.pattern, self.format, sep=" ")

    @property
    def significand(self) -> float | None:
        """1.M for normal numbers, 0.M for subnormals and zeros, None for inf/NaN."""
        f = get_format(self.format)
        if self.kind in ("inf", "nan"):
            return None
        return (0 if self.kind in ("subnormal", "zero") else 1) + self.mantissa / 2 ** f.mantissa_bits

    @property
    def formula(self) -> str:
        """How the bits make the value, e.g. '(-1)^0 × 2^-4 × 1.6015625 = 0.10009765625'."""
        if self.kind in ("inf", "nan"):
            what = "all exponent bits set" + (", mantissa 0" if self.kind == "inf" else ", mantissa not 0")
            if get_format(self.format).name == "fp8_e4m3fn":
                what = "e4m3fn: exponent and mantissa all ones"
            return f"{'-' if self.sign and self.kind == 'inf' else ''}{self.kind} ({what})"
        return f"(-1)^{self.sign} × 2^{self.exponent} × {self.significand!r} = {self.value!r}"


def _kind(f: Format, exponent_field: int, mantissa: int) -> str:
    top = 2 ** f.exponent_bits - 1
    if exponent_field == 0:
        return "zero" if mantissa == 0 else "subnormal"
    if exponent_field == top:
        if not f.has_inf:  # e4m3fn: only S.1111.111 is special
            return "nan" if mantissa == 2 ** f.mantissa_bits - 1 else "normal"
        return "inf" if mantissa == 0 else "nan"
    return "normal"


def decode(pattern: int, fmt: str | torch.dtype | Format) -> Decomposed:
    """What a bit pattern means (its input is its own value, so the error is 0)."""
    f = _storage(fmt)
    value = from_bits(pattern, f)
    return _decomposed(f, value, pattern, value)


def decompose(x: float, fmt: str | torch.dtype | Format) -> Decomposed:
    """Chapter 01: round x to the format with torch, and take the stored bits apart.

    >>> decompose(1.0, "fp16").pretty_bits
    '0 01111 0000000000'
    The rounding is torch's (round to nearest, ties to even; see round_to for float64 inputs).
    """
    f = _storage(fmt)
    x = float(x)
    pattern = to_bits(x, f)
    return _decomposed(f, x, pattern, from_bits(pattern, f))


def _decomposed(f: Format, x: float, pattern: int, value: float) -> Decomposed:
    sign, e_field, mantissa = split_bits(pattern, f)
    kind = _kind(f, e_field, mantissa)
    exponent = None if kind in ("inf", "nan") else (e_field - f.bias if kind == "normal" else 1 - f.bias)
    if math.isnan(value) or math.isnan(x):
        error = math.nan
    elif math.isinf(value) or math.isinf(x):
        error = math.inf if value != x else 0.0
    else:
        error = value - x
    return Decomposed(f.name, x, pattern, bit_string(pattern, f), sign, e_field, exponent, mantissa, kind, value, error)


# --------------------------------------------------------------------------- range and precision

def format_table(names: Iterable[str] = ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")) -> list[dict]:
    """Chapter 01: range and precision of each format, read from torch.finfo where torch has the dtype.

    torch.finfo has no smallest subnormal; it is smallest_normal * eps (2^(1-bias) * 2^-m),
    exact because both are powers of two. tf32 has no dtype, so its row comes from its layout.
    """
    rows = []
    for name in names:
        f = get_format(name)
        if f.dtype is not None:
            fi = torch.finfo(f.dtype)
            row = {"max": fi.max, "smallest_normal": fi.smallest_normal,
                   "smallest_subnormal": fi.smallest_normal * fi.eps, "eps": fi.eps, "source": "torch.finfo"}
        else:
            row = {"max": f.max, "smallest_normal": f.smallest_normal, "smallest_subnormal": None,
                   "eps": f.eps, "source": "layout only"}
        rows.append({"format": f.name, "bits": f.bits, "exponent_bits": f.exponent_bits,
                     "mantissa_bits": f.mantissa_bits, "bias": f.bias, **row,
                     "decimal_digits": f.decimal_digits, "has_inf": f.has_inf, "dtype": str(f.dtype)})
    return rows


def format_table_text(names: Iterable[str] = ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")) -> str:
    """Chapter 01: format_table as fixed-width text, lines under 100 characters (deterministic, so
    the notebook test compares it). "layout only": tf32 has no dtype, its row comes from its bits."""
    out = [f"{'format':<11}{'layout':>9}{'bias':>6}{'max':>12}{'min normal':>12}{'min subnormal':>15}"
           f"{'eps':>11}{'digits':>8}  source"]
    for r in format_table(names):
        sub = "n/a" if r["smallest_subnormal"] is None else f"{r['smallest_subnormal']:.3e}"
        out.append(f"{r['format']:<11}{'1+%d+%d' % (r['exponent_bits'], r['mantissa_bits']):>9}{r['bias']:>6}"
                   f"{r['max']:>12.4e}{r['smallest_normal']:>12.3e}{sub:>15}{r['eps']:>11.3e}"
                   f"{r['decimal_digits']:>8.2f}  {r['source']}")
    return "\n".join(out)


def spacing(x: float | Sequence[float] | torch.Tensor, fmt: str | torch.dtype | Format) -> torch.Tensor:
    """Chapter 01: the gap between |x| (rounded to the format) and the next representable number up
    (at the format's max, the gap below it). This is one 'unit in the last place' (ulp).

    Computed from the bits: for positive numbers the next pattern is the next value, which also
    works for fp8, where torch.nextafter is not implemented. NaN where x is out of the format's
    range (including e4m3fn, which saturates instead of overflowing) or is NaN.
    """
    f = _storage(fmt)
    x = torch.as_tensor(x, dtype=torch.float64).abs()
    t = x.to(f.dtype)
    p = _to_unsigned(t.view(f.int_dtype), f)
    v = t.to(torch.float64)
    up = _from_unsigned(p + 1, f).to(torch.float64)
    down = _from_unsigned(torch.clamp(p - 1, min=0), f).to(torch.float64)
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
    torch converts a float64 (a Python float) to the 16- and 8-bit formats through float32, so x is
    judged as the float32 it rounds to, as decompose() and an fp32 tensor holding x see it: 65519.99999
    is below fp16's midpoint 65520, but its float32 is 65520.0, a tie, and torch stores inf.
    """
    f = get_format(fmt)
    a = abs(float(x))
    if math.isnan(a) or math.isinf(a) or a == 0:
        return "nan" if math.isnan(a) else "inf" if a else "zero"
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


def fates(t: torch.Tensor, fmt: str | torch.dtype | Format) -> dict[str, float]:
    """Chapter 01: the fraction of the non-zero finite entries of t that overflow, underflow,
    become subnormal or stay normal when converted to the format (by torch)."""
    f = _storage(fmt)
    t = t[(t != 0) & torch.isfinite(t)]
    r = t.to(f.dtype).to(torch.float64)
    # e4m3fn has no inf: out of range is beyond the threshold (the tie 464 goes to 448), judged on the float32
    over = torch.isinf(r) if f.has_inf else t.abs().float().double() > overflow_threshold(f)  # torch converts
    zero = r == 0
    sub = (r.abs() < f.smallest_normal) & ~zero
    n = max(t.numel(), 1)
    return {"overflow": over.sum().item() / n, "underflow": zero.sum().item() / n,
            "subnormal": sub.sum().item() / n, "normal": (~(over | zero | sub)).sum().item() / n}


# --------------------------------------------------------------------------- accumulation

def running_sum(values: Sequence[float] | torch.Tensor, fmt: str | torch.dtype | Format,
                accumulator: str | torch.dtype | Format | None = None) -> torch.Tensor:
    """The partial sums of a naive left-to-right loop `s = s + v[i]`, as float64.

    The values are rounded to `fmt`; the running sum is kept (rounded after every addition) in
    `accumulator`, which defaults to `fmt` itself. One Python-level addition per value, so
    nothing (no vectorised kernel, no hidden fp32 accumulator) changes the order or precision.
    """
    f = _storage(fmt)
    acc = _storage(accumulator) if accumulator is not None else f
    v = torch.as_tensor(values, dtype=torch.float64).to(f.dtype).to(acc.dtype)
    s = torch.zeros((), dtype=acc.dtype)
    out = torch.empty(len(v), dtype=torch.float64)
    for i in range(len(v)):
        s = s + v[i]
        out[i] = s
    return out


def sum_experiment(increment: float = 1e-4, n: int = 10_000,
                   formats: Sequence[str] = ("fp32", "bf16", "fp16")) -> list[dict]:
    """Chapter 01: add `increment` n times in each format, three ways, against the exact n * increment.

    "naive"      running_sum in the format: the sum stops growing (stalls) once the increment is
                 at most half the spacing of the sum
    "fp32 acc"   the values in the format, the running sum in fp32 (what GEMMs and reductions do)
    "torch.sum"  torch's own reduction on a tensor of that dtype
    """
    rows = []
    exact = n * increment
    for name in formats:
        f = _storage(name)
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
            rows.append({"format": name, "how": way, "final": final, "rel_error": abs(final - exact) / exact,
                         "stalled_after_step": stalled_after, "stalled_value": stalled_value})
    return rows


def fp8_roundtrip(t: torch.Tensor, fmt: str | torch.dtype | Format = "fp8_e4m3fn",
                  scaled: bool = True) -> tuple[torch.Tensor, float]:
    """Chapter 01: t cast to an fp8 format and back, returning (t_hat, scale).

    With scaled=True the tensor is first multiplied by format.max / amax(t), so its largest
    entry lands on the format's max (the per-tensor scaling of fp8 training recipes), and the
    scale is divided out after the round trip.
    """
    f = _storage(fmt)
    amax = t.abs().max().item()
    scale = f.max / amax if scaled and amax > 0 else 1.0
    return (t * scale).to(f.dtype).to(t.dtype) / scale, scale
