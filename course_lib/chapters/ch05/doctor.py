"""The AMP doctor: run your training loop under instrumentation and name the classic mistakes.

Chapter 05 introduces it, chapter 09 completes it: `print(diagnose(train, model, optimizer, scaler, batches))`.
`train(model, optimizer, scaler, batches)` is your loop over `batches` (a list of (x, y)); `model` and
`optimizer` may be tuples. It runs on deep copies, with the scaler's and optimizers' methods,
`torch.autograd.backward` and `grad`, clipping and BCE wrapped and the forwards hooked, and records each call
with the autocast state (backward: clean gradients? after a penalty's autograd.grad, were its scaled gradients
divided by the scale? step: the gradients, the scale): the Recorder of doctor_recorder.py. What it says is
doctor_catalog.py. With `accum_steps > 1`, one model and `loss_fn`, a plain fp32 loop recomputes each step's
gradient on the same batches.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.chapters.ch05.doctor_catalog import PROBLEMS, SEEN, Finding, Report, findings, summary
from course_lib.chapters.ch05.doctor_recorder import Recorder, restore_rng_states, rng_states

__all__ = ["Finding", "Report", "diagnose", "PROBLEMS"]


def _adder(found: dict[str, str]) -> Callable:
    """add(key, **numbers): the catalogue's SEEN[key] with the numbers, under the code before any '.' in key."""
    return lambda key, **kw: found.setdefault(key.split(".")[0], SEEN[key].format(**kw))


def _analyse(rec: Recorder, enabled: bool, accum: int, notes: list[str]) -> dict[str, str]:
    """code -> what was seen, for every mistake the events show."""
    ev = rec.events
    found: dict[str, str] = {}
    add = _adder(found)

    def kind(k: str) -> list:  # the events of one kind, in order
        return [e for e in ev if e.kind == k]

    backs = kind("backward")
    fwd = [e for e in kind("forward") if e.index == 0]  # the first model's forwards
    grads = kind("grad")
    boundary = [e for e in ev if e.kind == "scaler.step" or (e.kind == "step" and not e.info["via_scaler"])]
    counts = {  # code: (how many calls show the mistake, of how many)
        "backward_in_autocast": (sum(e.autocast for e in backs), len(backs)),
        "step_in_autocast": (sum(e.autocast for e in boundary), len(boundary)),
        "bce_in_autocast": (sum(e.autocast for e in kind("bce")), 0),
        "not_scaled": (enabled and sum(not e.info["scaled"] for e in backs), len(backs)),
        "empty_step": (sum(e.info["empty"] for e in kind("scaler.step")), 0),
        "penalty_from_scaled_grads": (enabled and sum(e.info.get("penalty_unscaled") is False for e in backs), 0),
        "penalty_from_unscaled_loss": (enabled and sum(not e.info["scaled"] for e in grads), len(grads)),
    }
    for code, (n, of) in counts.items():
        if n:
            add(code, n=n, of=of)
    if enabled and fwd and not any(e.autocast for e in kind("forward")):
        add("no_autocast", n=len(kind("forward")))
    if enabled and (direct := [e for e in kind("step") if not e.info["via_scaler"]]):
        add("step_without_scaler", i=direct[0].index, n=len(direct))
    if enabled and rec.error is None and (n := len(kind("scaler.step"))) and not kind("update"):
        add("missing_update.never", n=n)  # a loop that raised has its own iteration (below)
    _analyse_chapter_09(rec, enabled, found, notes)
    n = len(rec.opts)
    # The state of the replay, per optimizer i where it is a list:
    updates = 0  # scaler.update() calls so far
    start = [0] * n  # the update count when optimizer i's gradients were last zeroed by a clean backward
    zeroed = [False] * n  # gradients zeroed since optimizer i's last step
    stepped = [False] * n  # optimizer i has stepped at least once
    unscaled: set[int] = set()  # optimizers unscaled (or stepped) since the last update
    pending: list[bool | None] = [None] * n  # since each one's scaler.step(): a forward? (None: updated since)
    since_update = 0  # forwards of model 0 since the last update
    since_step = 0  # forwards of model 0 since optimizer 0's last step
    window = 0  # backwards since optimizer 0's last step
    for e in ev:
        if e.kind == "forward":
            pending = [p if p is None else True for p in pending]
        if e.kind == "forward" and e.index == 0:
            since_update += 1
            since_step += 1
        elif e.kind == "backward":
            if accum > 1 and e.info["clean"][0] and window:
                add("zero_grad_in_window", n=window)
            for i, clean in enumerate(e.info["clean"]):
                if clean:
                    start[i] = updates
                    zeroed[i] = True
            window += 1
        elif e.kind == "zero_grad":
            zeroed[e.index] = True
        elif e.kind == "update":
            if enabled and accum > 1 and since_update < accum:
                add("update_per_microstep", n=since_update, accum=accum)
            updates += 1
            since_update = 0
            pending = [None] * n
            unscaled.clear()
        elif e.kind == "clip" and enabled and (bad := [i for i in e.info["owners"] if i not in unscaled]):
            add("clip_before_unscale", clip=e.info["kind"], i=bad[0], which="that" if updates else "the first")
        i = e.index
        if (
            enabled
            and e.kind in ("unscale_", "scaler.step")
            and i is not None
            and pending[i] is not None
            and not e.info.get("in_step")
        ):  # a forward since its scaler.step() (no update): a new iteration
            add("missing_update" if pending[i] else "unscale_after_step", call=e.kind.removeprefix("scaler."), i=i)
        if e.kind in ("unscale_", "scaler.step") and i is not None and i not in unscaled:
            if enabled and zeroed[i] and start[i] < updates:  # scaled before an update, unscaled after it
                add("update_between_steps", i=i)
            unscaled.add(i)
        if e.kind == "scaler.step" and i is not None:
            pending[i] = False
        if e in boundary and i is not None:
            if stepped[i] and not zeroed[i]:
                add("missing_zero_grad", i=i)
            if i == 0 and accum > 1 and since_step < accum:
                add("step_per_microstep", n=since_step, accum=accum)
            stepped[i] = True
            zeroed[i] = False
            if i == 0:
                since_step = 0
                window = 0
            unscaled.add(i)
    return found


