"""Checks for exercise 12 (outgrowing one GPU: FSDP2 with mixed precision).

`12.rank_bytes`: the learner predicts what one rank holds under FSDP2 for a model given as plain
data. The reference is chapter 12's predictor (`predict_rank_bytes`, held to FSDPMemTracker's
numbers to the byte by tests/test_shard_memory.py), called here on a module with the case's
parameter shapes; a wrong number is told which of the usual mistakes it looks like.

`12.fix_sharding`: the learner repairs a `shard(model, mesh)` that casts the model to bf16 before
`fully_shard` and puts `output_dtype` on every block. The probe runs it for real in a one-process
gloo group and reports what it made; the judge reads it: fp32 shards (the master), bf16 compute, an
fp32 output, every block and the root sharded, and weights that a few small AdamW steps move.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn as nn

from ...chapters.ch12.precision import FLOOR
from ...chapters.ch12.shard_memory import predict_rank_bytes
from ...device import AMP_DTYPES
from ..checkbase import Check, CheckFailure, describe_value, expect_dict, expect_list, expect_number, register

__all__: list[str] = []  # the checks register themselves; nothing here is imported by name

KEYS = ("sharded_params", "optimizer_state", "gradients", "all_gather", "reduce_scatter")
BYTES = {"fp32": 4, "bf16": 2}


# --------------------------------------------------------------------------- 12.rank_bytes


def _holder(shapes: list) -> nn.Module:
    module = nn.Module()
    for i, shape in enumerate(shapes):  # meta: shapes and dtypes only, no memory
        module.register_parameter(f"p{i}", nn.Parameter(torch.empty(shape, device="meta")))
    return module


def _dtype(precision: str) -> torch.dtype:
    return AMP_DTYPES[precision] or torch.float32  # the map's fp32 is "no autocast": None


def reference(case: dict) -> dict[str, int]:
    """Chapter 12's predictor on a model with the case's shapes: units "units.0", ...; the rest the root's."""
    model = _holder(case["root"])
    model.units = nn.ModuleList(_holder(unit) for unit in case["units"])
    return predict_rank_bytes(
        model,
        case["world"],
        case["rank"],
        units=[f"units.{i}" for i in range(len(case["units"]))],
        param_dtype=_dtype(case["param_dtype"]),
        reduce_dtype=None if case["reduce_dtype"] is None else _dtype(case["reduce_dtype"]),
        optimizer=case["optimizer"],
    )


def _rows(d0: int, world: int, rank: int) -> tuple[int, int]:
    """(rows held, rows stored) by torch.chunk's split, stored padded to ceil(d0/world)."""
    c = math.ceil(d0 / world)
    return max(0, min(c, d0 - rank * c)), c


def _split_by(d0: int, world: int, rank: int, how: str) -> int:
    """Rows a rank would hold under the splits people assume instead of torch.chunk's."""
    if how == "floor":  # d0 // N each, the last rank takes what is left
        return d0 // world if rank < world - 1 else d0 - (world - 1) * (d0 // world)
    return d0 // world + (rank < d0 % world)  # numpy.array_split: the first ranks take one more row


def _sizes(case: dict) -> dict:
    """The counts the usual mistakes are made of (elements unless said otherwise)."""
    world, rank = case["world"], case["rank"]
    params = [(u, s) for u, unit in enumerate(case["units"]) for s in unit] + [(-1, s) for s in case["root"]]
    out = {"n": len(params), "psi": 0, "padded": 0, "held": 0, "floor": 0, "array_split": 0, "short": None}
    unit_padded: dict[int, int] = {}
    unit_full: dict[int, int] = {}
    unit_held: dict[int, int] = {}
    for unit, shape in params:
        d0 = shape[0] if shape else 1
        rest = math.prod(shape[1:]) if shape else 1
        held, stored = _rows(d0, world, rank)
        out["psi"] += d0 * rest
        out["padded"] += stored * rest
        out["held"] += held * rest
        out["floor"] += _split_by(d0, world, rank, "floor") * rest
        out["array_split"] += _split_by(d0, world, rank, "array_split") * rest
        unit_padded[unit] = unit_padded.get(unit, 0) + stored * rest
        unit_full[unit] = unit_full.get(unit, 0) + d0 * rest
        unit_held[unit] = unit_held.get(unit, 0) + held * rest
        if held != stored and out["short"] is None:
            out["short"] = (tuple(shape), held, stored)
    out["units"] = unit_padded
    out["units_full"] = unit_full
    out["units_held"] = unit_held
    return out


