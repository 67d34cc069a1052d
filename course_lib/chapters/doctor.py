"""The AMP doctor: run your training loop under instrumentation and name the classic mistakes.

Chapter 05 introduces it; chapter 09 completes it. It watches what your loop *does*:

    print(diagnose(train, model, optimizer, scaler, batches, loss_fn=F.cross_entropy, accum_steps=4))

`train(model, optimizer, scaler, batches)` is your loop over `batches` (a list of (x, y));
`model` and `optimizer` may be tuples. It runs on deep copies, with the scaler's and the
optimizers' methods, `torch.autograd.backward`, gradient clipping and BCE wrapped and the
forwards hooked: each call is recorded with the autocast state, each backward with whether
the gradients were clean, each step with the gradients it sees; scheduler steps, torch.save
and warnings too. The catalogue of mistakes (titles, fixes, chapters) is doctor_catalog.py. With `accum_steps > 1`, one
model and `loss_fn`, a plain fp32 loop recomputes each step's gradient on the same batches.
"""
from __future__ import annotations

import copy
import functools
import textwrap
import types
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .doctor_catalog import ERRORS, PROBLEMS

__all__ = ["Finding", "Report", "diagnose"]

WIDTH = 100

@dataclass(eq=False)
class Event:
    """One call the doctor saw: what, for which optimizer (or model), autocast on or off, details."""
    kind: str
    index: int | None = None
    autocast: bool = False
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Finding:
    """Chapter 05: one mistake the doctor found: what, what it saw, how to fix it, where it is taught."""
    code: str
    title: str
    seen: str
    fix: str
    chapter: str

    def __str__(self) -> str:
        head = f"✗ {self.title}" + (f"  (chapter {self.chapter})" if self.chapter else "")
        body = [f"  seen: {self.seen}"] + ([f"  fix:  {self.fix}"] if self.fix else [])
        return "\n".join([textwrap.fill(head, WIDTH, subsequent_indent="  ")]
                         + [textwrap.fill(b, WIDTH, subsequent_indent=" " * 8) for b in body])


@dataclass
class Report:
    """Chapter 05: what diagnose() found, and what it watched."""
    findings: list[Finding]
    summary: str
    events: list[Event]
    notes: list[str] = field(default_factory=list)

    @property
    def codes(self) -> list[str]:
        return [f.code for f in self.findings]

    def __str__(self) -> str:
        ok = [] if self.findings else ["✓ none of the classic AMP mistakes the doctor knows was found"]
        return "\n".join([textwrap.fill(self.summary, WIDTH, subsequent_indent="  "), *ok, *map(str, self.findings),
                          *(textwrap.fill(f"note: {n}", WIDTH, subsequent_indent="  ") for n in self.notes)])