def _analyse_chapter_09(rec: Recorder, enabled: bool, found: dict[str, str], notes: list[str]) -> None:
    """The mistakes chapter 09 adds: an inf/NaN loss, a collapsing scale, the scheduler before the step or on
    skipped steps, a scaler beside bf16, deprecated spellings, checkpoints without the scaler. Inf losses and
    skips after a step with scaled gradients (a direct step, a penalty) are said with that mistake."""
    ev = rec.events
    add = _adder(found)
    low = 2.0**8  # at 256 only gradients above 256 overflow fp16's 65504
    cut = next(
        (
            k
            for k, e in enumerate(ev)
            if enabled and (e.kind == "step" and not e.info["via_scaler"] or e.info.get("penalty_unscaled") is False)
        ),
        len(ev),
    )
    cause = None  # the mistake that scaled gradients reached a step through, if any
    if cut < len(ev):
        cause = "step_without_scaler" if ev[cut].kind == "step" else "penalty_from_scaled_grads"
    roots = [
        (k, e)
        for k, e in enumerate(ev)
        if e.kind == "grad" or e.kind == "backward" and "penalty_unscaled" not in e.info
    ]  # a penalty's total is judged by the loss autograd.grad saw
    if n := sum(not e.info["finite"] for k, e in roots if k < cut):
        add("nonfinite_loss", n=n, of=len(roots))
    if cause and (n := sum(not e.info["finite"] for k, e in roots if k > cut)):
        found[cause] += SEEN["consequence"].format(n=n)
    steps = [e for k, e in enumerate(ev) if e.kind == "scaler.step" and k < cut]
    streak = list(itertools.takewhile(lambda e: e.info.get("skipped"), reversed(steps)))  # the last, backwards
    skips = [e.info["scale"] for e in steps if e.info.get("skipped")]
    if enabled and sum(e.info["scale"] <= low for e in streak) >= 5:
        add("scale_collapsing", n=len(streak), of=len(steps), low=streak[0].info["scale"], end=rec.scaler.get_scale())
    elif enabled and skips:
        notes.append(SEEN["skips_note"].format(n=len(skips), of=len(steps), hi=max(skips), lo=min(skips)))
    bounds = [k for k, e in enumerate(ev) if e.kind == "scaler.step" or (e.kind == "step" and not e.info["via_scaler"])]

    def forward(a: int, b: int) -> bool:  # a forward pass among events a..b-1
        return any(ev[j].kind == "forward" for j in range(a, b))

    before = on_skipped = 0
    for k, e in ((k, e) for k, e in enumerate(ev) if e.kind == "sched"):  # which step is each scheduler step's?
        mine = [j for j in bounds if e.index is None or ev[j].index == e.index]
        prev = max((j for j in mine if j < k), default=None)  # the optimizer's step before this scheduler step
        nxt = min((j for j in mine if j > k), default=None)  # and after it
        step = prev if prev is not None and not forward(prev, k) else None
        if step is None and (prev is None or nxt is not None and not forward(k, nxt)):
            before += 1  # stepped before the optimizer's step it belongs to
            step = nxt
        on_skipped += step is not None and ev[step].info.get("skipped", False)
    if before:
        add("scheduler_before_step", n=before)
    if on_skipped:
        add("scheduler_on_skipped_step", n=on_skipped, of=sum(e.info.get("skipped", False) for e in steps))
    if enabled and {e.info["dtype"] for e in ev if e.kind == "forward" and e.autocast} == {torch.bfloat16}:
        add("scaler_with_bf16", n=sum(e.kind == "forward" for e in ev))
    old = [w for w in rec.warnings if "deprecated" in w and ("torch.cuda.amp" in w or "torch.cpu.amp" in w)]
    if old or type(rec.scaler).__module__.startswith("torch.cuda.amp"):
        add("deprecated_amp_api", what=old[0].split(" is deprecated")[0] if old else "torch.cuda.amp.GradScaler")
    saves = [e for e in ev if e.kind == "save" and e.info["checkpoint"]]
    if enabled and (n := sum(not e.info["scaler"] for e in saves)):
        add("checkpoint_without_scaler", n=n, of=len(saves))


