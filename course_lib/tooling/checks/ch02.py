"""Checks for exercise 02 (autocast). The references are live probes of autocast in the grader's
process, on fresh random cases, so a table memorised from another torch or device fails."""

from __future__ import annotations

import random

import torch

from ...chapters.ch02.autocast_dtypes import module_dtypes
from ...chapters.ch02.autocast_policy import LOW_PRECISION, fake_cuda_available, output_dtype
from ..checkbase import Check, CheckFailure, describe_value, expect_dict, expect_list, register
from ..probes.ch02 import MYSTERY, STANDARD, build, dtype_of

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

# The ops of task 1, with how many floating-point inputs each takes (see OPS in autocast_policy).
PREDICT_OPS = {
    "linear": 1,
    "matmul": 2,
    "relu": 1,
    "softmax": 1,
    "layer_norm": 1,
    "sum": 1,
    "mse_loss": 2,
    "add": 2,
    "cat": 2,
}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _low_dtypes(device: str) -> list[torch.dtype]:
    # Which dtypes autocast *accepts* here, not which are fast: torch.autocast gates bf16 on the
    # emulation-inclusive is_bf16_supported(), so a T4 can be probed in bf16 (slowly) too.
    if device == "cuda" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return [torch.float16]
    return [torch.bfloat16, torch.float16]


def _real_devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@register
class PredictDtype(Check):
    name, args, points = "02.predict_dtype", ("predict_dtype",), 2
    hint = (
        "Two things decide the answer: which list the op is on for that device (chapter 02's CPU and CUDA "
        "tables differ: compare them), and, for an op on no list, its inputs' dtypes (two different float "
        "dtypes combine by ordinary type promotion, to the wider one)."
    )
    forbidden = ("course_lib",)
    forbidden_why = (
        "write the rule from what chapter 02 showed instead of calling course_lib.chapters.ch02.autocast_policy"
    )

    def cases(self, rng: random.Random) -> list:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() or fake_cuda_available() else [])
        cases = []
        for device in devices:
            for dtype in _low_dtypes(device):
                for op, n in PREDICT_OPS.items():
                    low = _name(dtype)
                    configs = (
                        [["float32"], [low]]
                        if n == 1
                        else [["float32", "float32"], [low, low], [low, "float32"], ["float32", low]]
                    )
                    cases += [[op, device, low, ins] for ins in configs]
        rng.shuffle(cases)
        return cases

    def describe(self, case: list) -> str:
        op, device, low, ins = case
        return f"predict_dtype({op!r}, {device!r}, torch.{low}, ({', '.join('torch.' + i for i in ins)},))"

    def judge(self, cases: list, results: list) -> None:
        wrong = []
        for case, got in zip(cases, expect_list(results, "predict_dtype's answers", len(cases))):
            op, device, low, ins = case
            fake = device == "cuda" and not torch.cuda.is_available()
            want = _name(output_dtype(op, device, dtype_of(low), [dtype_of(i) for i in ins], fake=fake))
            if got != {"dtype": want}:
                shown = f"torch.{got['dtype']}" if isinstance(got, dict) and "dtype" in got else repr(got)
                wrong.append(f"{self.describe(case)} returned {shown}, autocast gives torch.{want}")
        if wrong:
            more = f" (and {len(wrong) - 1} more of {len(cases)} cases)" if len(wrong) > 1 else ""
            raise CheckFailure(wrong[0] + more)


# --------------------------------------------------------------------------- task 2


def _clustered(n: int, m: int, d: int, rng: random.Random) -> tuple[list, list]:
    # Points close to each other far from the origin: ||a||^2 + ||b||^2 - 2 a.b cancels badly,
    # which is why torch puts cdist on autocast's fp32 list.
    g = torch.Generator().manual_seed(rng.getrandbits(31))
    c = 3 * torch.randn(1, d, generator=g)
    return (c + 0.1 * torch.randn(n, d, generator=g)).tolist(), (c + 0.1 * torch.randn(m, d, generator=g)).tolist()


def _sqdist64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # The reference: differences first (no cancellation), in float64.
    return ((a.double()[:, None, :] - b.double()[None, :, :]) ** 2).sum(-1)


