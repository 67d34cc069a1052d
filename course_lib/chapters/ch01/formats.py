"""Floating-point formats bit by bit: fp32, fp16, bf16, fp8 (e4m3fn, e5m2), and tf32 described.

Chapter 01 introduces everything here. torch itself is the oracle: a number is rounded by
`torch.tensor(x).to(dtype)` and its bits are read back with `.view(int dtype)`, so what you
see is exactly what PyTorch stores, not what a textbook says it should.

    decompose(0.1, "bf16")          # sign / exponent / mantissa, kind, stored value, error

What a format's range and precision do to numbers (limits_table, spacing, fate, ...) is in format_limits.

A value of a format with e exponent bits and m mantissa bits is
    normal     (-1)^s * 2^(E - bias) * 1.M      for 0 < E < all ones   (bias = 2^(e-1) - 1)
    subnormal  (-1)^s * 2^(1 - bias) * 0.M      for E == 0 (M == 0 is a signed zero)
    inf / NaN  E all ones (e4m3fn has no inf: only S.1111.111 is NaN, the rest are numbers)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["FORMATS", "STORAGE_FORMATS", "get_format", "all_values", "decompose"]
# storage_format, to_unsigned and from_unsigned are public for format_limits; no chapter calls them (not in __all__)


@dataclass(frozen=True)
class Format:
    """The bit layout of one floating-point format."""

    name: str
    dtype: torch.dtype | None  # None for tf32: a matmul compute mode, never a tensor's dtype
    exponent_bits: int
    mantissa_bits: int
    has_inf: bool = True  # fp8 e4m3fn ("fn" = finite, NaN only) spends inf's codes on numbers
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
        e_max = 2**self.exponent_bits - 2 - self.bias if self.has_inf else 2**self.exponent_bits - 1 - self.bias
        top_mantissa = 2**self.mantissa_bits - (1 if self.has_inf else 2)  # e4m3fn: all ones is NaN
        return math.ldexp(1 + top_mantissa / 2**self.mantissa_bits, e_max)

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
    "tf32": Format(
        "tf32",
        None,
        8,
        10,
        note="NVIDIA TensorFloat-32: how Ampere+ Tensor Cores read fp32 "
        "matmul inputs when allowed; 19 bits used, 32 stored",
    ),
    "fp16": Format("fp16", torch.float16, 5, 10, note="IEEE binary16: torch.float16 / half"),
    "bf16": Format("bf16", torch.bfloat16, 8, 7, note="brain float: fp32's exponent, 7 mantissa bits"),
    "fp8_e5m2": Format(
        "fp8_e5m2", torch.float8_e5m2, 5, 2, note="OCP fp8, IEEE-like: inf and NaN; range for gradients"
    ),
    "fp8_e4m3fn": Format(
        "fp8_e4m3fn",
        torch.float8_e4m3fn,
        4,
        3,
        has_inf=False,
        note="OCP fp8, finite: no inf, max 448; precision for weights/activations",
    ),
}
STORAGE_FORMATS = ("fp32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")  # the ones a tensor can have

_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "e4m3": "fp8_e4m3fn",
    "e4m3fn": "fp8_e4m3fn",
    "fp8_e4m3": "fp8_e4m3fn",
    "float8_e4m3fn": "fp8_e4m3fn",
    "e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
    "tensorfloat32": "tf32",
}


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


def storage_format(fmt: str | torch.dtype | Format) -> Format:
    """get_format for a format a tensor can have (every one but tf32, which raises and says why).

    A helper of this module and of format_limits, which convert numbers with torch: no chapter calls it.
    """
    f = get_format(fmt)
    if f.dtype is None:
        raise ValueError(
            "tf32 is not a storage dtype: no tensor is ever tf32. Ampere+ GPUs read fp32 matmul "
            "inputs with 10 mantissa bits when torch.backends.cuda.matmul.fp32_precision = 'tf32' "
            "(older spelling: torch.set_float32_matmul_precision('high')); the result is fp32."
        )
    return f


# --------------------------------------------------------------------------- bits <-> values


def to_unsigned(p: torch.Tensor, f: Format) -> torch.Tensor:
    """Bit patterns read with view() (int16/int32 are signed) as non-negative int64.

    With from_unsigned, the bits <-> values layer under to_bits, from_bits, all_values and
    format_limits.spacing (the next pattern up is the next number up); no chapter calls it.
    """
    return p.to(torch.int64) & (2**f.bits - 1)


def from_unsigned(p: torch.Tensor, f: Format) -> torch.Tensor:
    """Non-negative int64 patterns -> tensor of the format (values, not conversions): to_unsigned's inverse."""
    p = p.to(torch.int64) % 2**f.bits
    if f.int_dtype != torch.uint8:  # signed view: patterns with the top bit set are negative ints
        p = torch.where(p >= 2 ** (f.bits - 1), p - 2**f.bits, p)
    return p.to(f.int_dtype).view(f.dtype)


