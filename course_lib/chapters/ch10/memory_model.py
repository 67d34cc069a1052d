"""Where a training step's memory goes, moment by moment: a tape of the forward pass, walked (chapter 10).

A model's forward pass is written down as a tape of `Node`s (course_lib.chapters.ch10.tapes writes
one for each model of the course): what each op makes, what it saves for backward, which tensors'
gradients its backward makes. `walk` replays the tape the way PyTorch runs it and adds up, after
every op, the bytes alive then — a *moment*. No constant is fitted; the rules are PyTorch's:

- forward: an op's output exists from the op on; Python lets go of it after the last op that reads
  it (or when the module whose local variable holds it returns: `Tape.until`, `Tape.keep`); an op
  that saves a tensor keeps it until that op's backward has run;
- checkpointing (non-reentrant): a checkpointed segment saves only its inputs; backward re-runs it
  when the first of its saved tensors is needed, and stops once the last one has been saved again;
- backward runs the ops in reverse: each makes the gradients of its inputs (a new tensor each,
  unless it passes the incoming one on), then its saved tensors and the incoming gradient go; a
  second gradient for the same tensor is summed *out of place* (the engine's `InputBuffer`: the
  tied wte/lm_head weight, the residual stream); a gradient made in slices is gathered (`cat`);
- a leaf's gradient stays as its `.grad` until the optimizer has stepped.

The step's peak is its largest moment; course_lib.chapters.ch10.predict adds the optimizer's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["Held", "Node", "Tape", "Walk", "walk", "totals_by_category"]


@dataclass(frozen=True)
class Held:
    """Chapter 10: one tensor (or one kind of tensor) a training step holds at some moment."""

    what: str
    category: str  # parameters | buffers | gradients | optimizer | activations | weight copies | held | temporaries
    numel: int
    itemsize: int  # bytes per element

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Node:
    """Chapter 10: one op of a forward pass, as memory sees it. `out` and `side` are the tensors it
    makes (`out` is the one whose gradient comes back; `out` among `inputs`: in place); backward
    makes the gradients of `inputs` (parameters included) unless `passes` hands the incoming one on;
    `saved` are kept for backward; `reads` only keeps a tensor alive through the op. `part`: the
    gradient it makes for its input is a slice of that input's (gathered once all slices came)."""

    name: str
    out: str = ""
    inputs: tuple[str, ...] = ()
    saved: tuple[str, ...] = ()
    passes: tuple[str, ...] = ()
    side: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    segment: int = -1  # the checkpointed segment it runs in; -1: none
    part: bool = False

    def made(self) -> list[str]:
        return [t for t in (self.out, *self.side) if t and t not in self.inputs]


@dataclass
class Tape:
    """Chapter 10: a forward pass written down: its tensors (by name), its parameters (name ->
    the bytes per element of their gradients), its nodes in order, and how long Python holds a
    tensor beyond its last reader: until a module returns (`until`: tensor -> node name), until
    the whole forward returns (`keep`: autocast's cache of 16-bit weights, a model's locals), or
    past the forward (`held`: what the training loop keeps, the logits or the loss).
    `during_backward`: what exists while `.backward()` runs (a scaled loss); `through_backward`:
    tensors of the forward that live until backward returns (cross-entropy's total weight).
    `views`: tensors that share another's storage (view -> base): holding one holds the base."""

    tensors: dict[str, Held] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    params: dict[str, int] = field(default_factory=dict)
    buffers: list[Held] = field(default_factory=list)
    until: dict[str, str] = field(default_factory=dict)
    keep: set[str] = field(default_factory=set)
    held: tuple[str, ...] = ()
    during_backward: list[Held] = field(default_factory=list)
    through_backward: set[str] = field(default_factory=set)
    views: dict[str, str] = field(default_factory=dict)

    def tensor(self, name: str, numel: int, itemsize: int, category: str = "activations") -> str:
        """Declare a tensor; returns its name."""
        self.tensors[name] = Held(name, category, numel, itemsize)
        return name

    def param(self, name: str, numel: int, itemsize: int) -> str:
        """Declare a parameter (its gradient has its dtype); returns its name."""
        self.tensors[name] = Held(name, "parameters", numel, itemsize)
        self.params[name] = itemsize
        return name

    def add(self, name: str, out: str = "", inputs: tuple[str, ...] = (), **how) -> Node:
        """Append a node (the keyword arguments are Node's)."""
        node = Node(name, out, inputs, **how)
        self.nodes.append(node)
        return node

    def stores(self, t: str) -> bool:
        """Whether holding `t` costs the step memory (a parameter or the batch exists anyway)."""
        return t not in self.params and self.tensors[t].category != "batch"

    def storage(self, t: str) -> str:
        """The tensor whose storage `t` is (itself, or a view's base)."""
        return self.views.get(t, t)