def _unit_name(unit: int) -> str:
    return "the root's" if unit == -1 else f"unit {unit}'s"


def _short_note(case: dict, s: dict) -> str:
    if s["short"] is None:
        return ""
    shape, held, stored = s["short"]
    return (
        f" (rank {case['rank']} of {case['world']} holds {held} of the {shape[0]} rows of the {list(shape)} "
        f"parameter and stores {stored})"
    )


def mistakes(case: dict) -> dict[str, dict[str, list[float]]]:
    """{key: {why: [the values that mistake gives]}}: each usual wrong count, where it lands."""
    s = _sizes(case)
    world, n, psi, padded, held = case["world"], s["n"], s["psi"], s["padded"], s["held"]
    per_rank = psi / world
    bp = BYTES[case["param_dtype"]]
    br = BYTES[case["reduce_dtype"] or case["param_dtype"]]
    note = _short_note(case, s)
    zero = (
        "that is ZeRO's split from the Playbook (bf16 parameters and gradients, 12 bytes of Adam state with an fp32 "
        "master, all /N): FSDP2 keeps fp32 shards, which are the master, fp32 gradients and two fp32 moments"
    )
    unpadded_split = (
        "the shards are torch.chunk's, not Ψ/N: each parameter's dim 0 is cut into pieces of ceil(d0/N) rows, "
        "stored padded to that size"
    )
    split = (
        "FSDP2 cuts dim 0 as torch.chunk does: ceil(d0/N) rows per rank, the last ranks holding what is left "
        "(fewer rows, or none)"
    )
    out: dict[str, dict[str, list[float]]] = {k: {} for k in KEYS}
    p = out["sharded_params"]
    p["forgot the padding: every rank stores ceil(d0/N) rows of each parameter, its short ones padded" + note] = [
        4 * held
    ]
    p[unpadded_split] = [4 * per_rank]
    if bp == 2:
        p["the sharded parameters stay fp32 under a bf16 policy: they are the master weights, and param_dtype is "
          "only the dtype of the all-gathered copy"] = [2 * padded, 2 * held]  # fmt: skip
    p["that is the whole model: a rank stores only its shard"] = [4 * psi]
    p[zero] = [2 * per_rank]
    p[split] = [4 * s["floor"], 4 * s["array_split"]]

    o = out["optimizer_state"]
    step = 4 * n
    if case["optimizer"] == "adamw":
        o["padded the optimizer state: AdamW's moments are made from the unpadded local shard, not the stored, "
          "padded one" + note] = [8 * padded + step, 8 * padded]  # fmt: skip
        o[f"forgot AdamW's step: one 4-byte fp32 `step` tensor per parameter tensor, {n} of them = {step} bytes"] = [
            8 * held,
            8 * padded,
        ]
        o[zero] = [12 * held, 12 * held + step, 12 * per_rank, 12 * padded]
        o[unpadded_split] = [8 * per_rank + step, 8 * per_rank]
        o["AdamW keeps two fp32 moments (exp_avg, exp_avg_sq): 8 bytes per parameter it holds, whatever the policy"] = [
            4 * held + step,
            2 * bp * held + step if bp == 2 else -1,
        ]
        o[split] = [8 * s["floor"] + step, 8 * s["array_split"] + step]
    elif case["optimizer"] == "sgd_momentum":
        o["padded the optimizer state: the momentum buffer is made from the unpadded local shard" + note] = [
            4 * padded,
            4 * padded + step,
        ]
        o["SGD with momentum keeps one fp32 buffer per parameter (4 bytes each) and no step tensor"] = [
            8 * held,
            8 * held + step,
            4 * held + step,
        ]
        o[split] = [4 * s["floor"], 4 * s["array_split"]]
    g = out["gradients"]
    g["the sharded gradient is a view of its unit's padded reduce-scatter output: ceil(d0/N) rows of each "
      "parameter on every rank, padding included" + note] = [4 * held]  # fmt: skip
    g["the sharded gradients are fp32: FSDP2 casts the reduce-scatter's output back to the parameters' dtype"] = [
        bp * padded if bp != 4 else -1,
        br * padded if br != 4 else -1,
    ]
    g["the gradients are reduce-scattered: a rank keeps only its shard of them"] = [4 * psi]
    g[unpadded_split] = [4 * per_rank]
    g[zero] = [2 * per_rank]
    for key, size in (("all_gather", bp), ("reduce_scatter", br)):
        b = out[key]
        if world == 1:
            continue  # no collective: the judge names any number but 0
        largest = max(s["units"], key=lambda u: s["units"][u])
        top = s["units"][largest]
        b["the buffer holds the whole unit: world × the padded shard, not one rank's shard"] = [size * top]
        b["the buffer is padded: world × ceil(d0/N) rows of each parameter in the unit"] = [
            size * max(s["units_full"].values()),
            size * world * max(s["units_held"].values()),
        ]
        b["one unit is gathered at a time: the buffer is the largest unit's, not the whole model's"] = [
            size * world * padded,
            size * psi,
        ]
        for unit, elements in s["units"].items():
            if elements != top:
                b[f"that is {_unit_name(unit)} buffer: the largest unit is {_unit_name(largest)[:-2]}"] = [
                    size * world * elements
                ]
        other = 6 - size  # the other of 2 and 4 bytes
        if key == "all_gather":
            b[f"the all-gather moves {case['param_dtype']} copies (param_dtype): {size} bytes an element"] = [
                other * world * top
            ]
        elif case["reduce_dtype"] is None:
            b["reduce_dtype=None reduces in the gradients' dtype, which is param_dtype "
              f"({case['param_dtype']}) on this torch: {size} bytes an element"] = [other * world * top]  # fmt: skip
        else:
            b[f"reduce_dtype={case['reduce_dtype']!r} sets the reduce-scatter's dtype, whatever param_dtype is: "
              f"{size} bytes an element"] = [other * world * top]  # fmt: skip
    return out