def to_bits(x: float, fmt: str | torch.dtype | Format) -> int:
    """The bit pattern (as an unsigned int) torch stores for x in the format."""
    f = storage_format(fmt)
    stored = torch.tensor([float(x)], dtype=torch.float64).to(f.dtype)
    return int(to_unsigned(stored.view(f.int_dtype), f)[0])


def from_bits(pattern: int, fmt: str | torch.dtype | Format) -> float:
    """The value a bit pattern means in the format (decoded by torch)."""
    f = storage_format(fmt)
    if not 0 <= pattern < 2**f.bits:
        raise ValueError(f"{f.name} patterns are {f.bits}-bit: 0 <= pattern < {2**f.bits}, got {pattern}")
    return float(from_unsigned(torch.tensor([pattern]), f).to(torch.float64)[0])


def all_values(fmt: str | torch.dtype | Format) -> torch.Tensor:
    """Chapter 01: the value of every bit pattern 0 .. 2^bits - 1 of an 8- or 16-bit format (float64)."""
    f = storage_format(fmt)
    if f.bits > 16:
        raise ValueError(f"{f.name} has 2^{f.bits} patterns: too many to list")
    return from_unsigned(torch.arange(2**f.bits), f).to(torch.float64)


def split_bits(pattern: int, fmt: str | torch.dtype | Format) -> tuple[int, int, int]:
    """(sign, exponent field, mantissa field) of a bit pattern."""
    f = get_format(fmt)
    m, e = f.mantissa_bits, f.exponent_bits
    return pattern >> (e + m), (pattern >> m) & (2**e - 1), pattern & (2**m - 1)


def bit_string(pattern: int, fmt: str | torch.dtype | Format, sep: str = "") -> str:
    """The pattern as '0' and '1' characters; sep goes between sign, exponent and mantissa."""
    f = get_format(fmt)
    s = format(pattern, f"0{f.bits}b")
    return sep.join([s[0], s[1 : 1 + f.exponent_bits], s[1 + f.exponent_bits :]]) if sep else s


@dataclass(frozen=True)
class Decomposed:
    """One number as a format stores it."""

    format: str
    input: float  # the number that was asked for
    pattern: int  # the stored bits as an unsigned integer
    bits: str  # the same bits as a string, sign first
    sign: int  # 0 or 1
    exponent_field: int  # the biased exponent E as stored
    exponent: int | None  # the power of two it means: E - bias (normal), 1 - bias (subnormal, zero); None for inf/NaN
    mantissa: int  # the stored fraction field M (without the implicit leading bit)
    kind: str  # "normal" | "subnormal" | "zero" | "inf" | "nan"
    value: float  # what is stored, exactly (every format here fits in a Python float)
    error: float  # value - input: the rounding error (inf on overflow, nan for NaN)

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
        return (0 if self.kind in ("subnormal", "zero") else 1) + self.mantissa / 2**f.mantissa_bits

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
    top = 2**f.exponent_bits - 1
    if exponent_field == 0:
        return "zero" if mantissa == 0 else "subnormal"
    if exponent_field == top:
        if not f.has_inf:  # e4m3fn: only S.1111.111 is special
            return "nan" if mantissa == 2**f.mantissa_bits - 1 else "normal"
        return "inf" if mantissa == 0 else "nan"
    return "normal"


def decode(pattern: int, fmt: str | torch.dtype | Format) -> Decomposed:
    """What a bit pattern means (its input is its own value, so the error is 0)."""
    f = storage_format(fmt)
    value = from_bits(pattern, f)
    return _decomposed(f, value, pattern, value)


def decompose(x: float, fmt: str | torch.dtype | Format) -> Decomposed:
    """Chapter 01: round x to the format with torch, and take the stored bits apart.

    >>> decompose(1.0, "fp16").pretty_bits
    '0 01111 0000000000'
    The rounding is torch's (round to nearest, ties to even). torch converts a float64 to the 16- and
    8-bit formats through float32, so a float64 within 2^-24 relative of a tie can be rounded twice.
    """
    f = storage_format(fmt)
    x = float(x)
    pattern = to_bits(x, f)
    return _decomposed(f, x, pattern, from_bits(pattern, f))


def _decomposed(f: Format, x: float, pattern: int, value: float) -> Decomposed:
    sign, e_field, mantissa = split_bits(pattern, f)
    kind = _kind(f, e_field, mantissa)
    exponent = None  # inf and NaN have none
    if kind == "normal":
        exponent = e_field - f.bias
    elif kind in ("zero", "subnormal"):
        exponent = 1 - f.bias  # subnormals (and zero) use the smallest normal exponent
    if math.isnan(value) or math.isnan(x):
        error = math.nan
    elif math.isinf(value) or math.isinf(x):
        error = math.inf if value != x else 0.0
    else:
        error = value - x
    return Decomposed(f.name, x, pattern, bit_string(pattern, f), sign, e_field, exponent, mantissa, kind, value, error)