def _tensor(value: object, where: str, what: str, shape: tuple[int, ...], of: str) -> torch.Tensor:
    """A tensor the probe sent back ({"array": ..., "dtype": ...}) as float64, of `shape`, all finite."""
    if not (isinstance(value, dict) and isinstance(value.get("array"), list)):
        raise CheckFailure(f"{where}: expected {what} to be a {shape} tensor of {of}, got {describe_value(value)}")
    t = torch.tensor(value["array"], dtype=torch.float64)
    if tuple(t.shape) != shape:
        raise CheckFailure(f"{where}: expected {what} to be a {shape} tensor of {of}, got shape {tuple(t.shape)}")
    if not torch.isfinite(t).all():  # a NaN compares as "not far off" in an error bound: rule it out first
        raise CheckFailure(
            f"{where}: {what} holds {int((~torch.isfinite(t)).sum())} inf/NaN values; expected finite {of}"
        )
    return t


@register
class MakeSqdist(Check):
    name, args, points = "02.make_sqdist", ("make_sqdist",), 3
    hint = (
        "Chapter 02, section 7: torch.amp.custom_fwd(device_type=..., cast_inputs=...) on forward and "
        "torch.amp.custom_bwd(device_type=...) on backward, each under @staticmethod. cast_inputs=torch.float32 "
        "runs forward on fp32 inputs with autocast off; custom_bwd makes backward run under forward's "
        "autocast state, even when backward() is called inside the region."
    )

    def cases(self, rng: random.Random) -> list:
        cases = []
        for device in _real_devices():
            n, m, d = rng.randint(3, 6), rng.randint(3, 6), rng.randint(4, 8)
            g = torch.Generator().manual_seed(rng.getrandbits(31))
            cases.append(
                {
                    "device": device,
                    "autocast": None,
                    "dtype": "float64",
                    "a": torch.randn(n, d, generator=g, dtype=torch.float64).tolist(),
                    "b": torch.randn(m, d, generator=g, dtype=torch.float64).tolist(),
                    "g": torch.rand(n, m, generator=g, dtype=torch.float64).tolist(),
                }
            )
            for low in _low_dtypes(device):
                for in_dtype in ("float32", _name(low)):
                    a, b = _clustered(n, m, d, rng)
                    cases.append(
                        {
                            "device": device,
                            "autocast": _name(low),
                            "dtype": in_dtype,
                            "a": a,
                            "b": b,
                            "g": torch.rand(n, m, generator=g, dtype=torch.float64).tolist(),
                        }
                    )
        return cases

    def describe(self, case: dict) -> str:
        region = (
            f"under torch.autocast({case['device']!r}, dtype=torch.{case['autocast']})"
            if case["autocast"]
            else "outside autocast"
        )
        return f"make_sqdist({case['device']!r}).apply(a, b) {region} with {case['dtype']} inputs"

    def judge(self, cases: list, results: list) -> None:
        for case, r in zip(cases, expect_list(results, "make_sqdist's answers", len(cases))):
            where = self.describe(case)
            if isinstance(r, dict) and "not_function" in r:
                raise CheckFailure(
                    f"make_sqdist({case['device']!r}) should return a torch.autograd.Function "
                    f"subclass, got {r['not_function']}"
                )
            r = expect_dict(r, where, ("out", "out_dtype", "grad_a", "grad_b"))
            dtype = dtype_of(case["dtype"])
            a = torch.tensor(case["a"], dtype=torch.float64).to(dtype).double().requires_grad_()
            b = torch.tensor(case["b"], dtype=torch.float64).to(dtype).double().requires_grad_()
            ref = _sqdist64(a, b)
            ref.backward(torch.tensor(case["g"], dtype=torch.float64))
            out = _tensor(r["out"], where, "the output", tuple(ref.shape), "squared distances")
            for name, x in (("a", a), ("b", b)):
                if r[f"grad_{name}"] is None:
                    raise CheckFailure(f"{where}: {name}.grad is None after backward")
            grads = {
                name: _tensor(r[f"grad_{name}"], where, f"{name}.grad", tuple(x.shape), "gradients")
                for name, x in (("a", a), ("b", b))
            }
            if case["autocast"] is None:
                if not torch.allclose(out, ref, rtol=1e-9, atol=1e-9):
                    raise CheckFailure(f"{where}: the forward does not compute ||a_i - b_j||^2")
                for name, x in (("a", a), ("b", b)):
                    if not torch.allclose(grads[name], x.grad, rtol=1e-7, atol=1e-9):
                        raise CheckFailure(
                            f"{where}: the gradient for {name} is wrong (compare your backward with "
                            "the formulas in the task)"
                        )
                continue
            if r["out_dtype"] != {"dtype": "float32"}:
                raise CheckFailure(
                    f"{where}: the output is {r['out_dtype']}; it should be computed and returned in "
                    "float32 (is forward decorated with custom_fwd(..., cast_inputs=torch.float32)?)"
                )
            err = (out - ref).abs().max().item()
            if err > 1e-3 * (1 + ref.abs().max().item()):
                raise CheckFailure(
                    f"{where}: the distances are off by up to {err:.3g}: the forward ran in low "
                    "precision (cast_inputs=torch.float32 makes it run in fp32 with autocast off)"
                )
            for name, x in (("a", a), ("b", b)):
                gerr, scale = (grads[name] - x.grad).abs().max().item(), x.grad.abs().max().item()
                if gerr > 1e-3 * (1 + scale) + (0 if case["dtype"] == "float32" else 1e-2 * scale):
                    raise CheckFailure(
                        f"{where}, with backward() called inside the region: {name}.grad is off by "
                        f"{gerr:.3g} (largest gradient {scale:.3g}): the backward ran under autocast "
                        "(decorate it with custom_bwd(device_type=...))"
                    )


