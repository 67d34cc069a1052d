"""Chapter 10's one entry point: a training step, described, and its memory predicted moment by moment.

`Step` describes a step the course's models can take: the model and its shape, the batch, the
precision recipe, the optimizer and its implementation, checkpointing, the attention kind and the
device. `predict_step` writes its forward pass down as a tape (course_lib.chapters.ch10.tapes),
walks it (course_lib.chapters.ch10.memory_model.walk) and adds what the optimizer holds and makes:

- SGD holds nothing more, SGD with momentum one buffer a parameter, AdamW two moments and a step
  counter per tensor, in the dtype of what it steps;
- AdamW's step makes temporaries: the for-loop implementation (PyTorch's default on a CPU) two
  tensors the size of one parameter (`exp_avg_sq.sqrt()` and its division) beside the previous
  one's `denom`, foreach (CUDA's default) one list the size of all parameters, fused none;
- with fp32 master weights (`MasterWeightsAdamW`) the step first copies each bf16 gradient to an
  fp32 one, releasing the bf16 one, then steps the masters.

An option it does not model raises ValueError, saying what it does model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from course_lib.chapters.ch10.memory_model import Held, Walk, totals_by_category, walk
from course_lib.chapters.ch10.tapes import gpt_tape, mlp_tape, resnet50_tape, simplecnn_tape
from course_lib.models import GPTConfig

__all__ = ["MODELS", "PRECISIONS", "OPTIMIZERS", "Step", "Prediction", "predict_step"]

MODELS = ("gpt", "mlp", "simplecnn", "resnet50")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-pure", "bf16-master")
OPTIMIZERS = ("sgd", "sgd-momentum", "adamw", "adamw-forloop", "adamw-foreach", "adamw-fused", "none")
_NEEDS = {"gpt": ("seq",), "mlp": ("width", "depth"), "simplecnn": ("size",), "resnet50": ("size",)}
_TAKES = {"gpt": ("seq", "config"), "mlp": ("width", "depth"), "simplecnn": ("width", "size"), "resnet50": ("size",)}


@dataclass(frozen=True)
class Step:
    """Chapter 10: one training step of a model of the course, described.

    `model`: "gpt" (`config`: a GPTConfig, GPT-2 small by default; `seq` tokens a sequence),
    "mlp" (`width`, `depth`), "simplecnn" (`width`, images `size` x `size`), "resnet50" (`size`).
    `precision`: "fp32"; "bf16" or "fp16" autocast (fp16 with a GradScaler); "bf16-pure" (the
    model in bf16, the optimizer on it); "bf16-master" (the model in bf16, AdamW on fp32 masters).
    `optimizer`: "sgd", "sgd-momentum", "adamw-forloop" / "adamw-foreach" / "adamw-fused", "adamw"
    (PyTorch's default: for-loop on a CPU, foreach on CUDA) or "none" (forward and backward only).
    `checkpointing` (GPT): a checkpoint around every block. `attention` (GPT): "sdpa" or
    "materialized" (None: the config's). `device`: "cpu" or "cuda" (their rules where they differ).
    `logits_held` (GPT): the loop keeps `logits, loss = model(x, y)`, as the course's loops do."""

    model: str
    batch: int
    seq: int | None = None
    size: int | None = None
    width: int | None = None
    depth: int | None = None
    config: GPTConfig | None = None
    precision: str = "fp32"
    optimizer: str = "adamw"
    checkpointing: bool = False
    attention: str | None = None
    device: str = "cpu"
    logits_held: bool = True

    def __post_init__(self) -> None:
        def choose(what: str, value, options) -> None:
            if value not in options:
                raise ValueError(f"{what} {value!r} is not modelled; choose one of {options}")

        choose("model", self.model, MODELS)
        choose("precision", self.precision, PRECISIONS)
        choose("optimizer", self.optimizer, OPTIMIZERS)
        choose("device", self.device, ("cpu", "cuda"))
        for name in ("seq", "size", "width", "depth", "config"):
            if getattr(self, name) is not None and name not in _TAKES[self.model]:
                raise ValueError(f"{name} does not apply to {self.model}, which takes {('batch', *_TAKES[self.model])}")
            if getattr(self, name) is None and name in _NEEDS[self.model]:
                raise ValueError(f"{self.model} needs {name}")
        if self.batch < 1:
            raise ValueError(f"batch must be at least 1, not {self.batch}")
        if self.model != "gpt":
            if self.checkpointing:
                raise ValueError("checkpointing is modelled for the GPT's blocks only")
            if self.attention is not None:
                raise ValueError("attention applies to the GPT only")
            if not self.logits_held:
                raise ValueError("logits_held applies to the GPT only (the other loops hold only the loss)")
        else:
            if self.attention is not None:
                choose("attention", self.attention, ("sdpa", "materialized"))
            if self.seq > self.gpt.block_size:
                raise ValueError(f"seq {self.seq} is longer than the model's block_size {self.gpt.block_size}")
        if self.model == "resnet50":  # BatchNorm in training needs more than one value per channel
            hw = (self.size - 1) // 2 + 1
            for stride in (2, 1, 2, 2, 2):
                hw = (hw - 1) // stride + 1
            if self.batch * hw * hw < 2:
                raise ValueError(
                    f"ResNet-50's last BatchNorm sees {self.batch * hw * hw} value per channel: "
                    "training needs more (a larger batch or image)"
                )
        if self.precision == "bf16-master" and not self.optimizer.startswith("adamw"):
            raise ValueError(
                "bf16-master steps fp32 masters with AdamW (MasterWeightsAdamW): choose an adamw optimizer"
            )

    @property
    def gpt(self) -> GPTConfig:
        """The GPT's shape, its attention as `attention` says."""
        c = self.config or GPTConfig()
        return c if self.attention is None else replace(c, sdpa=self.attention == "sdpa")

    @property
    def optimizer_kind(self) -> str:
        """The optimizer, its implementation resolved ("adamw": PyTorch's default on the device)."""
        if self.optimizer == "adamw":
            return "adamw-forloop" if self.device == "cpu" else "adamw-foreach"
        return self.optimizer


@dataclass
class Prediction:
    """Chapter 10: a step's predicted peak (bytes), the moment it falls at, the bytes by category
    and the tensors held then, and every moment's total (bytes, in the order they happen)."""

    step: Step
    peak: int
    moment: str
    by_category: dict[str, int]
    held: list[Held]
    moments: dict[str, int] = field(repr=False)


def _tape(step: Step):
    how = {"precision": step.precision, "device": step.device}
    if step.model == "gpt":
        return gpt_tape(
            step.gpt, step.batch, step.seq, checkpointing=step.checkpointing, logits_held=step.logits_held, **how
        )
    if step.model == "mlp":
        return mlp_tape(step.width, step.depth, step.batch, **how)
    if step.model == "simplecnn":
        return simplecnn_tape(step.width or 64, step.batch, step.size, **how)
    return resnet50_tape(step.batch, step.size, **how)


def _state(step: Step, sizes: list[int]) -> list[Held]:
    """What the optimizer keeps from step to step (a step has run before this one)."""
    kind, n = step.optimizer_kind, sum(sizes)
    itemsize = 2 if step.precision == "bf16-pure" else 4  # the dtype of what it steps
    state = [Held("fp32 master weights", "optimizer", n, 4)] if step.precision == "bf16-master" else []
    if kind == "sgd-momentum":
        state.append(Held("SGD momentum buffers", "optimizer", n, itemsize))
    elif kind.startswith("adamw"):
        state += [
            Held("AdamW exp_avg and exp_avg_sq", "optimizer", 2 * n, itemsize),
            Held("AdamW step counters (fp32, one per tensor)", "optimizer", len(sizes), 4),
        ]
    return state


def _step_moments(step: Step, w: Walk, tape) -> None:
    """The optimizer's moments, after backward: the master-weight copy, the step's temporaries."""
    kind = step.optimizer_kind
    if kind == "none":
        return
    sizes = [tape.tensors[p].numel for p in tape.params]
    n, itemsize = sum(sizes), tape.tensors[next(iter(tape.params))].itemsize
    for key in [k for k, h in w.alive.items() if h.category == "gradients"]:
        w.drop(key)  # the .grad of every parameter: held below, in the dtype each moment has them
    grads = [Held(f"gradients ({'bf16' if itemsize == 2 else 'fp32'})", "gradients", n, itemsize)]
    if step.precision == "bf16-master":  # each bf16 gradient copied to its master's fp32 .grad, then released
        done = [sum(sizes[: k + 1]) for k in range(len(sizes))]
        k = max(range(len(sizes)), key=lambda k: 4 * done[k] - 2 * (done[k] - sizes[k]))
        w.record(
            "step: bf16 gradients copied to the fp32 masters",
            Held("fp32 gradients of the masters, so far", "gradients", done[k], 4),
            Held("bf16 gradients not yet released", "gradients", n - done[k] + sizes[k], 2),
        )
        grads, itemsize = [Held("fp32 gradients of the masters", "gradients", n, 4)], 4
    state = 2 if step.precision == "bf16-pure" else 4
    # for-loop: sqrt(exp_avg_sq) and its division for one tensor, while the previous tensor's `denom`
    # is still bound to the loop's variable; foreach: one sqrt list for all tensors at once
    forloop = max(2 * k + before for k, before in zip(sizes, [0, *sizes]))
    temp = {"adamw-forloop": forloop, "adamw-foreach": n}.get(kind, 0)
    what = {"adamw-forloop": "a tensor's sqrt and its division, the last denom", "adamw-foreach": "foreach sqrt list"}
    extra = [Held(f"AdamW temporaries: {what[kind]}", "temporaries", temp, state)] if temp else []
    if step.precision == "fp16" and kind != "adamw-fused":  # unscale_ finds infs into a tensor of its own
        extra.append(Held("GradScaler's found_inf", "temporaries", 1, 4))
    w.record(f"step: {kind}", *grads, *extra)


def predict_step(step: Step, at: str | None = None) -> Prediction:
    """Chapter 10: the memory of `step` at every moment, and its peak. `held` (and `by_category`)
    are the tensors alive at the peak, or at the moment named `at` (one of the returned `moments`)."""
    tape = _tape(step)
    params = [tape.tensors[p] for p in tape.params]
    fixed = params + tape.buffers + _state(step, [h.numel for h in params])
    previous = [tape.tensors[t] for t in tape.held if not t.startswith("labels")]  # the loop's, from the last step
    w = walk(tape, fixed, previous, capture=at)
    _step_moments(step, w, tape)
    if at is not None and at not in w.moments:
        raise ValueError(f"no moment {at!r}; the moments are {list(w.moments)}")
    held = w.held
    return Prediction(step, w.peak, w.moment, totals_by_category(held), held, w.moments)
