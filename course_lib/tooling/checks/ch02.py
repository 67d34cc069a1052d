"""Checks for exercise 02 (autocast). Each compares the learner's code with a live probe of
autocast on this machine, on fresh random cases, so a memorised table from another torch
version or another device fails where it is wrong."""
from __future__ import annotations

import random
from collections import OrderedDict

import torch
import torch.nn as nn

from ...chapters.autocast_dtypes import module_dtypes
from ...chapters.autocast_policy import LOW_PRECISION, fake_cuda_available, output_dtype, short
from ..grading import CheckFailure, register

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

# The ops of exercise 1, with how many floating-point inputs each takes (see OPS in autocast_policy).
PREDICT_OPS = {"linear": 1, "matmul": 2, "relu": 1, "softmax": 1, "layer_norm": 1, "sum": 1,
               "mse_loss": 2, "add": 2, "cat": 2}


def _devices(allow_fake: bool) -> list[tuple[str, bool]]:
    """(device, fake) pairs we can probe here: the CPU always, CUDA for real or as FakeTensors."""
    out = [("cpu", False)]
    if torch.cuda.is_available():
        out.append(("cuda", False))
    elif allow_fake and fake_cuda_available():
        out.append(("cuda", True))
    return out


def _low_dtypes(device: str) -> list[torch.dtype]:
    # Which dtypes autocast *accepts* here, not which are fast: torch.autocast gates bf16 on the
    # emulation-inclusive is_bf16_supported(), so a T4 can be probed in bf16 (slowly) too.
    if device == "cuda" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return [torch.float16]
    return [torch.bfloat16, torch.float16]


def _fmt_case(op: str, device: str, dtype: torch.dtype, ins: tuple) -> str:
    return f"predict_dtype({op!r}, {device!r}, {dtype}, {tuple(ins)})"


@register("02.predict_dtype", args=("predict_dtype",), points=2,
          hint="Two things decide the answer: which list the op is on for that device (chapter 02's CPU and "
               "CUDA tables differ: compare them), and, for an op on no list, its inputs' dtypes (two different "
               "float dtypes combine by ordinary type promotion, to the wider one).")
def _predict_dtype(predict_dtype) -> None:
    cases = []
    for device, fake in _devices(allow_fake=True):
        for dtype in _low_dtypes(device):
            for op, n in PREDICT_OPS.items():
                configs = [(torch.float32,), (dtype,)] if n == 1 else [
                    (torch.float32, torch.float32), (dtype, dtype), (dtype, torch.float32), (torch.float32, dtype)]
                cases += [(op, device, fake, dtype, ins) for ins in configs]
    random.shuffle(cases)
    wrong = []
    for op, device, fake, dtype, ins in cases:
        want = output_dtype(op, device, dtype, ins, fake=fake)
        got = predict_dtype(op, device, dtype, ins)
        if got != want:
            wrong.append(f"{_fmt_case(op, device, dtype, ins)} returned {got}, autocast gives {want}")
    if wrong:
        more = f" (and {len(wrong) - 1} more of {len(cases)} cases)" if len(wrong) > 1 else ""
        raise CheckFailure(wrong[0] + more)


# --------------------------------------------------------------------------- exercise 2

def _sqdist64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # The reference: differences first (no cancellation), in float64.
    return ((a.double()[:, None, :] - b.double()[None, :, :]) ** 2).sum(-1)