# --------------------------------------------------------------------------- task 3


def _random_spec(rng: random.Random, device: str, dtype: torch.dtype) -> dict:
    def item() -> list:
        if rng.random() < 0.4:
            return ["mystery", rng.choice(sorted(MYSTERY)), f"Block{rng.getrandbits(24):06x}"]
        return [rng.choice(sorted(STANDARD))]

    parts = [("stem", [item()])]  # sees the fp32 input: never an island
    for i in range(rng.randint(2, 3)):
        # a conv somewhere in every block makes its activations low precision again
        items = [item() for _ in range(rng.randint(2, 4))]
        items.insert(rng.randrange(len(items) + 1), [rng.choice(["conv", "conv3"])])
        parts.append((f"block{i}", items))
    parts.append(("head", [["conv"]]))
    return {"device": device, "dtype": _name(dtype), "seed": rng.getrandbits(31), "parts": parts}


def _islands(spec: dict) -> tuple[set[str], set[str]]:
    model, x = build(spec)
    rows = module_dtypes(model, x, device_type=spec["device"], dtype=dtype_of(spec["dtype"]))
    islands = {r.name for r in rows if r.in_dtype in LOW_PRECISION and r.out_dtype == torch.float32}
    followers = {r.name for r in rows if r.in_dtype == torch.float32 and r.out_dtype == torch.float32}
    return islands, followers


@register
class FindFp32Islands(Check):
    name, args, points = "02.find_fp32_islands", ("find_fp32_islands",), 2
    hint = (
        "Register a forward hook on every leaf module (no children), run model(x) under "
        "torch.autocast(device_type, dtype=dtype), and keep the names (from named_modules) of the modules "
        "whose input was low precision and whose output is float32. A module that gets fp32 in and gives fp32 "
        "out is not an island: it only follows its input. Remove the hooks afterwards."
    )

    def cases(self, rng: random.Random) -> list:
        cases: list = []
        for _ in range(200):
            device = rng.choice(_real_devices())
            spec = _random_spec(rng, device, rng.choice(_low_dtypes(device)))
            islands, followers = _islands(spec)
            if islands and followers:  # only such models tell a hook-based answer from a guess
                cases.append(spec)
            if len(cases) == 5:
                return cases
        raise RuntimeError("no suitable random model was generated")

    def describe(self, case: dict) -> str:
        return f"find_fp32_islands(model, x, {case['device']!r}, torch.{case['dtype']})"

    def judge(self, cases: list, results: list) -> None:
        for spec, got in zip(cases, expect_list(results, "find_fp32_islands's answers", len(cases))):
            if not isinstance(got, list) or not all(isinstance(n, str) for n in got):
                raise CheckFailure(f"{self.describe(spec)} returned {got!r}; expected a list of module names")
            if len(set(got)) != len(got):
                raise CheckFailure(f"{self.describe(spec)}: names appear twice in {got!r}")
            want, _ = _islands(spec)
            if set(got) != want:
                extra, missing = sorted(set(got) - want), sorted(want - set(got))
                layers = ", ".join(
                    f"{n}: {type(m).__name__}" for n, m in build(spec)[0].named_modules() if not list(m.children())
                )
                raise CheckFailure(
                    f"{self.describe(spec)} for the model [{layers}] returned {sorted(got)!r}; "
                    f"expected {sorted(want)!r}"
                    + (f" ({extra} are not islands)" if extra else "")
                    + (f" (missed {missing})" if missing else "")
                )