class Recorder:
    """Records a training loop's calls as Events, patching torch functions until exit (not thread-safe).
    `snapshots=True` also keeps each step's gradients and parameters and each forward's input."""

    def __init__(self, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                 scaler: torch.amp.GradScaler | None, fn: Callable | None = None, snapshots: bool = False):
        self.models, self.opts, self.scaler, self.fn = list(models), list(optimizers), scaler, fn
        self.snapshots, self.in_scaler_step = snapshots, False
        self.device_type = next((p.device.type for m in self.models for p in m.parameters()), "cpu")
        # every call seen; grad_fn (or tensor) of each scaler.scale() output; (input, RNG state) of each forward
        self.events, self.scaled, self.forwards = [], [], []
        self.window_start = [0] * len(self.opts)  # forwards seen when each optimizer's current window began
        self._undo: list[Callable[[], None]] = []
        self.warnings: list[str] = []  # the warnings the loop raised (diagnose records them)

    def autocast_on(self) -> bool:
        return torch.is_autocast_enabled(self.device_type)

    def params(self, i: int) -> list[torch.Tensor]:
        return [p for g in self.opts[i].param_groups for p in g["params"]]

    def which(self, optimizer: object) -> int | None:
        return next((i for i, o in enumerate(self.opts) if o is optimizer), None)

    def clean(self, i: int) -> bool:
        return all(p.grad is None or not p.grad.any() for p in self.params(i))

    def _is_scaled(self, t: torch.Tensor) -> bool:
        ids, todo = {id(s) for s in self.scaled}, [t.grad_fn or t]
        for _ in range(300):  # the scaled node sits near the root: a short search suffices
            if not todo:
                return False
            node = todo.pop(0)
            if id(node) in ids:
                return True
            todo += [n for n, _ in getattr(node, "next_functions", ()) if n is not None]
        return False

    def _set(self, owner: object, name: str, new: Callable) -> None:
        if isinstance(owner, type):  # a class (the schedulers' base): patched for every instance
            had, old = name in vars(owner), vars(owner).get(name)
            setattr(owner, name, new)
            self._undo.append(lambda: setattr(owner, name, old) if had else delattr(owner, name))
            return
        space = owner if isinstance(owner, dict) else vars(owner)  # a module's or an object's own namespace
        had, old = name in space, space.get(name)
        space[name] = new
        self._undo.append(lambda: space.__setitem__(name, old) if had else space.pop(name))

    def _wrap(self, owner: object, name: str, before: Callable) -> Callable:
        old = getattr(owner, name)

        @functools.wraps(old)
        def wrapper(*args, **kwargs):
            out = before(*args, **kwargs)
            return old(*args, **kwargs) if out is None else out(old)
        if getattr(old, "__self__", None) is owner and not isinstance(owner, type):  # a method stays bound:
            self._set(owner, name, types.MethodType(lambda _, *a, **k: wrapper(*a, **k), owner))  # LR schedulers
            return wrapper  # read optimizer.step.__func__
        self._set(owner, name, wrapper)
        return wrapper

    def __enter__(self) -> Recorder:
        for i, opt in enumerate(self.opts):
            self._wrap(opt, "step", functools.partial(self._on_step, i))
            self._wrap(opt, "zero_grad", lambda *a, i=i, **k: self.events.append(Event("zero_grad", i)))
        for i, m in enumerate(self.models):
            h = m.register_forward_pre_hook(functools.partial(self._on_forward, i))
            self._undo.append(h.remove)
        s = self.scaler
        if s is not None:
            self._wrap(s, "scale", self._on_scale)
            self._wrap(s, "unscale_", lambda optimizer: self.events.append(Event("unscale_", self.which(optimizer))))
            self._wrap(s, "step", self._on_scaler_step)
            self._wrap(s, "update", self._on_update)
        self._wrap(torch.autograd, "backward", self._on_backward)
        self._wrap(torch.optim.lr_scheduler.LRScheduler, "step", lambda *a, **k: self.events.append(Event("sched")))
        self._wrap(torch, "save", lambda obj, *a, **k: self.events.append(Event("save", info={
            "checkpoint": _has_keys(obj, {"param_groups"}), "scaler": _has_keys(obj, {"scale", "_growth_tracker"})})))
        replaced = [(getattr(owner, name), self._wrap(owner, name, functools.partial(self._on_call, name)))
                    for owner, name in ((nn.utils, "clip_grad_norm_"), (nn.utils, "clip_grad_value_"),
                                        (F, "binary_cross_entropy"))]
        # the same functions under other names: in nn.utils.clip_grad, and `from ... import` in the loop's module
        fn = self.fn
        while isinstance(fn, functools.partial):
            fn = fn.func
        spaces = [vars(nn.utils.clip_grad)] if hasattr(nn.utils, "clip_grad") else []
        spaces += [g] if (g := getattr(getattr(fn, "__func__", fn), "__globals__", None)) is not None else []
        for space in spaces:
            for key, value in list(space.items()):
                new = next((w for o, w in replaced if value is o), None)
                if new is not None:
                    self._set(space, key, new)
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()

    def _on_step(self, i: int, *args, **kwargs) -> None:
        info: dict = {"via_scaler": self.in_scaler_step, "forwards": len(self.forwards), "start": self.window_start[i]}
        if not self.in_scaler_step:
            self.window_start[i] = len(self.forwards)
        if self.snapshots:  # model 0's parameters and gradients, in the model's order
            info["grads"] = [None if p.grad is None else p.grad.detach().clone() for p in self.models[0].parameters()]
            info["params"] = [p.detach().clone() for p in self.models[0].parameters()]
        self.events.append(Event("step", i, self.autocast_on(), info))

    def _on_forward(self, i: int, module: nn.Module, args: tuple) -> None:
        on = self.autocast_on()
        dtype = torch.get_autocast_dtype(self.device_type) if on else None
        self.events.append(Event("forward", i, on, {"dtype": dtype}))
        x = args[0] if args and isinstance(args[0], torch.Tensor) and self.snapshots else None
        self.forwards.append((None if x is None else x.detach().clone(), _rng_state()))

    def _on_scale(self, outputs, *a, **k) -> Callable:
        def run(old: Callable):
            out = old(outputs, *a, **k)
            self.scaled += [t.grad_fn or t for t in _tensors(out)]
            return out
        return run

    def _on_scaler_step(self, optimizer, *a, **k) -> Callable:
        i = self.which(optimizer)
        self.events.append(Event("scaler.step", i, self.autocast_on(), {"empty": i is not None and self.clean(i)}))

        event, seen = self.events[-1], len(self.events)

        def run(old: Callable):
            self.in_scaler_step = True
            try:
                return old(optimizer, *a, **k)
            finally:
                self.in_scaler_step = False
                event.info["skipped"] = not any(e.kind == "step" for e in self.events[seen:])
                if i is not None:
                    self.window_start[i] = len(self.forwards)
        return run

    def _on_update(self, *a, **k) -> None:
        self.events.append(Event("update", None, self.autocast_on()))
        self.scaled.clear()  # every backward of the iteration is done: let its graphs go

    def _on_backward(self, tensors, *a, **k) -> None:
        self.events.append(Event("backward", None, self.autocast_on(), {
            "clean": [self.clean(i) for i in range(len(self.opts))],
            "scaled": all(map(self._is_scaled, _tensors(tensors))),
            "finite": all(bool(torch.isfinite(t.detach()).all()) for t in _tensors(tensors))}))

    def _on_call(self, name: str, *args, **kwargs) -> Callable | None:
        if name == "binary_cross_entropy":  # returns None: the call goes on as it was
            return self.events.append(Event("bce", None, self.autocast_on()))
        params = args[0] if args else kwargs.pop("parameters")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        owners = sorted({i for i in range(len(self.opts)) for p in params if any(p is q for q in self.params(i))})
        self.events.append(Event("clip", None, self.autocast_on(), {
            "owners": owners, "kind": name, "args": args[1:], "kwargs": dict(kwargs), "forwards": len(self.forwards)}))
        return lambda old: old(params, *args[1:], **kwargs)