class Walk:
    """Chapter 10: what is alive during a step (each tensor with a count of what holds it), every
    moment's total in bytes (`moments`, in order), and the largest moment: `peak`, its name
    (`moment`) and the tensors alive then (`held`). `capture` names a moment whose tensors to keep
    instead of the peak's."""

    def __init__(self, fixed: list[Held], capture: str | None = None) -> None:
        self.fixed = list(fixed)
        self.alive: dict[object, Held] = {}
        self.refs: Counter = Counter()
        self.moments: dict[str, int] = {}
        self.peak, self.moment, self.held = -1, "", []
        self.capture = capture
        self._fixed = sum(h.nbytes for h in fixed)
        self._alive = 0

    def hold(self, key: object, held: Held) -> None:
        if key not in self.alive:
            self.alive[key] = held
            self._alive += held.nbytes
        self.refs[key] += 1

    def drop(self, key: object) -> None:
        if key in self.alive:
            self.refs[key] -= 1
            if self.refs[key] <= 0:
                self._alive -= self.alive.pop(key).nbytes
                del self.refs[key]

    def record(self, name: str, *extra: Held) -> None:
        """The moment `name`: everything alive, plus `extra` (what an op makes and frees in one go)."""
        total = self._fixed + self._alive + sum(h.nbytes for h in extra)
        self.moments[name] = total
        if name == self.capture or (self.capture is None and total > self.peak):
            self.held = [*self.fixed, *self.alive.values(), *extra]
        if total > self.peak:
            self.peak, self.moment = total, name


def _stored(tape: Tape, names: tuple[str, ...]) -> list[str]:
    """The storages that holding `names` keeps (a view keeps its base; parameters and the batch cost nothing)."""
    return [tape.storage(t) for t in names if tape.stores(tape.storage(t))]


def _forward(tape: Tape, w: Walk, nodes: list[Node], label: str, save, stop: bool = False) -> None:
    """Nodes run forward: outputs made and the moment recorded, saved tensors kept (where `save`
    says so), and Python's references let go as the tape says. `stop`: a recomputation, which ends
    once the last node has saved its inputs (before it runs)."""
    index = {n.name: i for i, n in enumerate(nodes)}
    release: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for t in (*n.made(), *n.inputs, *n.saved, *n.reads):
            release[tape.storage(t)] = i
    for t, until in tape.until.items():
        if t in release and until in index:
            release[t] = max(release[t], index[until])
    python: list[str] = []
    for i, n in enumerate(nodes):
        if stop and i == len(nodes) - 1:
            for t in _stored(tape, n.saved):
                w.hold(t, tape.tensors[t])
            break
        for t in n.made():
            if t not in tape.views:
                w.hold(t, tape.tensors[t])
                python.append(t)
        w.record(f"{label}: {n.name}")
        if save(n):
            for t in _stored(tape, n.saved):
                w.hold(t, tape.tensors[t])
        lasting = tape.keep | tape.through_backward | set(tape.held)
        for t in [t for t in python if release[t] == i and t not in lasting]:
            w.drop(t)
            python.remove(t)
    for t in python:  # the forward returns (or the recomputation stops): its locals go
        if t not in tape.held and t not in tape.through_backward:
            w.drop(t)


