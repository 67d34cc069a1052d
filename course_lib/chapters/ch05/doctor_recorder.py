"""The AMP doctor's recorder: a training loop's calls, each an Event with the autocast state.

Chapter 05 introduces the doctor (`course_lib.chapters.ch05.doctor`), chapter 09 completes it. `Recorder`
wraps the scaler's and optimizers' methods, `torch.autograd.backward` and `grad`, clipping and BCE, and
hooks the forwards, until exit; each call becomes an Event (backward: clean gradients? after a penalty's
autograd.grad, were its scaled gradients divided by the scale? step: the gradients, the scale). doctor.py
reads the Events for the classic mistakes; exercise 05's probe records a learner's loop with it.
"""

from __future__ import annotations

import functools
import types
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.chapters.ch05.doctor_catalog import Event

__all__: list[str] = []  # Recorder: the doctor's and exercise 05's probe's instrument, not a learner's
# (nor are rng_states and restore_rng_states, public for the doctor's replays)


class Recorder:
    """Records a training loop's calls as Events, patching torch functions until exit (not thread-safe).
    `snapshots=True` also keeps each step's gradients and parameters and each forward's input."""

    def __init__(
        self,
        models: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        scaler: torch.amp.GradScaler | None,
        fn: Callable | None = None,
        snapshots: bool = False,
    ):
        self.models = list(models)
        self.opts = list(optimizers)
        self.scaler = scaler
        self.fn = fn  # the training loop under diagnosis
        self.snapshots = snapshots  # keep each step's parameters and gradients (for the gradient check)
        self.in_scaler_step = False
        self.device_type = next((p.device.type for m in self.models for p in m.parameters()), "cpu")
        # every call seen; grad_fn (or tensor) of each scaler.scale() output; (input, RNG state) of each forward;
        # grad_fn id -> (grad_fn, scale) of each scaled gradient autograd.grad returned, until the next backward
        self.events: list = []  # every call the loop made, in order
        self.scaled: list = []  # the losses scaler.scale() returned
        self.forwards: list = []  # each forward's input and RNG state
        self.pending: dict = {}  # autograd.grad's scaled gradients not yet seen divided by the scale
        self.window_start = [0] * len(self.opts)  # forwards seen when each optimizer's current window began
        self._undo: list[Callable[[], None]] = []
        self.warnings: list[str] = []  # what the loop warned (diagnose fills it in)
        self.error: BaseException | None = None  # and what it raised

    def autocast_on(self) -> bool:
        return torch.is_autocast_enabled(self.device_type)

    def params(self, i: int) -> list[torch.Tensor]:
        return [p for g in self.opts[i].param_groups for p in g["params"]]

    def which(self, optimizer: object) -> int | None:
        return next((i for i, o in enumerate(self.opts) if o is optimizer), None)

    def clean(self, i: int) -> bool:
        return all(p.grad is None or not p.grad.any() for p in self.params(i))

    def _is_scaled(self, t: torch.Tensor) -> bool:
        ids = {id(s) for s in self.scaled}  # the nodes of the losses scaler.scale() returned
        todo = [t.grad_fn or t]
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
            had = name in vars(owner)
            old = vars(owner).get(name)
            setattr(owner, name, new)
            self._undo.append(lambda: setattr(owner, name, old) if had else delattr(owner, name))
            return
        space = owner if isinstance(owner, dict) else vars(owner)  # a module's or an object's own namespace
        had = name in space
        old = space.get(name)
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
            self._wrap(
                s,
                "unscale_",
                lambda optimizer: self.events.append(
                    Event(  # in_step: step's own call
                        "unscale_", self.which(optimizer), info={"in_step": self.in_scaler_step}
                    )
                ),
            )
            self._wrap(s, "step", self._on_scaler_step)
            self._wrap(s, "update", self._on_update)
        self._wrap(torch.autograd, "backward", self._on_backward)
        self._wrap(
            torch.optim.lr_scheduler.LRScheduler,
            "step",
            lambda sched, *a, **k: (
                None
                if not getattr(sched, "_step_count", 1)
                else self.events.append(Event("sched", self.which(sched.optimizer)))
            ),
        )  # 0: init
        self._wrap(
            torch,
            "save",
            lambda obj, *a, **k: self.events.append(
                Event(
                    "save",
                    info={
                        "checkpoint": _has_keys(obj, {"param_groups"}),
                        "scaler": _has_keys(obj, {"scale", "_growth_tracker"}),
                    },
                )
            ),
        )
        replaced = [
            (getattr(owner, name), self._wrap(owner, name, functools.partial(self._on_call, name)))
            for owner, name in (
                (nn.utils, "clip_grad_norm_"),
                (nn.utils, "clip_grad_value_"),
                (F, "binary_cross_entropy"),
                (torch.autograd, "grad"),
            )
        ]
        # the same functions under other names: in nn.utils.clip_grad, and `from ... import` in the loop's module
        fn = self.fn
        while isinstance(fn, functools.partial):
            fn = fn.func
        spaces = [vars(nn.utils.clip_grad)] if hasattr(nn.utils, "clip_grad") else []
        spaces += [g] if (g := getattr(getattr(fn, "__func__", fn), "__globals__", None)) is not None else []
        for space in spaces:
            for key, new in [(key, w) for key, value in space.items() for o, w in replaced if value is o]:
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
        self.forwards.append((None if x is None else x.detach().clone(), rng_states()))

    def _on_scale(self, outputs, *a, **k) -> Callable:
        def run(old: Callable):
            out = old(outputs, *a, **k)
            self.scaled += [t.grad_fn or t for t in _tensors(out)]
            return out

        return run

    def _on_scaler_step(self, optimizer, *a, **k) -> Callable:
        i = self.which(optimizer)
        self.events.append(
            Event(
                "scaler.step",
                i,
                self.autocast_on(),
                {"empty": i is not None and self.clean(i), "scale": self.scaler.get_scale()},
            )
        )
        event = self.events[-1]
        seen = len(self.events)  # the events before the step's own calls

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
        roots = _tensors(tensors)
        info = {
            "clean": [self.clean(i) for i in range(len(self.opts))],
            "scaled": all(map(self._is_scaled, roots)),
            "finite": all(bool(torch.isfinite(t.detach()).all()) for t in roots),
        }
        if self.pending:  # after a gradient penalty's autograd.grad: were its scaled gradients unscaled by hand?
            info["penalty_unscaled"] = _divided_by_scale(roots, self.pending)
            self.pending = {}
        self.events.append(Event("backward", None, self.autocast_on(), info))

    def _on_grad(self, *args, **kwargs) -> Callable:
        outputs = _tensors(args[0] if args else kwargs.get("outputs"))
        scaled = bool(outputs) and all(map(self._is_scaled, outputs))
        self.events.append(
            Event(
                "grad",
                None,
                self.autocast_on(),
                {"scaled": scaled, "finite": all(bool(torch.isfinite(t.detach()).all()) for t in outputs)},
            )
        )
        scale = self.scaler.get_scale() if scaled and self.scaler is not None and self.scaler.is_enabled() else None

        def run(old: Callable):
            grads = old(*args, **kwargs)
            if scale:  # the next backward tells where these scaled gradients went (_on_backward)
                self.pending.update({id(g.grad_fn): (g.grad_fn, scale) for g in _tensors(grads) if g.grad_fn})
            return grads

        return run

    def _on_call(self, name: str, *args, **kwargs) -> Callable | None:
        if name == "grad":
            return self._on_grad(*args, **kwargs)
        if name == "binary_cross_entropy":  # returns None: the call goes on as it was
            return self.events.append(Event("bce", None, self.autocast_on()))
        params = args[0] if args else kwargs.pop("parameters")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        owners = sorted({i for i in range(len(self.opts)) for p in params if any(p is q for q in self.params(i))})
        self.events.append(
            Event(
                "clip",
                None,
                self.autocast_on(),
                {
                    "owners": owners,
                    "kind": name,
                    "args": args[1:],
                    "kwargs": dict(kwargs),
                    "forwards": len(self.forwards),
                },
            )
        )
        return lambda old: old(params, *args[1:], **kwargs)


