"""A training step's memory, walked through backward and measured: the MLP (chapters 02 and 10).

Chapter 02 asks why autocast *raises* the peak of a weight-heavy MLP's step; this module answers
with a prediction and a measurement (chapter 10 measures every step it predicts with the second):

- `mlp_moments` predicts the bytes the step holds at each moment of its backward pass, walked op
  by op from what each layer saves (no fitted constant): the peak is the largest moment.
- `tracked_peak` measures a step with PyTorch's own tracker,
  `torch.distributed._tools.mem_tracker.MemTracker`, under `FakeTensorMode`: the tensors have
  shapes and dtypes but no data, so nothing is computed or allocated and a 12 GiB step is measured
  on a laptop CPU in seconds. The second step is measured (the first, untracked, makes the
  optimizer's state).

What fake tensors cannot run: anything that needs a value (`fake=False` runs real tensors instead:
small sizes only); a GradScaler's step reads found_inf, so on fake tensors it is always taken.
CPU autocast's op lists are CPU's, not CUDA's.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.device import AMP_DTYPES
from course_lib.models import MLP

__all__ = ["tracked_peak", "mlp_moments", "measured_mlp"]


def tracked_peak(
    build: Callable[[], nn.Module],
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    optimizer: Callable[[nn.Module], torch.optim.Optimizer | None],
    precision: str = "fp32",
    step_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[object, torch.Tensor]] | None = None,
    steps: int = 2,
    scaler: bool = False,
    fake: bool = True,
) -> dict[str, int]:
    """Chapters 02, 10: MemTracker's peak, in bytes by category ("Total" too), of a training step on
    a CPU: the last of `steps` steps, the ones before run untracked (they make the optimizer's
    state). `step_loss(model, x, y)` returns (what the loop holds, the loss); by default a
    classifier's cross-entropy, the loop holding nothing else. `optimizer` may return None: forward
    and backward only. `scaler`: the fp16 recipe's GradScaler around backward and step (on fake
    tensors its step is always taken: it cannot read found_inf, and with no overflow a real one is)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    dtype = AMP_DTYPES[precision]
    step_loss = step_loss or _cross_entropy
    with FakeTensorMode() if fake else contextlib.nullcontext():
        model = build()
        opt = optimizer(model)
        x, y = batch()
        grad_scaler = (_StepTaken if fake else torch.amp.GradScaler)("cpu", enabled=scaler)
        last: list = [None]  # what the loop holds, replaced when the next step's forward returns

        def one_step() -> None:
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                last[0] = step_loss(model, x, y)
            grad_scaler.scale(last[0][1]).backward()
            if opt is None:
                model.zero_grad(set_to_none=True)
                return
            grad_scaler.step(opt)
            grad_scaler.update()
            opt.zero_grad(set_to_none=True)

        for _ in range(steps - 1):
            one_step()
        tracker = MemTracker()
        # made before the tracker started, so it is told about them: the model, the optimizer's state,
        # what it steps that is not the model's (fp32 master weights, chapter 10), what the loop holds
        in_model = {id(t) for t in model.parameters()}
        masters = [t for group in opt.param_groups for t in group["params"] if id(t) not in in_model] if opt else []
        held = [t for t in (last[0] or ()) if isinstance(t, torch.Tensor)]
        tracker.track_external(model, *([opt] if opt else []), *masters, *held)
        del held
        with tracker:
            one_step()
        peak = tracker.get_tracker_snapshot("peak")
    by_kind = next(iter(peak.values()))
    return {getattr(kind, "value", kind): n for kind, n in by_kind.items()}


class _StepTaken(torch.amp.GradScaler):
    """A GradScaler for fake tensors: its step is taken without reading found_inf (.item())."""

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):  # type: ignore[override]
        return optimizer.step(*args, **kwargs)


def _cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[None, torch.Tensor]:
    return None, F.cross_entropy(model(x), y)


def mlp_moments(
    width: int, depth: int, batch: int, precision: str = "fp32", classes: int = 10, in_features: int | None = None
) -> dict[str, int]:
    """Chapters 02, 10: the bytes the course's MLP step holds at each moment of its backward pass
    (SGD, no state), walked op by op; the peak is the largest. Where an MLP's weights dominate, the
    peak is in the first Linear's backward (its 16-bit weight gradient cast to the fp32 .grad beside
    the later layers' gradients); where its activations dominate, in the last ReLU's backward."""
    p = 2 if precision in ("bf16", "fp16") else 4
    amp = p == 2
    first = in_features or width
    shapes = [(first, width)] + [(width, width)] * (depth - 1) + [(width, classes)]  # (in, out) per Linear
    params = 4 * sum(i * o + o for i, o in shapes)
    # Linear k saves its input: for k > 0 the ReLU output before it (which that ReLU saves too), for
    # k = 0 under autocast a 16-bit copy of the batch (in fp32 the batch itself: nothing new). Under
    # autocast it saves its 16-bit weight copy too, except the first: only the input's gradient needs
    # the weight, and the batch has none.
    saved_in = [batch * i * p if (k > 0 or amp) else 0 for k, (i, o) in enumerate(shapes)]
    copy = [i * o * 2 if amp and k > 0 else 0 for k, (i, o) in enumerate(shapes)]
    moments = {"end of forward": params + sum(saved_in) + sum(copy) + batch * classes * 4}
    grads = 0
    grad_out = batch * classes * 4  # d loss / d logits, fp32 out of log_softmax's backward
    for k in reversed(range(len(shapes))):
        i, o = shapes[k]
        earlier = sum(saved_in[:k]) + sum(copy[:k])  # what the earlier layers still hold
        grad_in = batch * i * p if k > 0 else 0  # the batch needs no gradient
        grad_w = i * o * p
        inside = params + grads + earlier + saved_in[k] + copy[k] + grad_out + grad_in + grad_w
        cast = params + grads + earlier + grad_in + grad_w + (4 * i * o if amp else 0)  # to the fp32 .grad
        moments[f"Linear {k} backward"] = max(inside, cast)
        grads += 4 * (i * o + o)
        grad_out = grad_in
        if k > 0:  # ReLU k-1: its output (Linear k's input) still saved; the gradient in and out
            moments[f"ReLU {k - 1} backward"] = params + grads + earlier + saved_in[k] + 2 * grad_in
    moments["optimizer step"] = params + grads
    return moments


def measured_mlp(width: int, depth: int, batch: int, precision: str = "fp32") -> dict[str, int]:
    """Chapters 02, 10: tracked_peak of the course's MLP (width x depth, 10 classes), plain SGD."""
    return tracked_peak(
        lambda: MLP(in_features=width, hidden=width, depth=depth),
        lambda: (torch.randn(batch, width), torch.randint(0, 10, (batch,))),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        precision,
    )
