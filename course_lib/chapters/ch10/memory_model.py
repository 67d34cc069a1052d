"""Where a training step's memory goes, predicted tensor by tensor: chapter 10.

A prediction is built from what each layer saves for backward (a per-tensor count, no fitted
constant) and from the order backward frees it: the step's peak is its largest moment.

- The GPT (`gpt_step_tensors`, `predicted_peak`): two moments, the start of backward (every saved
  activation, autocast's 16-bit weight copies, the logits the loop holds and cross-entropy's two
  fp32 gradient temporaries) and AdamW's step; fp32, autocast, pure bf16 and bf16 with fp32 master
  weights, on the CPU's rules or CUDA's.
- The MLP and SimpleCNN: their backward walked op by op, in the homes of the chapters that first
  read them (`course_lib.chapters.ch02.step_memory.mlp_moments`, `course_lib.chapters.ch04.cnn_memory.cnn_moments`).
- ResNet-50 (`resnet50_tape`, `resnet50_moments`): its forward as a tape of nodes, walked in reverse.

course_lib.chapters.ch10.measure measures the same steps with PyTorch's own tracker
(`MemTracker` under `FakeTensorMode`, on a CPU; fp16 with a GradScaler on real tensors);
tests/test_memory_model.py holds every prediction within 2% of it, and within 2% of an H100's
recorded peaks (course_lib.chapters.ch10.recorded). Not predicted: checkpointing's recompute moment
where the vocabulary is small (the head's moment is predicted), and what SimpleCNN's GPU
rows hold beyond the walk (most likely cuDNN's convolution workspaces).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.models import GPTConfig, resnet50

__all__ = [
    "Held",
    "PRECISIONS",
    "gpt_step_tensors",
    "predicted_peak",
    "totals_by_category",
    "Node",
    "resnet50_tape",
    "resnet50_moments",
]


@dataclass(frozen=True)
class Held:
    """Chapter 10: one tensor (or one kind of tensor) a training step holds at some moment."""

    what: str
    category: str  # parameters | gradients | optimizer | activations | weight copies | held | temporaries
    numel: int
    itemsize: int  # bytes per element

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def _param_count(c: GPTConfig) -> int:
    # token and position embeddings, per block 12 C^2 weights + 13 C biases and LayerNorms, ln_f; lm_head is tied
    return (
        c.vocab_size * c.n_embd
        + c.block_size * c.n_embd
        + c.n_layer * (12 * c.n_embd**2 + 13 * c.n_embd)
        + 2 * c.n_embd
    )


PRECISIONS = ("fp32", "bf16", "fp16", "bf16-pure", "bf16-master")


def gpt_step_tensors(
    c: GPTConfig,
    batch: int,
    seq: int,
    precision: str = "fp32",
    checkpointing: bool = False,
    *,
    device: str = "cpu",
    logits_held: bool = True,
    optimizer: str = "foreach",
) -> dict[str, list[Held]]:
    """Chapter 10: what one training step of the course's GPT holds, phase by phase ("backward": at
    the start of backward; "step": inside AdamW's step).

    `precision`: "fp32"; "bf16" / "fp16" autocast (weights, gradients and AdamW's state stay fp32);
    "bf16-pure" (the model cast to bf16, AdamW on the bf16 weights); "bf16-master" (the model in
    bf16, AdamW on fp32 master copies: the step copies each bf16 gradient to an fp32 one).
    `device`: "cuda" applies CUDA autocast's rule that differs from the CPU's (a materialized
    softmax runs in fp32, and the next matmul saves a 16-bit copy of it). `logits_held`: the loop
    keeps `logits, loss = model(x, y)` (the course's loops) or only the loss. `optimizer`:
    "foreach" (one parameter-sized temporary during step) or "fused" (none)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISIONS}")
    C, L, V, nh = c.n_embd, c.n_layer, c.vocab_size, c.n_head
    P = _param_count(c)
    pure = precision.startswith("bf16-")
    autocast = precision in ("bf16", "fp16")
    p = 4 if precision == "fp32" else 2  # what a matmul's inputs and outputs are
    f = 2 if pure else 4  # the residual stream and LayerNorm's inputs: fp32 under autocast
    w = 2 if pure else 4  # the weights and their gradients
    BT = batch * seq
    BTC = BT * C
    BTV = BT * V
    weights = [Held(f"parameters ({'bf16' if pure else 'fp32'})", "parameters", P, w)]
    if precision == "bf16-master":
        weights.append(Held("fp32 master weights", "optimizer", P, 4))
    state = 2 if precision == "bf16-pure" else 4  # AdamW's moments are the dtype of what it steps
    adamw = [
        Held("AdamW exp_avg and exp_avg_sq", "optimizer", 2 * P, state),
        Held("AdamW step counters", "optimizer", 4 + 12 * L, 4),  # one per parameter tensor
    ]

    def attention(i: int) -> list[Held]:
        if c.sdpa:  # one fused kernel saves q, k, v (one storage), its output (proj's input too) and logsumexp
            return [
                Held(f"block {i}: q, k, v", "activations", 3 * BTC, p),
                Held(f"block {i}: attention output", "activations", BTC, p),
                Held(f"block {i}: attention logsumexp", "activations", batch * nh * seq, 4),
            ]
        scores = batch * nh * seq * seq
        if device == "cuda" and autocast:  # CUDA autocast runs softmax in fp32; the next bmm saves a 16-bit copy
            softmax = [
                Held(f"block {i}: softmax output (fp32, T x T per head)", "activations", scores, 4),
                Held(f"block {i}: its 16-bit copy for the next matmul", "activations", scores, 2),
            ]
        else:
            softmax = [Held(f"block {i}: softmax output (T x T per head)", "activations", scores, p)]
        return [  # the textbook way: copies of q, k, v for the batched matmuls, the mask, the T x T softmax
            Held(f"block {i}: q, k, v (copies for bmm)", "activations", 3 * BTC, p),
            Held(f"block {i}: causal mask", "activations", seq * seq, 1),
            *softmax,
            Held(f"block {i}: proj input (heads side by side, a copy)", "activations", BTC, p),
        ]

    saved = [Held("position indices", "activations", seq, 8)]
    for i in range(L):
        if checkpointing:  # only the block's input stays; backward recomputes the rest, one block at a time
            saved.append(Held(f"block {i}: input (checkpointed)", "activations", BTC, f))
            continue
        saved += [
            Held(f"block {i}: ln1 input (residual stream)", "activations", BTC, f),
            Held(f"block {i}: ln1 mean and rstd", "activations", 2 * BT, 4),
            Held(f"block {i}: qkv input", "activations", BTC, p),
            *attention(i),
            Held(f"block {i}: ln2 input (residual stream)", "activations", BTC, f),
            Held(f"block {i}: ln2 mean and rstd", "activations", 2 * BT, 4),
            Held(f"block {i}: fc input", "activations", BTC, p),
            Held(f"block {i}: GELU input", "activations", 4 * BTC, p),
            Held(f"block {i}: proj input", "activations", 4 * BTC, p),
        ]
    saved += [
        Held("ln_f input", "activations", BTC, f),
        Held("ln_f mean and rstd", "activations", 2 * BT, 4),
        Held("lm_head input", "activations", BTC, p),
        Held("log-softmax output (fp32)", "activations", BTV, 4),
        Held("loss", "activations", 1, 4),
    ]
    if autocast and not checkpointing:  # each Linear saves its weight: under autocast, a 16-bit copy
        saved.append(Held("16-bit weight copies (autocast's cache)", "weight copies", L * 12 * C * C + V * C, 2))
    elif autocast:
        saved.append(Held("16-bit copy of the tied lm_head weight", "weight copies", V * C, 2))
    logits = [Held("logits (the caller holds them)", "held", BTV, p)] if logits_held else []
    backward = weights + adamw + saved + logits + [Held("cross-entropy gradients (fp32)", "temporaries", 2 * BTV, 4)]
    step = weights + adamw + logits + [Held("loss", "activations", 1, 4)]
    if precision == "bf16-master":  # each bf16 gradient copied to its master's .grad, then released
        step.append(Held("fp32 gradients of the master weights", "gradients", P, 4))
    else:
        step.append(Held(f"gradients ({'bf16' if pure else 'fp32'})", "gradients", P, w))
    if optimizer == "foreach":
        step.append(Held("AdamW foreach temporaries", "temporaries", P, state))
    return {"backward": backward, "step": step}


def totals_by_category(held: list[Held]) -> dict[str, int]:
    """Chapter 10: the bytes of `held` summed per category, in the order the categories first appear."""
    totals: dict[str, int] = {}
    for t in held:
        totals[t.category] = totals.get(t.category, 0) + t.nbytes
    return totals


def predicted_peak(
    c: GPTConfig, batch: int, seq: int, precision: str = "fp32", checkpointing: bool = False, **loop: str | bool
) -> int:
    """Chapter 10: the largest phase of gpt_step_tensors, in bytes (`loop`: its keyword arguments)."""
    phases = gpt_step_tensors(c, batch, seq, precision, checkpointing, **loop)
    return max(sum(t.nbytes for t in held) for held in phases.values())


# --------------------------------------------------------------------------- ResNet-50: a tape, walked backward


@dataclass(frozen=True)
class Node:
    """Chapter 10: one op of a forward pass, as its backward sees it: what it saves (tensor names),
    the tensor it makes, the inputs whose gradients it makes, and its parameters (count)."""

    name: str
    saved: tuple[str, ...]
    out: str
    inputs: tuple[str, ...]
    params: int = 0


def resnet50_tape(batch: int, size: int, precision: str = "fp32", classes: int = 1000):
    """Chapter 10: torchvision's ResNet-50 forward as a tape: (bytes of every tensor by name, nodes in
    forward order). Convolutions save their input and weight (under autocast a 16-bit copy of each);
    BatchNorm saves its input and its batch mean and inverse std (fp32); the in-place ReLU saves its
    output (BatchNorm's); max-pool saves its input and int64 indices; the residual add saves nothing."""
    p = 2 if precision in ("bf16", "fp16") else 4
    amp = p == 2
    sizes: dict[str, int] = {}
    nodes: list[Node] = []

    def tensor(name: str, numel: int, itemsize: int) -> str:
        sizes[name] = numel * itemsize
        return name

    def conv_bn(name: str, x: str, cin: int, cout: int, k: int, hw: int, stride: int = 1, relu: bool = True):
        out_hw = (hw + 2 * (k // 2) - k) // stride + 1
        n_w = cout * cin * k * k
        copy = (tensor(f"{name}.w16", n_w, 2),) if amp else ()
        conv = tensor(f"{name}.conv", batch * cout * out_hw * out_hw, p)
        nodes.append(Node(f"{name}.conv", (x, *copy), conv, (x,), n_w))
        stats = tensor(f"{name}.stats", 2 * cout, 4)
        bn = tensor(f"{name}.bn", batch * cout * out_hw * out_hw, p)
        nodes.append(Node(f"{name}.bn", (conv, stats), bn, (conv,), 2 * cout))
        if relu:
            nodes.append(Node(f"{name}.relu", (bn,), bn, (bn,)))
        return bn, out_hw

    x = tensor("x16", batch * 3 * size * size, p) if amp else "x"  # fp32: the batch itself, nothing new
    if not amp:
        sizes["x"] = 0
    stem, hw = conv_bn("stem", x, 3, 64, 7, size, stride=2)
    nodes[0] = Node("stem.conv", nodes[0].saved, nodes[0].out, (), nodes[0].params)  # the batch needs no gradient
    hw_pool = (hw + 2 - 3) // 2 + 1
    indices = tensor("stem.pool.indices", batch * 64 * hw_pool * hw_pool, 8)
    pooled = tensor("stem.pool", batch * 64 * hw_pool * hw_pool, p)
    nodes.append(Node("stem.pool", (stem, indices), pooled, (stem,)))
    block_in, c_in, hw = pooled, 64, hw_pool
    for stage, (width, blocks, stride) in enumerate(((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))):
        for k in range(blocks):
            s = stride if k == 0 else 1
            name = f"layer{stage + 1}.{k}"
            a, _ = conv_bn(f"{name}.1", block_in, c_in, width, 1, hw)
            b, out_hw = conv_bn(f"{name}.2", a, width, width, 3, hw, stride=s)
            c, _ = conv_bn(f"{name}.3", b, width, 4 * width, 1, out_hw, relu=False)
            if k == 0:
                identity, _ = conv_bn(f"{name}.downsample", block_in, c_in, 4 * width, 1, hw, stride=s, relu=False)
            else:
                identity = block_in
            nodes.append(Node(f"{name}.add", (), c, (c, identity)))
            nodes.append(Node(f"{name}.relu", (c,), c, (c,)))
            block_in, c_in, hw = c, 4 * width, out_hw
    features = tensor("avgpool", batch * 2048, p)
    nodes.append(Node("avgpool", (block_in,), features, (block_in,)))
    copy = (tensor("fc.w16", classes * 2048, 2),) if amp else ()
    logits = tensor("logits", batch * classes, p)
    nodes.append(Node("fc", (features, *copy), logits, (features,), classes * 2048 + classes))
    log_softmax = tensor("log_softmax", batch * classes, 4)
    nodes.append(Node("loss", (log_softmax,), "loss", (logits,)))
    return sizes, nodes


def resnet50_moments(
    batch: int, size: int, precision: str = "fp32", classes: int = 1000, momentum: bool = True
) -> dict[str, int]:
    """Chapter 10: ResNet-50's step (SGD with momentum) at each moment of backward, walking its tape in
    reverse: a saved tensor is freed when the first node (in forward order) that saves it has run
    backward; a gradient waits until the node that made its tensor runs; under autocast each weight
    gradient is made in 16 bits and cast to the fp32 .grad. `momentum=False`: SGD has not made its
    buffer yet (no step has run: a GradScaler that skipped every step so far)."""
    amp = precision in ("bf16", "fp16")
    p = 2 if amp else 4
    with torch.device("meta"):  # shapes only: counting parameters and buffers allocates nothing
        meta = resnet50(num_classes=classes)
    params = 4 * sum(t.numel() for t in meta.parameters())
    buffers = sum(t.numel() * t.element_size() for t in meta.buffers())  # BatchNorm's running statistics
    state = params if momentum else 0  # SGD's momentum buffer, one fp32 copy of the parameters
    fixed = params + buffers + state
    sizes, nodes = resnet50_tape(batch, size, precision, classes)
    first_user: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for name in node.saved:
            first_user.setdefault(name, i)
    alive = set(first_user)
    grads = 0
    waiting: dict[str, int] = {}  # tensor name -> bytes of its gradient, until the node that made it runs
    moments: dict[str, int] = {}
    for i in reversed(range(len(nodes))):
        node = nodes[i]
        grad_out = waiting.pop(node.out, 0)
        grad_in = sum(sizes[x] for x in node.inputs)
        is_matmul = node.name.endswith(".conv") or node.name == "fc"
        grad_w = node.params * (p if is_matmul else 4)  # BatchNorm's weight gradients are fp32
        held = fixed + grads + sum(sizes[s] for s in alive) + sum(waiting.values())
        moments[node.name] = held + grad_out + grad_in + grad_w
        alive -= {s for s in node.saved if first_user[s] == i}
        if amp and is_matmul:  # its saved tensors released, the 16-bit weight gradient cast to fp32
            held = fixed + grads + sum(sizes[s] for s in alive) + sum(waiting.values())
            moments[node.name + " (cast to fp32)"] = held + grad_in + grad_w + 4 * node.params
        grads += 4 * node.params
        for x in node.inputs:  # a second gradient for the same tensor is summed into the first
            waiting[x] = waiting.get(x, 0) or sizes[x]
    moments["optimizer step"] = fixed + grads
    return moments