def _rng_state() -> tuple[torch.Tensor, list | None]:
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def _set_rng_state(state: tuple[torch.Tensor, list | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:  # dropout on CUDA draws from the CUDA generators
        torch.cuda.set_rng_state_all(state[1])


def _has_keys(x: object, keys: set[str], depth: int = 4) -> bool:
    """Is there a dict holding all of `keys` in x (dicts and lists, a few levels deep)?"""
    if isinstance(x, dict):
        return keys <= set(x) or (depth > 0 and any(_has_keys(v, keys, depth - 1) for v in x.values()))
    return isinstance(x, (list, tuple)) and depth > 0 and any(_has_keys(v, keys, depth - 1) for v in x)


def _tensors(x: object) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in (x or ()) for t in _tensors(item)] if isinstance(x, (list, tuple)) else []


def _analyse(rec: Recorder, enabled: bool, accum: int) -> dict[str, str]:
    """code -> what was seen, for every mistake the events show."""
    ev, found = rec.events, {}

    add = found.setdefault
    kind = lambda k: [e for e in ev if e.kind == k]  # noqa: E731
    backs, fwd = kind("backward"), [e for e in kind("forward") if e.index == 0]
    boundary = [e for e in ev if e.kind == "scaler.step" or (e.kind == "step" and not e.info["via_scaler"])]
    if n := sum(e.autocast for e in backs):
        add("backward_in_autocast", f"{n} of {len(backs)} backward() calls ran with autocast on")
    if n := sum(e.autocast for e in boundary):
        add("step_in_autocast", f"{n} of {len(boundary)} optimizer steps ran with autocast on")
    if n := sum(e.autocast for e in kind("bce")):
        add("bce_in_autocast", f"F.binary_cross_entropy was called {n} times with autocast on")
    if enabled and fwd and not any(e.autocast for e in kind("forward")):
        add("no_autocast", f"{len(kind('forward'))} forward passes, none of them under autocast")
    if enabled and (n := sum(not e.info["scaled"] for e in backs)):
        add("not_scaled", f"{n} of {len(backs)} backward() calls started from a loss scaler.scale() never saw")
    if enabled and (direct := [e for e in kind("step") if not e.info["via_scaler"]]):
        add("step_without_scaler", f"optimizer {direct[0].index}'s step() was called {len(direct)} times directly")
    if n := sum(e.info["empty"] for e in kind("scaler.step")):
        add("empty_step", f"{n} scaler.step() calls found every gradient of their optimizer zero")
    _analyse_chapter_09(rec, enabled, found)
    n = len(rec.opts)
    updates, start, zeroed, stepped, unscaled = 0, [0] * n, [False] * n, [False] * n, set()
    since_update = since_step = window = 0  # forwards since the last update / step of optimizer 0; backwards
    for e in ev:
        if e.kind == "forward" and e.index == 0:
            since_update, since_step = since_update + 1, since_step + 1
        elif e.kind == "backward":
            if accum > 1 and e.info["clean"][0] and window:
                add("zero_grad_in_window", f"clean gradients at a backward() after {window} in the same window")
            for i, clean in enumerate(e.info["clean"]):
                if clean:
                    start[i], zeroed[i] = updates, True
            window += 1
        elif e.kind == "zero_grad":
            zeroed[e.index] = True
        elif e.kind == "update":
            if enabled and accum > 1 and since_update < accum:
                add("update_per_microstep", f"update() after {since_update} micro-batch(es); accum_steps = {accum}")
            updates, since_update = updates + 1, 0
            unscaled.clear()
        elif e.kind == "clip" and enabled and (bad := [i for i in e.info["owners"] if i not in unscaled]):
            add("clip_before_unscale", f"{e.info['kind']} ran on optimizer {bad[0]}'s parameters before "
                                       f"scaler.unscale_() in {'that' if updates else 'the first'} iteration")
        i = e.index
        if e.kind in ("unscale_", "scaler.step") and i is not None and i not in unscaled:
            if enabled and zeroed[i] and start[i] < updates:  # scaled before an update, unscaled after it
                add("update_between_steps", f"optimizer {i}'s gradients were scaled before an update() and "
                                            "unscaled after it")
            unscaled.add(i)
        if e in boundary and i is not None:
            if stepped[i] and not zeroed[i]:
                add("missing_zero_grad", f"optimizer {i} stepped again with no zero_grad() (and no clean "
                                         "gradients) since its previous step")
            if i == 0 and accum > 1 and since_step < accum:
                add("step_per_microstep", f"a step after {since_step} micro-batch(es); accum_steps = {accum}")
            stepped[i], zeroed[i] = True, False
            since_step, window = (0, 0) if i == 0 else (since_step, window)
            unscaled.add(i)
    return found


def _analyse_chapter_09(rec: Recorder, enabled: bool, found: dict[str, str]) -> None:
    """The mistakes chapter 09 adds: a non-finite loss, a collapsing scale, the scheduler on skipped
    steps, a scaler beside bf16, deprecated spellings, checkpoints without the scaler."""
    ev, add = rec.events, found.setdefault
    backs, steps = [e for e in ev if e.kind == "backward"], [e for e in ev if e.kind == "scaler.step"]
    if n := sum(not e.info["finite"] for e in backs):
        add("nonfinite_loss", f"{n} of {len(backs)} backward() calls started from an inf/NaN loss")
    streak = next((k for k, e in enumerate(reversed(steps)) if not e.info.get("skipped")), len(steps))
    if enabled and streak >= 5:
        add("scale_collapsing", f"the last {streak} of {len(steps)} scaler.step() calls were all skipped; the "
                                f"scale ended at {rec.scaler.get_scale():g}")
    after_skip, last = 0, None  # scheduler steps that came after a skipped step, before the next forward
    for e in ev:
        last = e if e.kind == "scaler.step" else None if e.kind == "forward" else last
        after_skip += e.kind == "sched" and last is not None and last.info.get("skipped", False)
    if after_skip:
        add("scheduler_on_skipped_step", f"scheduler.step() followed {after_skip} of the "
                                         f"{sum(e.info.get('skipped', False) for e in steps)} skipped steps")
    dtypes = {e.info["dtype"] for e in ev if e.kind == "forward" and e.autocast}
    if enabled and dtypes == {torch.bfloat16}:
        add("scaler_with_bf16", f"an enabled GradScaler beside {sum(e.kind == 'forward' for e in ev)} bf16 forwards")
    old = [w for w in rec.warnings if "deprecated" in w and ("torch.cuda.amp" in w or "torch.cpu.amp" in w)]
    if old or type(rec.scaler).__module__.startswith("torch.cuda.amp"):
        add("deprecated_amp_api", old[0].split(" is deprecated")[0] + " is deprecated" if old else
            "the scaler is a torch.cuda.amp.GradScaler")
    saves = [e for e in ev if e.kind == "save" and e.info["checkpoint"]]
    if enabled and (n := sum(not e.info["scaler"] for e in saves)):
        add("checkpoint_without_scaler", f"{n} of {len(saves)} torch.save() calls of a training checkpoint (it holds "
                                         "an optimizer state) had no scaler state in it")


def _grad_check(rec: Recorder, model: nn.Module, batches: list, loss_fn: Callable) -> tuple[dict, str]:
    """Compare each optimizer step's gradient with a plain fp32 loop's on the same batches, same parameters."""
    ref, found, worst, n = copy.deepcopy(model), {}, 0.0, 0
    for e in (e for e in rec.events if e.kind == "step" and e.index == 0):
        lo, hi = e.info["start"], e.info["forwards"]
        xs = [rec.forwards[j][0] for j in range(lo, hi)]
        if not xs or hi > len(batches) or any(x is None or x.shape != batches[j][0].shape
                                             or not torch.equal(x.cpu(), batches[j][0].cpu())
                                             for j, x in zip(range(lo, hi), xs)):
            return found, "gradient check skipped: the forwards did not see the batches in their order"
        with torch.no_grad():
            for p, q in zip(ref.parameters(), e.info["params"]):
                p.copy_(q)
        ref.zero_grad(set_to_none=True)
        samples = sum(len(batches[j][1]) for j in range(lo, hi))  # the mean over all the window's samples
        for j, x in zip(range(lo, hi), xs):
            _set_rng_state(rec.forwards[j][1])  # the same dropout masks as the loop's forward
            (loss_fn(ref(x), batches[j][1].to(x.device)) * len(batches[j][1]) / samples).backward()
        clip = [c for c in rec.events[:rec.events.index(e)] if c.kind == "clip" and c.info["forwards"] == hi]
        for c in clip[-1:]:  # clipped as the loop clipped
            getattr(nn.utils, c.info["kind"])(ref.parameters(), *c.info["args"], **c.info["kwargs"])
        pairs = [(g, p.grad) for g, p in zip(e.info["grads"], ref.parameters()) if p.grad is not None]
        user = torch.cat([(torch.zeros_like(r) if g is None else g).flatten().float() for g, r in pairs])
        want = torch.cat([r.flatten().float() for _, r in pairs])
        if want.norm() == 0 or not torch.isfinite(user).all():
            continue
        ratio, cos = (user.norm() / want.norm()).item(), F.cosine_similarity(user, want, dim=0).item()
        worst, n = max(worst, ((user - want).norm() / want.norm()).item()), n + 1
        if hi - lo > 1 and cos > 0.95 and abs(ratio / (hi - lo) - 1) < 0.15:
            found.setdefault("loss_not_divided", f"the gradient at an optimizer step was {ratio:.2f} times a correct "
                                                 f"loop's on the same {hi - lo} micro-batches")
    return found, (f"gradient check: {n} optimizer steps compared with a plain fp32 loop on the same batches; "
                   f"largest relative difference {worst:.1%}" if n else "gradient check: no optimizer step to compare")


def diagnose(train: Callable, model: nn.Module | Sequence[nn.Module],
             optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
             scaler: torch.amp.GradScaler | None, batches: Sequence, *, loss_fn: Callable | None = None,
             accum_steps: int = 1) -> Report:
    """Chapter 05: run `train(model, optimizer, scaler, batches)` on copies, watch it, report the classic mistakes.

    `accum_steps`: the micro-batches per optimizer step your loop means to accumulate. With
    accum_steps > 1, one model and `loss_fn(output, target)`, each step's gradient is also
    compared with a plain fp32 loop's. Your objects and the global RNG are left as they were.
    """
    many_models, many_opts = isinstance(model, (list, tuple)), isinstance(optimizer, (list, tuple))
    models, opts = list(model) if many_models else [model], list(optimizer) if many_opts else [optimizer]
    models_c, opts_c, scaler_c = copy.deepcopy((models, opts, scaler))
    for m in models_c:
        m.zero_grad(set_to_none=True)  # gradients left over in your notebook are not the loop's doing
    batches, rng, error = list(batches), _rng_state(), None
    caught: list = []
    check = accum_steps > 1 and loss_fn is not None and len(models) == 1 and len(opts) == 1
    rec = Recorder(models_c, opts_c, scaler_c, train, snapshots=check)
    enabled = scaler_c is not None and scaler_c.is_enabled()
    low = sorted({str(p.dtype).removeprefix("torch.") for m in models for p in m.parameters()
                  if p.dtype in (torch.float16, torch.bfloat16)})
    found = {"fp16_params": f"parameters of dtype {', '.join(low)} before the loop ran"} if low else {}
    try:
        with rec, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(tuple(models_c) if many_models else models_c[0], tuple(opts_c) if many_opts else opts_c[0],
                  scaler_c, batches)
    except Exception as e:  # the loop's own error is part of the diagnosis
        error = e
    rec.warnings = [str(w.message) for w in caught]
    found = {**_analyse(rec, enabled, accum_steps), **found}
    notes = []
    if check and error is None:
        grads, note = _grad_check(rec, models[0], batches, loss_fn)
        found, notes = {**grads, **found}, [note]
    _set_rng_state(rng)
    findings = [Finding(c, PROBLEMS[c][0], found[c], *PROBLEMS[c][1:]) for c in PROBLEMS if c in found]
    if error is not None:
        text = f"{type(error).__name__}: " + " ".join(str(error).split()).split(". ")[0]  # its first sentence
        meaning = next((m for key, m in ERRORS if key in str(error)), "")
        findings.append(Finding("raised", f"your loop raised {type(error).__name__}", text[:300], meaning, ""))
    ev = rec.events
    count = lambda k: sum(e.kind == k for e in ev)  # noqa: E731
    skips = count("scaler.step") - sum(e.kind == "step" and e.info["via_scaler"] for e in ev)
    dtypes = sorted({str(e.info["dtype"]).removeprefix("torch.") for e in ev if e.kind == "forward" and e.autocast})
    scale = (f"; scale {scaler.get_scale():g} -> {scaler_c.get_scale():g}" if enabled
             else "; no GradScaler" if scaler_c is None else "; GradScaler disabled")
    summary = (f"the doctor ran your loop on copies over {len(batches)} batches: {count('forward')} forward, "
               f"{count('backward')} backward, {count('step')} optimizer steps ({skips} skipped by the scaler); "
               f"autocast {', '.join(dtypes) or 'never on'}{scale}")
    return Report(findings, summary, ev, notes)