def _grad_check(rec: Recorder, model: nn.Module, batches: list, loss_fn: Callable) -> tuple[dict, str]:
    """Compare each optimizer step's gradient with a plain fp32 loop's on the same batches, same parameters."""
    ref = copy.deepcopy(model)  # the plain fp32 loop's model
    found: dict = {}
    worst = 0.0  # the largest relative gradient error seen
    n = 0  # steps compared
    for e in (e for e in rec.events if e.kind == "step" and e.index == 0):
        lo = e.info["start"]  # the forwards of this step's window: lo .. hi-1
        hi = e.info["forwards"]
        xs = [rec.forwards[j][0] for j in range(lo, hi)]
        if (
            not xs
            or hi > len(batches)
            or any(
                x is None or x.shape != batches[j][0].shape or not torch.equal(x.cpu(), batches[j][0].cpu())
                for j, x in zip(range(lo, hi), xs)
            )
        ):
            return found, "gradient check skipped: the forwards did not see the batches in their order"
        with torch.no_grad():
            for p, q in zip(ref.parameters(), e.info["params"]):
                p.copy_(q)
        ref.zero_grad(set_to_none=True)
        samples = sum(len(batches[j][1]) for j in range(lo, hi))  # the mean over all the window's samples
        for j, x in zip(range(lo, hi), xs):
            restore_rng_states(rec.forwards[j][1])  # the same dropout masks as the loop's forward
            (loss_fn(ref(x), batches[j][1].to(x.device)) * len(batches[j][1]) / samples).backward()
        clip = [c for c in rec.events[: rec.events.index(e)] if c.kind == "clip" and c.info["forwards"] == hi]
        for c in clip[-1:]:  # clipped as the loop clipped
            getattr(nn.utils, c.info["kind"])(ref.parameters(), *c.info["args"], **c.info["kwargs"])
        pairs = [(g, p.grad) for g, p in zip(e.info["grads"], ref.parameters()) if p.grad is not None]
        user = torch.cat([(torch.zeros_like(r) if g is None else g).flatten().float() for g, r in pairs])
        want = torch.cat([r.flatten().float() for _, r in pairs])
        if want.norm() == 0 or not torch.isfinite(user).all():
            continue
        ratio = (user.norm() / want.norm()).item()
        cos = F.cosine_similarity(user, want, dim=0).item()
        worst = max(worst, ((user - want).norm() / want.norm()).item())
        n += 1
        if hi - lo > 1 and cos > 0.95 and abs(ratio - 1) > 0.15:  # the right direction, the wrong size
            _adder(found)("loss_not_divided", ratio=ratio, n=hi - lo, by=(hi - lo) / ratio)
    return found, (
        f"gradient check: {n} optimizer steps compared with a plain fp32 loop on the same batches; "
        f"largest relative difference {worst:.1%}"
        if n
        else "gradient check: no optimizer step to compare"
    )