def _near(got: float, values: list[float]) -> bool:
    return any(not math.isnan(v) and abs(got - v) < 1 for v in values)


@register
class RankBytes(Check):
    name, args, points = "12.rank_bytes", ("rank_bytes",), 3
    hint = (
        "Chapter 12, section 1: per parameter, c = ceil(d0/N) rows; rank r holds min(c, d0 - r·c) of them "
        "(0 or more) and stores c (padded). Sharded parameters: fp32, stored. Optimizer: on the rows held "
        "(AdamW: 2 × 4 bytes, plus a 4-byte step per tensor). Gradients: fp32, stored size. Buffers: the "
        "largest unit, world × stored, in param_dtype (all-gather) and reduce_dtype or param_dtype "
        "(reduce-scatter); none with world 1."
    )
    forbidden = ("course_lib.chapters.ch12",)
    forbidden_why = "count it yourself, as chapter 12 does, instead of calling the chapter's predictor"

    def cases(self, rng: random.Random) -> list:
        configs = [  # (param_dtype, reduce_dtype, optimizer, worlds, which rank)
            ("bf16", None, "adamw", [4], "last"),
            ("bf16", "fp32", "adamw", [2, 3, 5], "any"),
            ("fp32", None, "adamw", [8], "last"),
            ("bf16", "bf16", "sgd_momentum", [3, 4], "last"),
            ("fp32", "bf16", "sgd", [2, 4, 6], "first"),
            ("bf16", None, "adamw", [6, 8], "middle"),
            ("fp32", None, "adamw", [1], "first"),
        ]
        cases = []
        for param_dtype, reduce_dtype, optimizer, worlds, which in configs:
            world = rng.choice(worlds)
            rank = {"last": world - 1, "first": 0, "any": rng.randrange(world)}.get(which)
            if rank is None:
                rank = rng.randrange(1, world - 1)
            d = rng.choice([29, 37, 45, 51, 63])  # odd: no world > 1 divides it, so padding shows
            hidden = rng.choice([2 * d, 3 * d + 1, 75, 100])
            block = [[d], [d], [hidden, d], [hidden], [d, hidden], [d]]  # LayerNorm, Linear(d, h), Linear(h, d)
            classes = rng.choice([3, 5, 10])
            root = [[classes, d], [classes]]  # the head
            if rng.random() < 0.4:  # an embedding the root owns: the largest unit is then the root
                root = [[rng.choice([3, 4, 5]) * hidden + 1, d], *root]
            cases.append(
                {
                    "units": [block] * rng.randint(1, 3),
                    "root": root,
                    "world": world,
                    "rank": rank,
                    "param_dtype": param_dtype,
                    "reduce_dtype": reduce_dtype,
                    "optimizer": optimizer,
                }
            )
        rng.shuffle(cases)
        return cases

    def describe(self, case: dict) -> str:
        units = case["units"]
        return (
            f"rank_bytes({len(units)} unit(s) of {units[0]}, root {case['root']}, world={case['world']}, "
            f"rank={case['rank']}, param_dtype={case['param_dtype']!r}, reduce_dtype={case['reduce_dtype']!r}, "
            f"optimizer={case['optimizer']!r})"
        )

    def judge(self, cases: list, results: list) -> None:
        for case, got in zip(cases, expect_list(results, "rank_bytes's answers", len(cases))):
            where = self.describe(case)
            got = expect_dict(got, where, KEYS)
            values = {k: expect_number(got[k], f"{where}[{k!r}]") for k in KEYS}
            want = reference(case)
            wrong = [k for k in KEYS if values[k] != want[k]]
            if not wrong:
                continue
            named = mistakes(case)
            lines, said = [], set()
            for k in wrong:
                # a mistake that lands on the right number here is no mistake on this case
                why = [w for w, cands in named[k].items() if _near(values[k], [c for c in cands if c != want[k]])]
                if k == "optimizer_state" and case["optimizer"] == "sgd":
                    why.append("plain SGD keeps no state: 0 bytes")
                if k in ("all_gather", "reduce_scatter") and case["world"] == 1:
                    why.append("with world 1 FSDP2 runs no collective: no buffer, 0 bytes")
                because = f": {'; or '.join(why)}" if why else ""
                because = ": the same mistake" if why and said.issuperset(why) else because
                said.update(why)
                lines.append(f"{k!r} is {values[k]:,}, the rank holds {want[k]:,}{because}")
            state = values["sharded_params"] + values["gradients"] + values["optimizer_state"]
            if case["optimizer"] == "adamw" and abs(state - 16 * _sizes(case)["psi"] / case["world"]) < 3:
                lines.append(
                    "sharded_params + gradients + optimizer_state is 16Ψ/N, ZeRO-3's total; FSDP2's split differs "
                    "(fp32 shards stored padded, fp32 gradients, AdamW's moments on the unpadded shard, step tensors)"
                )
            raise CheckFailure(f"{where}: " + "; ".join(lines))


