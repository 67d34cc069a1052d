"""Microscaling by hand: MXFP8, MXFP4 and NVFP4 block scales on a CPU (chapter 11, section 11).

FP8's tensorwise and rowwise scales (fp8.py) give a whole tensor, or a whole row, one scale. The OCP
Microscaling (MX) formats give every block of 32 consecutive elements along the last axis a scale of
its own, stored as e8m0: an 8-bit power of two (exponent bits only, bias 127, no sign, no zero,
0xFF for NaN). MXFP8 stores the elements as e4m3 (largest 448 = 1.75 x 2^8); MXFP4 as e2m1, four
bits (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}) packed two to a byte, the first element in the low nibble.
A block's exponent comes from its largest magnitude, amax, by one of two rules:

    "floor" (the OCP spec's):              e = floor(log2 amax) - emax   (emax 8 for e4m3, 2 for e2m1)
    "rceil" (cuBLAS's; torchao's RCEIL):   e = ceil(log2(amax / max))

and the elements are x / 2^e rounded to the element format, saturated at its largest number. The
floor rule puts amax between 2^emax and 2^(emax+1), above the largest element whenever amax's
mantissa beats the format's (1.75 for e4m3, 1.5 for e2m1): those values saturate. The round-up rule
never saturates. NVFP4 (NVIDIA's) uses blocks of 16 with e4m3 block scales (steps finer than a power
of two) under one fp32 scale for the whole tensor.

`mx_quantize` follows torchao 0.18's `to_mx` step by step, so the two agree bit for bit where torchao
is installed (the `fp8` extra installs it; `torchao_to_mx` calls it); `mx_quantize_by_hand` computes
the same bytes element by element with Python's math module: the course's own reference.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import struct
from dataclasses import dataclass
from typing import Iterator

import torch

from course_lib.tables import table

__all__ = [
    "E2M1_VALUES",
    "FORMATS",
    "TORCHAO",
    "MXTensor",
    "NVFP4Tensor",
    "scale_exponents",
    "e2m1_codes",
    "e2m1_values",
    "pack_fp4",
    "unpack_fp4",
    "mx_quantize",
    "mx_dequantize",
    "mx_quantize_by_hand",
    "torchao_to_mx",
    "nvfp4_quantize",
    "nvfp4_dequantize",
    "six_decades",
    "rule_rows",
    "granularity_rows",
    "fp4_rows",
    "format_rows",
    "PUBLISHED_MX",
    "published_rows",
    "torchao_mxfp8_training",
]

E8M0_BIAS = 127
ELEMENTS = {"e4m3": (448.0, 8), "e2m1": (6.0, 2)}  # largest number, exponent of its largest power of two
FORMATS = {"mxfp8": ("e4m3", 32), "mxfp4": ("e2m1", 32)}  # element format, block size
RULES = ("floor", "rceil")
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of codes 0..7; bit 3 is the sign
TORCHAO = importlib.util.find_spec("torchao") is not None


@dataclass
class MXTensor:
    """Chapter 11: an MX tensor: `scales`, biased e8m0 exponents (uint8, one per block: shape (..., K / 32));
    `data`, uint8: the e4m3 bit patterns (..., K) of MXFP8 or the packed e2m1 codes (..., K / 2) of MXFP4."""

    fmt: str
    scales: torch.Tensor
    data: torch.Tensor


@dataclass
class NVFP4Tensor:
    """Chapter 11: an NVFP4 tensor: one fp32 `tensor_scale`, e4m3 block scales (their bits as uint8, one per
    16 elements) and the packed e2m1 codes."""

    tensor_scale: float
    scales: torch.Tensor
    data: torch.Tensor


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """(..., K) -> (..., K / size, size) in fp32: blocks of `size` consecutive elements along the last axis."""
    if x.shape[-1] % size:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be a multiple of the block size {size}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // size, size)


def scale_exponents(amax: torch.Tensor, elem: str = "e4m3", rule: str = "rceil") -> torch.Tensor:
    """Chapter 11: each block's scale exponent e (int32, clamped to e8m0's -127..127) from its amax:
    "floor", floor(log2 amax) - emax, read exactly from amax's exponent bits (torch.frexp); "rceil",
    ceil(log2(amax / max)) with amax / max and log2 in fp32, as torchao 0.18 computes it. An all-zero
    block gets -127."""
    top, emax = ELEMENTS[elem]
    amax = amax.float()
    if rule == "floor":
        e = torch.where(amax > 0, torch.frexp(amax).exponent - 1 - emax, -E8M0_BIAS)
    elif rule == "rceil":
        e = torch.ceil(torch.log2(amax / top))  # -inf for an all-zero block, clamped below
    else:
        raise ValueError(f"unknown rule {rule!r}; choose one of {RULES}")
    return e.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Chapter 11: the 4-bit e2m1 codes (uint8, sign in bit 3) of fp32 values: each magnitude rounded to
    the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6 (ties to the even code) and saturated at 6, as torchao's
    f32_to_f4_unpacked does. The spacing is 0.5 below 2, 1 below 4 and 2 above."""
    mag = v.float().abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    mag = (torch.round(mag / step) * step).clamp(max=6.0)  # torch.round: ties to even
    code = torch.bucketize(mag, torch.tensor(E2M1_VALUES))
    return (code + 8 * torch.signbit(v).long()).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Chapter 11: the fp32 values of 4-bit e2m1 codes."""
    mag = torch.tensor(E2M1_VALUES)[(codes & 7).long()]
    return torch.where(codes >= 8, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Chapter 11: two 4-bit codes a byte along the last axis, the first in the low nibble (torchao's
    and PyTorch's order for torch.float4_e2m1fn_x2): (..., K) -> (..., K / 2) uint8."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Chapter 11: pack_fp4 undone: (..., K / 2) bytes -> (..., K) codes."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def mx_quantize(x: torch.Tensor, fmt: str = "mxfp8", rule: str = "rceil") -> MXTensor:
    """Chapter 11: `x` in MXFP8 or MXFP4: blocks of 32 along the last axis, each block's exponent e by
    `rule` (scale_exponents), its elements x / 2^e saturated at the element format's largest number
    and rounded to it (e4m3 by PyTorch's cast, e2m1 by e2m1_codes, then packed)."""
    elem, size = FORMATS[fmt]
    top = ELEMENTS[elem][0]
    xb = _blocks(x, size)
    e = scale_exponents(xb.abs().amax(dim=-1), elem, rule)
    scaled = (xb / torch.exp2(e.float()).unsqueeze(-1)).clamp(-top, top).reshape(x.shape)
    if elem == "e4m3":
        data = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        data = pack_fp4(e2m1_codes(scaled))
    return MXTensor(fmt, (e + E8M0_BIAS).to(torch.uint8), data)


def mx_dequantize(q: MXTensor) -> torch.Tensor:
    """Chapter 11: an MXTensor back in fp32: each element times its block's 2^e."""
    elem, size = FORMATS[q.fmt]
    values = q.data.view(torch.float8_e4m3fn).float() if elem == "e4m3" else e2m1_values(unpack_fp4(q.data))
    scale = torch.exp2(q.scales.float() - E8M0_BIAS).unsqueeze(-1)
    return (_blocks(values, size) * scale).reshape(values.shape)


def _fp32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def _on_grid(v: float, top: float, mbits: int, emin: int) -> float:
    """v rounded to the nearest number with `mbits` mantissa bits (ties to even), normal from 2^emin,
    saturated at `top`."""
    exp = max(math.frexp(abs(v))[1] - 1, emin) if v else emin
    step = 2.0 ** (exp - mbits)
    return math.copysign(min(round(abs(v) / step) * step, top), v)


def _code(q: float, elem: str) -> int:
    """The bits of an element value already on its format's grid."""
    sign = int(math.copysign(1.0, q) < 0)
    if elem == "e2m1":
        return 8 * sign + E2M1_VALUES.index(abs(q))
    exp = math.frexp(abs(q))[1] - 1 if q else -7
    biased = exp + 7 if exp >= -6 else 0  # e4m3: bias 7; below 2^-6 the subnormals, steps of 2^-9
    mant = round(abs(q) / 2.0**-9) if biased == 0 else round((abs(q) / 2.0**exp - 1) * 8)
    return 128 * sign + 8 * biased + mant


def mx_quantize_by_hand(x: torch.Tensor, fmt: str = "mxfp8", rule: str = "rceil") -> MXTensor:
    """Chapter 11: mx_quantize element by element with Python's math module, the course's own reference:
    exponents exact from math.frexp (the round-up rule's log2 is exact here, torch's is fp32: the two
    could differ on a block whose amax / max lies within a rounding of a power of two), elements
    rounded on the format's grid by `round` (ties to even). For small tensors: it loops in Python."""
    elem, size = FORMATS[fmt]
    top, emax = ELEMENTS[elem]
    mbits, emin = (3, -6) if elem == "e4m3" else (1, 0)
    rows = x.float().reshape(-1, x.shape[-1]).tolist()
    scales, codes = [], []
    for row in rows:
        for start in range(0, len(row), size):
            block = row[start : start + size]
            amax = max(abs(v) for v in block)
            if rule == "floor":
                e = math.frexp(amax)[1] - 1 - emax if amax else -E8M0_BIAS
            else:
                q = _fp32(amax / top)
                mant, exp = math.frexp(q)
                e = (exp - 1 if mant == 0.5 else exp) if q else -E8M0_BIAS
            e = max(-E8M0_BIAS, min(E8M0_BIAS, e))
            scales.append(e + E8M0_BIAS)
            codes += [_code(_on_grid(v / 2.0**e, top, mbits, emin), elem) for v in block]
    data = torch.tensor(codes, dtype=torch.uint8).reshape(x.shape)
    shape = (*x.shape[:-1], x.shape[-1] // size)
    return MXTensor(
        fmt, torch.tensor(scales, dtype=torch.uint8).reshape(shape), data if elem == "e4m3" else pack_fp4(data)
    )


@contextlib.contextmanager
def _quiet_torch_log() -> Iterator[None]:
    """torchao's import logs deprecation notices through torch's logger (Enum constants registered with
    pytree): quiet while it imports."""
    log = logging.getLogger("torch.utils._pytree")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def torchao_to_mx(x: torch.Tensor, fmt: str = "mxfp8", rule: str = "rceil") -> MXTensor | None:
    """Chapter 11: torchao's own `to_mx` (torchao.prototype.mx_formats) on `x`, as an MXTensor of bytes;
    None where torchao is not installed (`pip install -e ".[fp8]"` installs it)."""
    if not TORCHAO:
        return None
    with _quiet_torch_log():
        from torchao.prototype.mx_formats import constants
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx

    fp4 = getattr(constants, "DTYPE_FP4", torch.float4_e2m1fn_x2)  # a string before torchao 0.18
    elem = torch.float8_e4m3fn if fmt == "mxfp8" else fp4
    scales, data = to_mx(x.float().contiguous(), elem, FORMATS[fmt][1], ScaleCalculationMode[rule.upper()])
    return MXTensor(fmt, scales.view(torch.uint8), data.view(torch.uint8))


def nvfp4_quantize(x: torch.Tensor) -> NVFP4Tensor:
    """Chapter 11: `x` in NVFP4, as torchao's nvfp4_quantize computes it with a per-tensor scale: the
    tensor scale amax / (448 x 6), each block of 16's scale (block amax / 6) / tensor scale rounded to
    e4m3 (clamped to 2^-6..448), elements x / (tensor scale x block scale) saturated at 6, in e2m1."""
    xb = _blocks(x, 16)
    tensor_scale = x.float().abs().amax() / (448.0 * 6.0)
    block = xb.abs().amax(dim=-1) / 6.0 / tensor_scale
    s8 = block.clamp(min=torch.finfo(torch.float8_e4m3fn).tiny, max=448.0).to(torch.float8_e4m3fn)
    scaled = (xb / (tensor_scale * s8.float()).unsqueeze(-1)).clamp(-6.0, 6.0).reshape(x.shape)
    return NVFP4Tensor(tensor_scale.item(), s8.view(torch.uint8), pack_fp4(e2m1_codes(scaled)))


def nvfp4_dequantize(q: NVFP4Tensor) -> torch.Tensor:
    """Chapter 11: an NVFP4Tensor back in fp32."""
    values = e2m1_values(unpack_fp4(q.data))
    scale = (q.tensor_scale * q.scales.view(torch.float8_e4m3fn).float()).unsqueeze(-1)
    return (_blocks(values, 16) * scale).reshape(values.shape)


def six_decades(rows: int = 256, cols: int = 512, seed: int = 0) -> torch.Tensor:
    """Chapter 11: a test tensor whose columns span six decades: N(0, 1) times logspace(-3, 3) over the
    columns, so each block of 32 spans under half a decade and each row all six."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, cols)


def _error(q: torch.Tensor, x: torch.Tensor) -> dict:
    """How far q is from x: relative Frobenius error, the median element's relative error, the share
    of non-zero values stored as zero."""
    nonzero = x != 0
    return {
        "error": ((q - x).norm() / x.norm()).item(),
        "median": ((q - x).abs()[nonzero] / x.abs()[nonzero]).median().item(),
        "flushed": (nonzero & (q == 0)).float().mean().item(),
    }


def rule_rows(x: torch.Tensor) -> list[dict]:
    """Chapter 11: MXFP8 and MXFP4 under each rule on `x`: the share of elements that saturate (x / 2^e
    beyond the element format's largest number) and the errors (_error)."""
    rows = []
    for fmt, (elem, size) in FORMATS.items():
        for rule in RULES:
            xb = _blocks(x, size)
            e = scale_exponents(xb.abs().amax(dim=-1), elem, rule)
            beyond = (xb.abs() / torch.exp2(e.float()).unsqueeze(-1) > ELEMENTS[elem][0]).float().mean().item()
            rows.append(
                {
                    "format": fmt,
                    "rule": rule,
                    "saturated": beyond,
                    **_error(mx_dequantize(mx_quantize(x, fmt, rule)), x),
                }
            )
    return rows


def _e4m3_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x through e4m3 with one power-of-two scale (the round-up rule) per `group` consecutive elements."""
    xb = x.float().reshape(-1, group)
    scale = torch.exp2(scale_exponents(xb.abs().amax(dim=-1), "e4m3", "rceil").float()).unsqueeze(-1)
    return ((xb / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape)


def granularity_rows(x: torch.Tensor, w: torch.Tensor | None = None) -> list[dict]:
    """Chapter 11: `x` (2-D) through e4m3 with one power-of-two scale (the round-up rule for each) per
    tensor, per row and per block of 32 (MXFP8): the errors (_error) and the share of elements equal to
    the MX ones; with `w` (N x K), the relative error of x @ w.T with both operands quantized alike."""
    groups = {"tensorwise": lambda t: t.numel(), "rowwise": lambda t: t.shape[-1], "MXFP8, 1 x 32": lambda t: 32}
    mx = _e4m3_groups(x, 32)
    rows = []
    for name, group in groups.items():
        q = _e4m3_groups(x, group(x))
        row = {
            "scaling": name,
            "scales": x.numel() // group(x),
            **_error(q, x),
            "same": (q == mx).float().mean().item(),
        }
        if w is not None:
            exact = x @ w.T
            row["matmul"] = ((q @ _e4m3_groups(w, group(w)).T - exact).norm() / exact.norm()).item()
        rows.append(row)
    return rows


def fp4_rows(x: torch.Tensor) -> list[dict]:
    """Chapter 11: 4-bit elements three ways on `x`: MXFP4 under each rule (blocks of 32, e8m0 scales) and
    NVFP4 (blocks of 16, e4m3 scales, one fp32 tensor scale): the errors (_error) and bits per element."""
    rows = [
        {"format": f"MXFP4, {rule}", "bits": 4 + 8 / 32, **_error(mx_dequantize(mx_quantize(x, "mxfp4", rule)), x)}
        for rule in RULES
    ]
    nv = nvfp4_dequantize(nvfp4_quantize(x))
    return rows + [{"format": "NVFP4", "bits": 4 + 8 / 16 + 32 / x.numel(), **_error(nv, x)}]


_COLUMNS = {  # key: (header, spec); a share is printed in percent
    "saturated": ("saturated %", "%"),
    "error": ("error %", "%"),
    "median": ("median error %", "%"),
    "flushed": ("flushed to 0 %", "%"),
    "same": ("same as MX %", "%"),
    "matmul": ("x @ w.T error %", "%"),
    "bits": ("bits per element", ".3f"),
    "scales": ("scales", ","),
}


def format_rows(rows: list[dict]) -> str:
    """Chapter 11: rule_rows, granularity_rows or fp4_rows as a table, shares in percent."""
    columns = []
    for key in rows[0]:
        header, spec = _COLUMNS.get(key, (key, ""))
        columns.append((header, lambda r, k=key: 100 * r[k], ".2f") if spec == "%" else (header, key, spec))
    return table(rows, columns)


# Speed-ups over bf16 published for MX and FP8 training (recipe, model, GPUs, speed-up, source), as their
# authors recorded them: torchao's README gives median tokens/s (the ratios to bf16's 8,307.5 here), the
# PyTorch blog and pytorch/ao#3163 give the speed-up.
PUBLISHED_MX = (
    ("float8 tensorwise", "Llama3-8B", "8 B200", 10417.0 / 8307.5, "torchao mx_formats README @09f1325"),
    ("MXFP8, floor", "Llama3-8B", "8 B200", 9969.0 / 8307.5, "torchao mx_formats README @09f1325"),
    ("MXFP8, RCEIL", "Llama3-8B", "8 B200", 9642.0 / 8307.5, "torchao mx_formats README @09f1325"),
    ("float8 rowwise", "Llama3-8B", "8 B200", 8640.5 / 8307.5, "torchao mx_formats README @09f1325"),
    ("MXFP8", "Llama3-70B", "1,856 B200", 1.28, "PyTorch blog, Crusoe (1.22-1.28x)"),
    ("MXFP8, MoE", "Llama4-Scout", "256 GB200", 1.302, "pytorch/ao#3163"),
)


def published_rows(fp8gpt: list[dict]) -> str:
    """Chapter 11: PUBLISHED_MX as a table, with the course's own recorded FP8 runs below it (fp8gpt_<gpu>.json,
    GPT-2 small with torchao's float8 against bf16 on one GPU: the speed-up computed from its step times)."""
    rows = [dict(zip(("recipe", "model", "gpus", "speedup", "source"), r)) for r in PUBLISHED_MX]
    for ref in fp8gpt:
        runs = {r["recipe"]: r["ms_per_step"] for r in ref["rows"] if "ms_per_step" in r}
        for recipe, ms in runs.items():
            if recipe != "bf16" and "bf16" in runs:
                device = ref["provenance"]["device"].replace("NVIDIA ", "").split()[0]  # "H100 80GB HBM3" -> H100
                rows.append(
                    {
                        "recipe": f"float8 {recipe}",
                        "model": "GPT-2 small (course)",
                        "gpus": f"1 {device}",
                        "speedup": runs["bf16"] / ms,
                        "source": ref["file"],
                    }
                )
    columns = [
        ("recipe", "recipe", "<"),
        ("model", "model", "<"),
        ("GPUs", "gpus", "<"),
        ("speed-up", "speedup", ".2f"),
        ("source", "source", "<"),
    ]
    return table(rows, columns)


def torchao_mxfp8_training(seed: int = 0) -> dict | None:
    """Chapter 11: a bias-free Linear(256, 512)'s forward and backward through torchao's emulated MXFP8
    training recipe (MXFP8_EMULATED_RCEIL: every matmul's operands quantized to MXFP8, dequantized and
    multiplied in high precision) and under bf16 autocast, each against fp32: relative errors of the
    output ("output", "bf16_output") and of the weight gradient ("weight_grad", "bf16_weight_grad"),
    MXFP8's output against bf16's ("vs_bf16"), and its distance from mx_quantize's operands multiplied
    here ("by_hand"); None without torchao. (torchao 0.18's wrapper for this recipe leaves a bias out.)"""
    if not TORCHAO:
        return None
    import copy

    with _quiet_torch_log():
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization import quantize_

    torch.manual_seed(seed)
    exact = torch.nn.Linear(256, 512, bias=False)
    mx, half = copy.deepcopy(exact), copy.deepcopy(exact)
    quantize_(mx, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL))
    x, grad = torch.randn(128, 256), torch.randn(128, 512)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y2 = half(x)
    y0, y1 = exact(x), mx(x)
    for y in (y0, y1, y2):
        y.backward(grad)
    by_hand = mx_dequantize(mx_quantize(x)) @ mx_dequantize(mx_quantize(exact.weight.detach())).T

    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm()).item()

    return {
        "output": gap(y1, y0),
        "bf16_output": gap(y2, y0),
        "vs_bf16": gap(y1, y2),
        "by_hand": gap(y1, by_hand),
        "weight_grad": gap(mx.weight.grad, exact.weight.grad),
        "bf16_weight_grad": gap(half.weight.grad, exact.weight.grad),
    }