def diagnose(
    train: Callable,
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    scaler: torch.amp.GradScaler | None,
    batches: Sequence,
    *,
    loss_fn: Callable | None = None,
    accum_steps: int = 1,
) -> Report:
    """Chapter 05: run `train(model, optimizer, scaler, batches)` on copies, watch it, report the classic mistakes.

    `accum_steps`: the micro-batches per optimizer step your loop means to accumulate. With
    accum_steps > 1, one model and `loss_fn(output, target)`, each step's gradient is also
    compared with a plain fp32 loop's. Your objects and the global RNG are left as they were.
    """
    many_models = isinstance(model, (list, tuple))
    many_opts = isinstance(optimizer, (list, tuple))
    models = list(model) if many_models else [model]
    opts = list(optimizer) if many_opts else [optimizer]
    models_c, opts_c, scaler_c = copy.deepcopy((models, opts, scaler))  # one deepcopy: shared tensors stay shared
    for m in models_c:
        m.zero_grad(set_to_none=True)  # gradients left over in your notebook are not the loop's doing
    batches = list(batches)
    rng = rng_states()  # restored at the end: diagnosing leaves your RNG where it was
    check = accum_steps > 1 and loss_fn is not None and len(models) == 1 and len(opts) == 1
    rec = Recorder(models_c, opts_c, scaler_c, train, snapshots=check)
    enabled = scaler_c is not None and scaler_c.is_enabled()
    found = _low_precision_parameters(models)
    _run_watched(
        rec,
        train,
        tuple(models_c) if many_models else models_c[0],
        tuple(opts_c) if many_opts else opts_c[0],
        scaler_c,
        batches,
    )
    notes: list[str] = []
    found = {**_analyse(rec, enabled, accum_steps, notes), **found}
    if check and rec.error is None:
        grads, note = _grad_check(rec, models[0], batches, loss_fn)
        found = {**grads, **found}
        notes = [note, *notes]
    restore_rng_states(rng)
    scales = _scales(scaler, scaler_c)
    return Report(findings(found, rec.error), summary(rec.events, len(batches), scales), rec.events, notes)


# --------------------------------------------------------------------------- diagnose's instruments


def _low_precision_parameters(models: list[nn.Module]) -> dict:
    """The finding for parameters stored in 16 bits (autocast expects fp32 ones), or none."""
    low = sorted(
        {
            str(p.dtype).removeprefix("torch.")
            for m in models
            for p in m.parameters()
            if p.dtype in (torch.float16, torch.bfloat16)
        }
    )
    return {"fp16_params": SEEN["fp16_params"].format(dtypes=", ".join(low))} if low else {}


def _run_watched(rec: Recorder, train: Callable, model, optimizer, scaler, batches: list) -> None:
    """Run the loop under the recorder; what it warned and what it raised go on `rec` (they are diagnosis too)."""
    caught = []
    try:
        with rec, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(model, optimizer, scaler, batches)
    except Exception as e:  # the loop's own error is part of the diagnosis
        rec.error = e
    rec.warnings = [str(w.message) for w in caught]


def _scales(scaler: torch.amp.GradScaler | None, scaler_c: torch.amp.GradScaler | None) -> tuple | str:
    """Yours, untouched, and the copy's after the loop; or why there is no scale."""
    if scaler_c is not None and scaler_c.is_enabled():
        return (scaler.get_scale(), scaler_c.get_scale())
    return "no GradScaler" if scaler_c is None else "GradScaler disabled"
