"""What the hardware can do, and which precision to train in on it.

Chapter 00 introduces everything here. The one rule worth remembering: decide bf16 by what
the hardware computes natively: a CUDA compute capability >= 8.0 (Ampere and newer), or a
CPU with AMX-BF16 / AVX512-BF16 instructions. Never by `torch.cuda.is_bf16_supported()`
with its default `including_emulation=True`, which says True on a Colab T4 where bf16 is
emulated and slower than fp32.

    python -m course_lib.device      # prints the hardware report
"""

from __future__ import annotations

import contextlib
import os
import platform
import textwrap
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.torch_version import TorchVersion

__all__ = [
    "AMP_DTYPES",
    "PrecisionError",
    "Recommendation",
    "pick_device",
    "tensor_core_generation",
    "cpu_bf16_flags",
    "has_native_bf16",
    "has_tf32",
    "tf32",
    "recommend_precision",
    "mixed_precision_for",
    "hardware_report",
    "gpu_cell",
    "torch_at_least",
]

# The one place a precision becomes an autocast dtype (None: autocast off). Chapter 00 on.
AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

# Tensor Core generations by compute capability (major, minor). Before Volta there are none.
_TENSOR_CORES = [
    ((10, 0), "Blackwell (5th gen: fp16/bf16/tf32/fp8/fp4)"),
    ((9, 0), "Hopper (4th gen: fp16/bf16/tf32/fp8)"),
    ((8, 9), "Ada (4th gen: fp16/bf16/tf32/fp8)"),
    ((8, 0), "Ampere (3rd gen: fp16/bf16/tf32)"),
    ((7, 5), "Turing (2nd gen: fp16 only)"),
    ((7, 0), "Volta (1st gen: fp16 only)"),
]
# The CPU instruction sets that compute in bf16 natively. avx512_fp16 and amx_fp16 are fp16
# instructions: they say nothing about bf16.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


class PrecisionError(ValueError):
    """Chapter 00: a precision was requested that this hardware cannot run natively."""


@dataclass(frozen=True)
class Recommendation:
    """Chapter 00: the precision policy for one device, with the reason in words."""

    precision: str  # "bf16" | "fp16" | "fp32"
    use_grad_scaler: bool  # True exactly for fp16: only fp16 needs loss scaling
    reason: str
    warning: str = ""

    def __str__(self) -> str:
        s = f"{self.precision}{' + GradScaler' if self.use_grad_scaler else ''}: {self.reason}"
        return s + (f" (warning: {self.warning})" if self.warning else "")


def pick_device(prefer: str = "auto") -> torch.device:
    """Chapter 00: 'auto' picks cuda, then mps, then cpu; anything else is passed to torch.device."""
    if prefer != "auto":
        return torch.device(prefer)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def tensor_core_generation(capability: tuple[int, int] | None) -> str | None:
    """Chapter 00: the Tensor Core generation of a CUDA compute capability, None if it has none."""
    if capability is None:
        return None
    return next((name for cc, name in _TENSOR_CORES if tuple(capability) >= cc), None)