def walk(tape: Tape, fixed: list[Held], previous: list[Held] = (), capture: str | None = None) -> Walk:
    """Chapter 10: every moment of one training step's forward and backward (with each checkpointed
    segment's recomputation). `fixed`: what exists throughout (parameters, buffers, optimizer state);
    `previous`: what the loop still holds from the step before while this forward runs."""
    w = Walk(fixed, capture)
    for i, h in enumerate(previous):
        w.hold(("previous", i), h)
    segments: dict[int, list[Node]] = {}
    for n in tape.nodes:
        if n.segment >= 0:
            segments.setdefault(n.segment, []).append(n)
    outside: dict[str, list[str]] = {}  # a segment's first node -> the inputs the checkpoint keeps
    for seg in segments.values():
        made = {tape.storage(t) for n in seg for t in n.made()}
        ins = {t for n in seg for t in _stored(tape, (*n.inputs, *n.saved)) if t not in made}
        outside[seg[0].name] = sorted(ins)

    def save(n: Node) -> bool:
        for t in outside.get(n.name, ()):
            w.hold(t, tape.tensors[t])
        return n.segment < 0

    _forward(tape, w, tape.nodes, "forward", save)
    for i in range(len(previous)):  # replaced by this step's
        w.drop(("previous", i))
    _backward(tape, w, segments, outside)
    return w


def _backward(tape: Tape, w: Walk, segments: dict[int, list[Node]], outside: dict[str, list[str]]) -> None:
    uses = Counter(x for n in tape.nodes for x in n.inputs)
    pending: dict[str, object] = {}  # tensor -> its gradient waiting in the engine's input buffer
    parts: dict[str, list[object]] = {}
    made = [0]

    def grad(x: str, like: str, what: str = "") -> tuple[object, Held]:
        made[0] += 1
        h = tape.tensors[like]
        itemsize = tape.params.get(x, h.itemsize)
        category = "gradients" if x in tape.params else "temporaries"
        return ("grad", made[0]), Held(what or f"gradient of {x}", category, h.numel, itemsize)

    for i, h in enumerate(tape.during_backward):
        w.hold(("backward", i), h)
    root, held = grad("loss", tape.nodes[-1].out, "gradient of the loss (ones)")
    w.hold(root, held)
    pending[tape.nodes[-1].out] = root
    recomputed: set[int] = set()
    for n in reversed(tape.nodes):
        if not n.inputs:
            continue
        if n.segment >= 0 and n.segment not in recomputed and n.saved:  # its first unpack re-runs the segment
            recomputed.add(n.segment)
            seg = segments[n.segment]
            last = max(j for j, m in enumerate(seg) if m.saved)
            _forward(tape, w, seg[: last + 1], "recompute", lambda m: True, stop=True)
        incoming = pending.pop(n.out, None)
        grads = []
        for x in n.inputs:
            if x in n.passes and incoming is not None:
                grads.append((x, incoming, None))
            else:
                grads.append((x, *grad(x, n.out if n.part else x)))
        w.record(f"backward: {n.name}", *(h for _, _, h in grads if h is not None))
        for _, key, h in grads:
            w.hold(key, h or w.alive[key])
        if incoming is not None:
            w.drop(incoming)
        for t in _stored(tape, n.saved):
            w.drop(t)
        for t in outside.get(n.name, ()):
            w.drop(t)
        for x, key, _ in grads:
            uses[x] -= 1
            if n.part:  # a slice: when the last one comes, all are gathered into one gradient
                parts.setdefault(x, []).append(key)
                if uses[x] == 0:
                    whole_key, whole = grad(x, x)
                    w.record(f"backward: {x}'s gradient gathered", whole)
                    w.hold(whole_key, whole)
                    for k in parts.pop(x):
                        w.drop(k)
                    pending[x] = whole_key
                continue
            if x in pending:  # a second gradient for the same tensor, summed out of place
                total_key, total = grad(x, x)
                w.record(f"backward: {x}'s gradients summed", total)
                w.hold(total_key, total)
                w.drop(pending.pop(x))
                w.drop(key)
                key = total_key
            if not (x in tape.params and uses[x] == 0):  # a leaf's finished gradient is its .grad
                pending[x] = key
    for i in range(len(tape.during_backward)):
        w.drop(("backward", i))
    for t in tape.through_backward:
        w.drop(t)


def totals_by_category(held: list[Held]) -> dict[str, int]:
    """Chapter 10: the bytes of `held` summed per category, in the order the categories first appear."""
    totals: dict[str, int] = {}
    for t in held:
        totals[t.category] = totals.get(t.category, 0) + t.nbytes
    return totals