def rng_states() -> tuple[torch.Tensor, list | None]:
    """The CPU generator's state and every CUDA generator's (None without CUDA): what a forward's dropout draws."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def restore_rng_states(state: tuple[torch.Tensor, list | None]) -> None:
    """Put back what rng_states() returned, so that a forward replays with the same dropout masks."""
    torch.set_rng_state(state[0])
    if state[1] is not None:  # dropout on CUDA draws from the CUDA generators
        torch.cuda.set_rng_state_all(state[1])


def _has_keys(x: object, keys: set[str], depth: int = 4) -> bool:
    """Is there a dict holding all of `keys` in x (dicts and lists, a few levels deep)?"""
    if isinstance(x, dict):
        return keys <= set(x) or (depth > 0 and any(_has_keys(v, keys, depth - 1) for v in x.values()))
    return isinstance(x, (list, tuple)) and depth > 0 and any(_has_keys(v, keys, depth - 1) for v in x)


def _divided_by_scale(roots: list[torch.Tensor], pending: dict[int, tuple]) -> bool:
    """In the graph of `roots` (chapter 05), is each of autograd.grad's scaled gradients (`pending`) used only
    multiplied by 1 / scale (or divided by the scale), as the AMP examples page's gradient penalty does?"""
    # `seen` holds the visited nodes themselves, not only their id(): before torch 2.13 a node's Python
    # wrapper is freed once nothing holds it, and the next wrapper next_functions makes can reuse its
    # address, so an id-only set took unvisited nodes for seen and missed the penalty's edge.
    todo = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen: dict[int, object] = {}
    while todo and len(seen) < 100_000:
        if id(node := todo.pop()) not in seen:
            seen[id(node)] = node
            nxt = [n for n, _ in node.next_functions if n is not None]
            if any(id(n) in pending and not _times(node, 1 / pending[id(n)][1]) for n in nxt):
                return False
            todo += nxt
    return True


def _times(node: object, factor: float) -> bool:
    """Is the autograd node a multiplication by the constant `factor`, or a division by 1 / factor?"""
    name = type(node).__name__
    other = getattr(node, "_saved_other", None)
    ok = name.startswith(("MulBackward", "DivBackward")) and all(n is None for n, _ in node.next_functions[1:])
    try:  # `other`: one number, a Python one or a tensor of one element
        return ok and abs((float(other) if name[0] == "M" else 1 / float(other)) / factor - 1) < 1e-3
    except (TypeError, ValueError, RuntimeError, ZeroDivisionError):
        return False


def _tensors(x: object) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in (x or ()) for t in _tensors(item)] if isinstance(x, (list, tuple)) else []