def cuda_capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """Chapters 01, 02: the CPU's native bf16 instruction sets (AMX-BF16, AVX512-BF16).

    Read from /proc/cpuinfo (or the `cpuinfo` text given, for tests). Off Linux we cannot
    tell, and say so by returning [] rather than guessing.
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return []
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return sorted(set(flags) & set(CPU_BF16_FLAGS))


def has_native_bf16(device: torch.device | str | None = None, capability: tuple[int, int] | None = None) -> bool:
    """Chapter 00: does this device do bf16 math in hardware (not emulated)?

    CUDA: compute capability >= 8.0. We deliberately do not trust
    torch.cuda.is_bf16_supported(), whose default includes emulation (True on a T4).
    CPU: the AMX-BF16 or AVX512-BF16 instruction sets; without them CPU bf16 autocast still
    works but is converted in software and usually slower than fp32.
    """
    if capability is not None:
        return tuple(capability) >= (8, 0)
    dev = torch.device(device) if device is not None else pick_device()
    if dev.type == "cuda":
        if torch.version.hip:  # ROCm: capability numbers mean something else; ask torch without emulation
            return torch.cuda.is_bf16_supported(including_emulation=False)
        return cuda_capability(dev) >= (8, 0)  # type: ignore[operator]
    if dev.type == "cpu":
        return bool(cpu_bf16_flags())
    return dev.type == "mps"  # Apple GPUs on macOS 14+ support bf16 in MPS


def has_tf32(device: torch.device) -> bool:
    """Chapter 00: does `device` have TF32 (NVIDIA Ampere and newer)? Elsewhere a "TF32" row would repeat
    strict fp32."""
    return device.type == "cuda" and (cuda_capability(device) or (0, 0)) >= (8, 0)


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """Chapters 00, 01: allow (or forbid) TF32 in fp32 matmuls and cuDNN convolutions, then restore.
    PyTorch's defaults differ: fp32 matmuls do NOT use TF32 ('highest'), cuDNN convolutions DO, so
    "strict FP32" switches both off."""
    old = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old[0])
        torch.backends.cudnn.allow_tf32 = old[1]


def recommend_precision(
    device: torch.device | str | None = None, capability: tuple[int, int] | None = None
) -> Recommendation:
    """Chapter 00: the course's precision policy, the one rule behind precision="auto".

    - CUDA, capability >= 8.0 (A100, L4, H100, RTX 30xx/40xx): bf16 autocast, no GradScaler.
    - CUDA, 7.0 <= capability < 8.0 (V100, T4, RTX 20xx): fp16 autocast + GradScaler.
    - CUDA older than Volta: fp32 (no Tensor Cores: mixed precision gains little there).
    - CPU: bf16 only with AMX-BF16 / AVX512-BF16, otherwise fp32 (emulated bf16 is slower).
    Pass `capability` to ask about a GPU you do not have (exercise 00 does).
    """
    if capability is None:
        dev = torch.device(device) if device is not None else pick_device()
        if dev.type == "cpu":
            flags = cpu_bf16_flags()
            if flags:
                return Recommendation(
                    precision="bf16",
                    use_grad_scaler=False,
                    reason=f"this CPU computes bf16 natively ({', '.join(flags)}); bf16 keeps fp32's range, "
                    "so no scaler",
                    warning="small models can still be faster in fp32 on a CPU: measure",
                )
            return Recommendation(
                precision="fp32",
                use_grad_scaler=False,
                reason="this CPU has no AMX-BF16/AVX512-BF16: bf16 autocast would be "
                "converted in software and slower than fp32",
            )
        if dev.type == "mps":
            return Recommendation(
                precision="fp16",
                use_grad_scaler=True,
                reason="Apple GPUs run fp16 fast; fp16 needs loss scaling",
                warning="the course is tested on CUDA and CPU, not on MPS",
            )
        capability = cuda_capability(dev)
    cc = tuple(capability)  # type: ignore[arg-type]
    if cc >= (8, 0):
        return Recommendation(
            precision="bf16",
            use_grad_scaler=False,
            reason=f"sm_{cc[0]}{cc[1]} has native bf16 Tensor Cores; bf16 has fp32's range",
        )
    if cc >= (7, 0):
        return Recommendation(
            precision="fp16",
            use_grad_scaler=True,
            reason=f"sm_{cc[0]}{cc[1]} has fp16 Tensor Cores but no native bf16 "
            "(bf16 would be emulated and slow); fp16 needs loss scaling",
        )
    return Recommendation(
        precision="fp32",
        use_grad_scaler=False,
        reason=f"sm_{cc[0]}{cc[1]} has no Tensor Cores: fp16 gains little there "
        "(P100 runs it at 2x fp32, other Pascal cards at 1/64)",
    )


def mixed_precision_for(device: torch.device | str | None = None) -> str:
    """Chapter 00: the 16-bit type to try on this device: the recommended one, or, where the
    policy says fp32 (a CPU without bf16 instructions, a GPU before Volta), bf16 on a CPU and
    fp16 on a GPU, so that you see what mixed precision would cost there."""
    dev = pick_device() if device is None else torch.device(device)
    amp = recommend_precision(dev).precision
    if amp == "fp32":
        amp = "bf16" if dev.type == "cpu" else "fp16"
    return amp


def check_precision(precision: str, device: torch.device | str) -> None:
    """Raise a PrecisionError that says what to do if `precision` cannot run natively."""
    if precision not in ("fp32", "bf16", "fp16"):
        raise PrecisionError(f"unknown precision {precision!r}: use 'fp32', 'bf16', 'fp16' or 'auto'")
    dev = torch.device(device)
    if precision == "bf16" and dev.type == "cuda" and not has_native_bf16(dev):
        cc = cuda_capability(dev)
        raise PrecisionError(
            f"bf16 was requested on {torch.cuda.get_device_name(dev)} (sm_{cc[0]}{cc[1]}), which has no native "
            "bf16: it would be emulated and slower than fp32. Use precision='fp16' (with GradScaler) or "
            "precision='auto'."
        )


def hardware_report(device: torch.device | str | None = None) -> str:
    """Chapter 00: a printable summary of the software and hardware this notebook runs on."""
    dev = torch.device(device) if device is not None else pick_device()
    lines = [f"torch {torch.__version__} | python {platform.python_version()} | {platform.machine()}"]
    if dev.type == "cuda":
        cc = cuda_capability(dev)
        props = torch.cuda.get_device_properties(dev)  # below sm_80 torch's own bf16 answer counts emulation:
        emulated = "" if cc >= (8, 0) else f" (is_bf16_supported(): {torch.cuda.is_bf16_supported()}, emulated)"
        lines += [
            f"device: cuda, {props.name}, sm_{cc[0]}{cc[1]}, {props.total_memory / 2**30:.1f} GiB, "
            f"{props.multi_processor_count} SMs, CUDA {torch.version.cuda or torch.version.hip}",
            f"Tensor Cores: {tensor_core_generation(cc) or 'none'}",
            f"native bf16: {has_native_bf16(dev)}{emulated}",
            f"fp32 matmul precision: {torch.get_float32_matmul_precision()!r} "
            "('highest' = no TF32; 'high' lets matmuls use TF32 on Ampere+)",
        ]
    else:
        flags = cpu_bf16_flags()
        lines += [
            f"device: {dev.type}, {platform.processor() or 'CPU'}, {os.cpu_count()} logical cores, "
            f"torch threads {torch.get_num_threads()}, CPU capability {torch.backends.cpu.get_cpu_capability()}",
            "Tensor Cores: none (no CUDA GPU)",
            f"native bf16 instructions: {', '.join(flags) if flags else 'none'}",
        ]
    lines.append(f"recommended precision: {recommend_precision(dev)}")
    return "\n".join(textwrap.fill(line, 100, subsequent_indent="    ") for line in lines)  # no line over 100


def gpu_cell(what: str, instead: str = "the next cell shows the result recorded on a GPU") -> bool:
    """Chapter 00: the guard at the top of every cell tagged `gpu`: `if gpu_cell("..."):`.

    True where a CUDA GPU is present. Elsewhere it prints one line (what the cell would have
    run, and where to look instead) and returns False, so Run All goes on, in JupyterLab,
    Colab and nbconvert alike. In the GPU test tier (COURSE_GPU_TIER=1) a missing GPU is an
    error instead: that tier must not pass by skipping what it exists to run.
    """
    if torch.cuda.is_available():
        return True
    if os.environ.get("COURSE_GPU_TIER") == "1":
        raise RuntimeError(f"GPU tier (COURSE_GPU_TIER=1) but no CUDA GPU here; cannot run: {what}")
    print(f"[needs a CUDA GPU, none here] {what}; {instead}.")
    return False


def torch_at_least(version: str, what: str = "", installed: str | None = None) -> bool:
    """Chapter 11: is the installed torch at least `version` ("2.8")? The course's one version question,
    asked as torch compares its own `__version__` (PEP 440): 2.10 is newer than 2.9, a local build
    (2.6.0+cu124) is its release, and a pre-release (2.8.0a0) is older, as it may predate the feature.
    With `what`, an older torch prints one line, what needs which torch and the torch found, and the
    guarded cell goes on. Chapter 11's `torch._scaled_mm` on a CPU needs 2.8, or 2.12 for rowwise
    scales; chapter 10's MemTracker on fake tensors runs on the floor, 2.6 (README, "Testing the
    declared floor")."""
    found = str(installed or torch.__version__)
    if TorchVersion(found) >= version:
        return True
    if what:
        print(f"skipped: needs torch >= {version} for {what}; this is {found}")
    return False


if __name__ == "__main__":
    print(hardware_report())