def _clustered(n: int, m: int, d: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    # Points close to each other far from the origin: ||a||^2 + ||b||^2 - 2 a.b cancels badly,
    # which is why torch puts cdist on autocast's fp32 list.
    c = 3 * torch.randn(1, d, generator=gen)
    a = c + 0.1 * torch.randn(n, d, generator=gen)
    b = c + 0.1 * torch.randn(m, d, generator=gen)
    return a.to(device), b.to(device)


@register("02.make_sqdist", args=("make_sqdist",), points=3,
          hint="Chapter 02, section 7: torch.amp.custom_fwd(device_type=..., cast_inputs=...) on forward and "
               "torch.amp.custom_bwd(device_type=...) on backward, each under @staticmethod. cast_inputs=torch.float32 "
               "runs forward on fp32 inputs with autocast off; custom_bwd makes backward run under forward's "
               "autocast state, even when backward() is called inside the region.")
def _make_sqdist(make_sqdist) -> None:
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    devices = [d for d, _ in _devices(allow_fake=False)]
    for device in devices:
        fn_cls = make_sqdist(device)
        if not (isinstance(fn_cls, type) and issubclass(fn_cls, torch.autograd.Function)):
            raise CheckFailure(f"make_sqdist({device!r}) should return a torch.autograd.Function subclass, "
                               f"got {fn_cls!r}")
        n, m, d = random.randint(3, 6), random.randint(3, 6), random.randint(4, 8)
        # 1. The maths, in float64 and outside autocast (custom_fwd changes nothing there).
        a = torch.randn(n, d, generator=gen, dtype=torch.float64).to(device).requires_grad_()
        b = torch.randn(m, d, generator=gen, dtype=torch.float64).to(device).requires_grad_()
        out = fn_cls.apply(a, b)
        if not isinstance(out, torch.Tensor) or out.shape != (n, m):
            raise CheckFailure(f"expected an ({n}, {m}) tensor of squared distances, got "
                               f"{getattr(out, 'shape', type(out).__name__)}")
        if not torch.allclose(out, _sqdist64(a, b), rtol=1e-9, atol=1e-9):
            raise CheckFailure("outside autocast, in float64, the forward does not compute ||a_i - b_j||^2")
        try:
            ok = torch.autograd.gradcheck(fn_cls.apply, (a, b), eps=1e-6, atol=1e-5, raise_exception=False)
        except Exception as e:  # a backward that crashes
            raise CheckFailure(f"backward raised {type(e).__name__}: {e}") from None
        if not ok:
            raise CheckFailure("the backward's gradients disagree with finite differences (gradcheck, float64)")
        # 2. Under autocast, with fp32 and with low-precision inputs, backward called inside the region.
        for low in _low_dtypes(device):
            for in_dtype in (torch.float32, low):
                a32, b32 = _clustered(n, m, d, device, gen)
                a = a32.to(in_dtype).requires_grad_()
                b = b32.to(in_dtype).requires_grad_()
                ref_a, ref_b = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
                ref = _sqdist64(ref_a, ref_b)
                g = torch.rand(n, m, generator=gen, dtype=torch.float64).to(device)
                ref.backward(g)
                where = f"under torch.autocast({device!r}, dtype={low}) with {short(in_dtype)} inputs"
                with torch.autocast(device, dtype=low):
                    out = fn_cls.apply(a, b)
                    if out.dtype != torch.float32:
                        raise CheckFailure(f"{where} the output is {out.dtype}; it should be computed and returned in "
                                           "float32 (is forward decorated with "
                                           "custom_fwd(..., cast_inputs=torch.float32)?)")
                    err = (out.double() - ref).abs().max().item()
                    if err > 1e-3 * (1 + ref.abs().max().item()):
                        raise CheckFailure(f"{where} the distances are off by up to {err:.3g}: the forward ran in low "
                                           "precision (cast_inputs=torch.float32 makes it run in fp32 with "
                                           "autocast off)")
                    out.backward(g.to(out.dtype))  # inside the region on purpose: custom_bwd must protect backward
                for name, x, rx in (("a", a, ref_a), ("b", b, ref_b)):
                    if x.grad is None:
                        raise CheckFailure(f"{where} {name}.grad is None after backward")
                    gerr = (x.grad.double() - rx.grad).abs().max().item()
                    scale = rx.grad.abs().max().item()
                    if gerr > 1e-3 * (1 + scale) + (0 if in_dtype == torch.float32 else 1e-2 * scale):
                        raise CheckFailure(f"{where}, with backward() called inside the region, {name}.grad is off by "
                                           f"{gerr:.3g} (largest gradient {scale:.3g}): the backward ran "
                                           "under autocast "
                                           "(decorate it with custom_bwd(device_type=...))")


# --------------------------------------------------------------------------- exercise 3

_CHANNELS = 4
# Candidates for the random models: which of them autocast casts up to fp32 depends on the
# device (reflection/replication padding on CPU; group_norm, softmax, upsampling on CUDA).
_MAYBE_FP32 = [lambda: nn.ReflectionPad1d(1), lambda: nn.ReplicationPad1d(1), lambda: nn.GroupNorm(1, _CHANNELS),
               lambda: nn.Softmax(dim=1), lambda: nn.Upsample(scale_factor=2)]
_FOLLOWS_INPUT = [nn.ReLU, nn.GELU, nn.Tanh, nn.Identity, lambda: nn.Dropout(0.0), lambda: nn.ConstantPad1d(1, 0.0)]


def _random_model(rng: random.Random) -> nn.Module:
    def block() -> nn.Sequential:
        mods: list[nn.Module] = [nn.Conv1d(_CHANNELS, _CHANNELS, 1)]
        for _ in range(rng.randint(2, 4)):
            mods.append(rng.choice(_MAYBE_FP32 if rng.random() < 0.6 else _FOLLOWS_INPUT)())
        return nn.Sequential(*mods)

    parts = OrderedDict(stem=rng.choice(_FOLLOWS_INPUT + _MAYBE_FP32)())  # sees the fp32 input: never an island
    for i in range(rng.randint(2, 3)):
        parts[f"block{i}"] = block()
    parts["head"] = nn.Conv1d(_CHANNELS, _CHANNELS, 1)
    return nn.Sequential(parts)


def _islands(model: nn.Module, x: torch.Tensor, device: str, dtype: torch.dtype) -> tuple[set[str], set[str]]:
    rows = module_dtypes(model, x, device_type=device, dtype=dtype)
    islands = {r.name for r in rows if r.in_dtype in LOW_PRECISION and r.out_dtype == torch.float32}
    fp32_followers = {r.name for r in rows if r.in_dtype == torch.float32 and r.out_dtype == torch.float32}
    return islands, fp32_followers


@register("02.find_fp32_islands", args=("find_fp32_islands",), points=2,
          hint="Register a forward hook on every leaf module (no children), run model(x) under "
               "torch.autocast(device_type, dtype=dtype), and keep the names (from named_modules) of the "
               "modules whose input was low precision and whose output is float32. A module that gets fp32 in "
               "and gives fp32 out is not an island: it only follows its input. Remove the hooks afterwards.")
def _find_fp32_islands(find_fp32_islands) -> None:
    rng = random.Random(random.randrange(2**31))
    devices = [d for d, _ in _devices(allow_fake=False)]
    tested = 0
    for attempt in range(50):
        device = rng.choice(devices)
        dtype = rng.choice(_low_dtypes(device))
        torch.manual_seed(rng.randrange(2**31))
        model = _random_model(rng).to(device)
        x = torch.randn(2, _CHANNELS, 6, device=device)
        want, followers = _islands(model, x, device, dtype)
        if not want or not followers:
            continue  # only models with both islands and fp32 modules that are not islands tell answers apart
        got = find_fp32_islands(model, x, device, dtype)
        if isinstance(got, str) or not hasattr(got, "__iter__"):
            raise CheckFailure(f"expected a list of module names, got {type(got).__name__}")
        got = list(got)
        if len(set(got)) != len(got):
            raise CheckFailure(f"names appear twice in {got}")
        if set(got) != want:
            extra, missing = sorted(set(got) - want), sorted(want - set(got))
            raise CheckFailure(f"on {device} with {short(dtype)}, for the model\n{model}\nyou found {sorted(got)}; "
                               f"expected {sorted(want)}" + (f" ({extra} are not islands)" if extra else "")
                               + (f" (missed {missing})" if missing else ""))
        tested += 1
        if tested == 3:
            return
    if tested == 0:
        raise CheckFailure("internal: no suitable random model was generated; please report this")