# --------------------------------------------------------------------------- 12.fix_sharding


@register
class FixSharding(Check):
    name, args, points = "12.fix_sharding", ("shard",), 3
    hint = (
        "Chapter 12, section 3: keep the model fp32 and let MixedPrecisionPolicy(param_dtype=torch.bfloat16) "
        "cast each unit as it is gathered; fully_shard every block, then the root; output_dtype=torch.float32 on "
        "the root's policy only (a block's fp32 output would reach the root's bf16 head)."
    )
    time_limit = 60.0
    # FSDP2 on a CPU: torch 2.6's CPU stream lacks what FSDP2 calls (chapter 08's fsdp_gradient patches it), and
    # the chapter's floor is where gloo averages too (course_lib.chapters.ch12.precision.FLOOR, pytorch#162338)
    needs_torch = FLOOR

    def cases(self, rng: random.Random) -> list:
        return [
            {
                "seed": rng.randrange(2**31),
                "d": rng.choice([24, 32, 40]),
                "hidden": rng.choice([48, 64, 80]),
                "blocks": blocks,
                "classes": rng.choice([3, 5, 7]),
                "batch": rng.choice([6, 8]),
                "lr": 1e-5,  # what fp32 keeps and bf16 rounds away: weights of ~0.05 step by ~2e-4 of themselves
                "steps": 3,
            }
            for blocks in (2, rng.choice([3, 4]))
        ]

    def describe(self, case: dict) -> str:
        return f"shard(model, mesh) on a model of {case['blocks']} blocks (width {case['d']}) and a head"

    def judge(self, cases: list, results: list) -> None:
        for case, got in zip(cases, expect_list(results, "shard's runs", len(cases))):
            where = self.describe(case)
            got = expect_dict(got, where, ("units", "params", "linears", "output", "error", "unchanged"))
            problems = self._problems(case, got)
            if problems:
                raise CheckFailure(f"{where}: " + "; ".join(problems))

    def _problems(self, case: dict, got: dict) -> list[str]:
        problems = []
        units = set(expect_list(got["units"], "the modules sharded"))
        blocks = [f"blocks.{i}" for i in range(case["blocks"])]
        missing = [b for b in blocks if b not in units]
        if "" not in units:
            problems.append(
                "the root was never sharded: fully_shard(model) last, so that it owns the head and runs the "
                "forward's first all-gather"
            )
        if missing == blocks:
            problems.append(
                "only the root was sharded: each block needs its own fully_shard, or the whole model is one unit, "
                "gathered at once (no memory saved while it computes)"
            )
        elif missing:
            problems.append(f"{missing} got no fully_shard of their own: every block should")
        params = expect_dict(got["params"], "the parameters", ())
        low = sorted({v.get("dtype") for v in params.values() if isinstance(v, dict)} - {"float32"})
        if low:
            problems.append(
                f"the sharded parameters are {low}, not float32: the model was cast before (or after) sharding, so "
                "there is no fp32 master; leave the model fp32 and let MixedPrecisionPolicy(param_dtype=torch."
                "bfloat16) cast each unit when it is gathered"
            )
        unsharded = [n for n, v in params.items() if isinstance(v, dict) and not v.get("sharded")]
        if unsharded and "" in units:
            problems.append(f"{unsharded[:3]} are not sharded")
        linears = expect_dict(got["linears"], "the Linear layers seen in forward", ())
        head = linears.get("head", {})
        if got["error"] is not None:
            mixed = isinstance(head, dict) and head.get("input") == "float32" and head.get("weight") == "bfloat16"
            if mixed or "same dtype" in str(got["error"]):
                problems.append(
                    "the forward raised (" + str(got["error"])[:120] + "): the blocks' output_dtype=float32 sent "
                    "fp32 activations into the root's bf16 head; set output_dtype only on the root's policy"
                )
            else:
                problems.append(f"forward, backward or the optimizer step raised {got['error']}")
            return problems
        full = sorted(n for n, v in linears.items() if isinstance(v, dict) and v.get("weight") == "float32")
        if full:
            problems.append(
                f"{full[:3]} computed with float32 weights: the fix dropped mixed precision; keep "
                "MixedPrecisionPolicy(param_dtype=torch.bfloat16) so that the compute stays bf16"
            )
        if got["output"] != "float32":
            problems.append(
                f"the model's output is {got['output']}, expected float32: set output_dtype=torch.float32 on the "
                "root's policy (and only there), so that the loss sees fp32 logits"
            )
        unchanged = expect_dict(got["unchanged"], "the weights' unchanged fractions", ())
        frozen = {n: f for n, f in unchanged.items() if isinstance(f, (int, float)) and f > 0.5}
        if frozen:
            name, fraction = max(frozen.items(), key=lambda kv: kv[1])
            problems.append(
                f"after {case['steps']} AdamW steps at lr={case['lr']:g}, {fraction:.0%} of {name} had not moved: the "
                "updates were rounded away, as they are in bf16 weights without an fp32 master"
            )
        elif not unchanged:
            problems.append(f"no block weight was found to train (got {describe_value(got['unchanged'])})")
        return problems
