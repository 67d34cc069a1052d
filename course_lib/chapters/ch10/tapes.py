"""The forward pass of each model of the course, written down as a tape for chapter 10's walk.

Each function returns a `Tape` (course_lib.chapters.ch10.memory_model): every op of the model's
forward as PyTorch runs it, with the bytes of what it makes and what it saves for backward, in the
dtypes that `precision` gives them:

- "fp32": everything 4 bytes;
- "bf16" / "fp16" autocast: weights and gradients stay fp32; a matmul's or convolution's inputs
  are cast to 16 bits (the weights' copies are cached until the forward returns, and saved), its
  output is 16-bit; LayerNorm, the residual stream and the log-softmax of the loss stay fp32;
- "bf16-pure" and "bf16-master": the model itself in bf16, autocast off; the logits are cast to
  fp32 for the loss (the course's GPT does `.float()`).

`device` applies the rules that differ: on CUDA autocast runs a materialized softmax in fp32 (and
the next matmul saves a 16-bit copy), and a bf16 LayerNorm keeps fp32 mean and rstd (a CPU keeps
bf16). The batch itself exists before the step and is not on the tape; MemTracker on a CPU sees
the GPT's labels once the loss views them, so the CPU tape counts them from there.
"""

from __future__ import annotations

from course_lib.chapters.ch10.memory_model import Held, Tape
from course_lib.models import GPTConfig

__all__ = ["gpt_tape", "mlp_tape", "simplecnn_tape", "resnet50_tape"]


class _Writer:
    """The dtypes of one precision, and the layers every model is made of."""

    def __init__(self, precision: str, device: str) -> None:
        self.t = Tape()
        self.no_grad: set[str] = set()  # the batch, and what is made from it alone
        self.amp = precision in ("bf16", "fp16")
        self.fp16 = precision == "fp16"
        self.pure = precision.startswith("bf16-")
        self.p = 4 if precision == "fp32" else 2  # a matmul's inputs and output
        self.w = 2 if self.pure else 4  # weights and their gradients
        self.device = device

    def param(self, name: str, numel: int) -> str:
        return self.t.param(name, numel, self.w)

    def cast(self, name: str, x: str, category: str = "activations", seg: int = -1) -> str:
        """Autocast's (or .float()'s) copy of `x` in the other width."""
        h = self.t.tensors[x]
        out = self.t.tensor(
            f"{name} ({'fp32' if h.itemsize == 2 else '16-bit'} copy)", h.numel, 6 - h.itemsize, category
        )
        self.t.add(f"{name}: cast", out, () if x in self.no_grad else (x,), segment=seg)
        if x in self.no_grad:
            self.no_grad.add(out)
        return out

    def batch(self, numel: int) -> str:
        """The batch: made before the step (not on the tape's count), needing no gradient."""
        x = self.t.tensor("the batch", numel, self.w, "batch")
        self.no_grad.add(x)
        return x

    def weights16(self, names: tuple[str, ...], seg: int) -> tuple[str, ...]:
        """Under autocast a layer's weights are used as 16-bit copies, cached until the forward returns."""
        if not self.amp:
            return names
        copies = tuple(self.cast(n, n, "weight copies", seg) for n in reversed(names))[::-1]  # the bias first
        self.t.keep.update(copies)
        return copies

    def input16(self, name: str, x: str, seg: int = -1) -> str:
        if self.amp and self.t.tensors[x].itemsize != 2:
            return self.cast(f"{name} input", x, seg=seg)
        return x

    def linear(self, name: str, x: str, rows: int, cin: int, cout: int, seg: int = -1, bias: bool = True, weight=None):
        """nn.Linear: addmm (mm without bias); saves its input and weight (a batch's Linear, whose
        input needs no gradient, saves only its input)."""
        ws = (weight or self.param(f"{name}.weight", cout * cin),) + (
            (self.param(f"{name}.bias", cout),) if bias else ()
        )
        ws = self.weights16(ws, seg)  # autocast casts the bias, the weight, then the input
        x = self.input16(name, x, seg)
        out = self.t.tensor(f"{name} output", rows * cout, self.p)
        if x in self.no_grad:  # only the weight's gradient is made, and it needs only the input
            self.t.add(name, out, ws, saved=(x,), segment=seg)
        else:
            self.t.add(name, out, (x, *ws), saved=(x, ws[0]), segment=seg)
        return out

    def loss(self, logits: str, rows: int, classes: int, upcast: bool = False) -> str:
        """Cross-entropy: its log-softmax output saved, the loss held by the loop. The log-softmax is
        fp32 under autocast (its input cast up) or where the model casts up (`upcast`, the GPT's
        `.float()`); a bf16 model's own logits stay bf16."""
        t = self.t
        lf = logits
        if t.tensors[logits].itemsize == 2 and (self.amp or upcast):
            lf = self.cast("logits", logits)
        size = t.tensors[lf].itemsize
        lsm = t.tensor(f"log-softmax output ({'fp32' if size == 4 else 'bf16'})", rows * classes, size)
        t.add("log-softmax", lsm, (lf,), saved=(lsm,))
        loss, weight = t.tensor("loss", 1, size), t.tensor("cross-entropy's total weight", 1, size)
        t.add("nll loss", loss, (lsm,), saved=(lsm,), side=(weight,))
        t.keep.add(logits)
        t.held = (loss,)
        t.through_backward.add(weight)
        if self.fp16:  # GradScaler: backward starts from loss * scale
            t.during_backward.append(Held("the scaled loss (GradScaler)", "temporaries", 1, 4))
        return loss


def gpt_tape(
    c: GPTConfig,
    batch: int,
    seq: int,
    precision: str = "fp32",
    checkpointing: bool = False,
    device: str = "cpu",
    logits_held: bool = True,
) -> Tape:
    """Chapter 10: the course's GPT (course_lib.models.GPT) step as a tape: embeddings, pre-LayerNorm
    blocks (SDPA or the materialized T x T attention, `c.sdpa`; each block a checkpointed segment
    where `checkpointing`), ln_f, the lm_head tied to wte, cross-entropy. `logits_held`: the loop
    keeps `logits, loss = model(x, y)` (else only the loss)."""
    wr = _Writer(precision, device)
    t, p = wr.t, wr.p
    f = 2 if wr.pure else 4  # the residual stream and LayerNorm's input and output
    stats = 2 if wr.pure and device == "cpu" else 4
    B, T, C, V, nh = batch, seq, c.n_embd, c.vocab_size, c.n_head
    BT, BTC = B * T, B * T * C

    def layer_norm(name: str, x: str, seg: int) -> str:
        ws = (wr.param(f"{name}.weight", C), wr.param(f"{name}.bias", C))
        out = t.tensor(f"{name} output", BTC, f)
        mean, rstd = t.tensor(f"{name} mean", BT, stats), t.tensor(f"{name} rstd", BT, stats)
        t.add(name, out, (x, *ws), saved=(x, mean, rstd), side=(mean, rstd), segment=seg)
        return out

    pos = t.tensor("position indices", T, 8)
    t.add("arange", pos)
    wte = wr.param("wte.weight", V * C)
    tok = t.tensor("token embeddings", BTC, wr.w)
    t.add("wte", tok, (wte,))
    wpe = wr.param("wpe.weight", c.block_size * C)
    pe = t.tensor("position embeddings", T * C, wr.w)
    t.add("wpe", pe, (wpe,), saved=(pos,))
    x = t.tensor("block 0 input", BTC, f)
    t.add("embeddings added", x, (tok, pe), passes=(tok,))
    t.keep.add(pos)
    for i in range(c.n_layer):
        seg, b = (i if checkpointing else -1), f"block {i}"
        a = layer_norm(f"{b}: ln1", x, seg)
        qkv = wr.linear(f"{b}: qkv", a, BT, C, 3 * C, seg)
        if c.sdpa:  # one fused kernel: saves q, k, v (one storage), its output and the log-sum-exp
            y = t.tensor(f"{b}: attention output", BTC, p)
            lse = t.tensor(f"{b}: attention logsumexp", B * nh * T, 4)
            t.add(f"{b}: attention", y, (qkv,), saved=(qkv, y, lse), side=(lse,), segment=seg)
        else:
            y = _materialized(wr, b, qkv, B, T, C, nh, seg)
        o = wr.linear(f"{b}: proj", y, BT, C, C, seg)
        t.until.update({a: f"{b}: proj", qkv: f"{b}: proj", x: f"{b}: MLP residual add"})  # the module's locals
        x1 = t.tensor(f"{b}: residual after attention", BTC, f)
        t.add(f"{b}: attention residual add", x1, (x, o), passes=(x, o) if f == p else (x,), segment=seg)
        a2 = layer_norm(f"{b}: ln2", x1, seg)
        h = wr.linear(f"{b}: fc", a2, BT, C, 4 * C, seg)
        g = t.tensor(f"{b}: GELU output", 4 * BTC, p)
        t.add(f"{b}: GELU", g, (h,), saved=(h,), segment=seg)
        m = wr.linear(f"{b}: mlp proj", g, BT, 4 * C, C, seg)
        t.until[a2] = f"{b}: mlp proj"  # nn.Sequential's argument
        x2 = t.tensor(f"block {i + 1} input" if i + 1 < c.n_layer else "ln_f input", BTC, f)
        t.add(f"{b}: MLP residual add", x2, (x1, m), passes=(x1, m) if f == p else (x1,), segment=seg)
        x = x2
    logits = wr.linear("lm_head", layer_norm("ln_f", x, -1), BT, C, V, bias=False, weight=wte)
    if logits_held:
        t.tensors[logits] = Held("logits (the loop holds them)", "held", BT * V, p)
    if device == "cpu":  # the tracker first sees the labels when the loss views them
        t.add("labels viewed", t.tensor("labels (the batch, seen by the loss)", BT, 8, "held"))
    wr.loss(logits, BT, V, upcast=True)
    t.held = ("loss", logits) if logits_held else ("loss",)
    t.held += ("labels (the batch, seen by the loss)",) if device == "cpu" else ()
    return t


def _materialized(wr: _Writer, b: str, qkv: str, B: int, T: int, C: int, nh: int, seg: int) -> str:
    """softmax(q k^T / sqrt(hs), masked) v: bmm saves copies of q, k and v (reshaped from strided
    views; with one head they are views), masked_fill its mask, softmax its T x T output (per head),
    the next bmm that output."""
    t, p, S = wr.t, wr.p, B * nh * T * T
    apart = nh > 1  # with one head, q, k, v and the output reshape into bmm's layout without a copy
    copy = {n: t.tensor(f"{b}: {n} ({'a copy' if apart else 'a view'} for bmm)", B * T * C, p) for n in "qkv"}
    if not apart:
        t.views.update({copy[n]: qkv for n in "qkv"})
    for n in "qk":
        t.add(
            f"{b}: {n} {'copied' if apart else 'viewed'}",
            copy[n],
            (qkv,),
            part=True,
            passes=() if apart else (qkv,),
            segment=seg,
        )
    s1 = t.tensor(f"{b}: attention scores (T x T per head)", S, p)
    t.add(f"{b}: q @ k^T", s1, (copy["q"], copy["k"]), saved=(copy["q"], copy["k"]), segment=seg)
    s2 = t.tensor(f"{b}: scaled scores", S, p)
    t.add(f"{b}: scores scaled", s2, (s1,), segment=seg)
    ones = t.tensor(f"{b}: ones (T x T)", T * T, 1)
    t.add(f"{b}: ones", ones, segment=seg)
    mask = t.tensor(f"{b}: causal mask", T * T, 1)
    t.add(f"{b}: tril", mask, reads=(ones,), segment=seg)
    notmask = t.tensor(f"{b}: ~mask", T * T, 1)
    t.add(f"{b}: ~mask", notmask, reads=(mask,), segment=seg)
    s3 = t.tensor(f"{b}: masked scores", S, p)
    t.add(f"{b}: masked_fill", s3, (s2,), saved=(notmask,), segment=seg)
    if wr.device == "cuda" and wr.amp:  # CUDA autocast runs softmax in fp32; the next bmm casts it back
        att = t.tensor(f"{b}: softmax output (fp32)", S, 4)
        t.add(f"{b}: softmax", att, (wr.cast(f"{b}: masked scores", s3, seg=seg),), saved=(att,), segment=seg)
        att16 = wr.cast(f"{b}: softmax output", att, seg=seg)
    else:
        att = att16 = t.tensor(f"{b}: softmax output (T x T per head)", S, p)
        t.add(f"{b}: softmax", att, (s3,), saved=(att,), segment=seg)
    t.add(
        f"{b}: v {'copied' if apart else 'viewed'}",
        copy["v"],
        (qkv,),
        part=True,
        passes=() if apart else (qkv,),
        segment=seg,
    )
    y = t.tensor(f"{b}: attention output (heads apart)", B * T * C, p)
    t.add(f"{b}: attention @ v", y, (att16, copy["v"]), saved=(att16, copy["v"]), segment=seg)
    y2 = t.tensor(f"{b}: attention output (heads side by side{', a copy' if apart else ''})", B * T * C, p)
    if not apart:
        t.views[y2] = y
    t.add(f"{b}: heads side by side", y2, (y,), passes=() if apart else (y,), segment=seg)
    t.until.update({s2: f"{b}: proj", mask: f"{b}: proj"})  # locals of the attention's forward
    return y2


def mlp_tape(
    width: int, depth: int, batch: int, precision: str = "fp32", classes: int = 10, device: str = "cpu"
) -> Tape:
    """Chapter 10: the course's MLP (width x depth, nn.ReLU between the Linears) as a tape; the
    batch's own Linear saves no weight (its input needs no gradient)."""
    wr = _Writer(precision, device)
    x = wr.linear("Linear 0", wr.batch(batch * width), batch, width, width)
    for k in range(depth):
        r = wr.t.tensor(f"ReLU {k} output", batch * width, wr.p)
        wr.t.add(f"ReLU {k}", r, (x,), saved=(r,))
        x = wr.linear(f"Linear {k + 1}", r, batch, width, width if k + 1 < depth else classes)
    wr.loss(x, batch, classes)
    return wr.t


def _conv(
    wr: _Writer,
    name: str,
    x: str,
    cin: int,
    cout: int,
    k: int,
    hw: int,
    batch: int,
    stride: int = 1,
    pad: int | None = None,
    bias: bool = False,
) -> tuple[str, int]:
    """nn.Conv2d: saves its input and weight (under autocast their 16-bit copies), whatever needs a gradient."""
    pad = k // 2 if pad is None else pad
    out_hw = (hw + 2 * pad - k) // stride + 1
    ws = (wr.param(f"{name}.weight", cout * cin * k * k),) + ((wr.param(f"{name}.bias", cout),) if bias else ())
    ws = wr.weights16(ws, -1)
    x = wr.input16(name, x)
    out = wr.t.tensor(f"{name} output", batch * cout * out_hw * out_hw, wr.p)
    wr.t.add(name, out, (() if x in wr.no_grad else (x,)) + ws, saved=(x, ws[0]))
    return out, out_hw


def simplecnn_tape(
    width: int = 64,
    batch: int = 64,
    size: int = 28,
    precision: str = "fp32",
    channels: int = 1,
    classes: int = 10,
    device: str = "cpu",
) -> Tape:
    """Chapter 10: the course's SimpleCNN (two 3x3 convolutions without padding, ReLU, global
    average pool, Linear) as a tape."""
    wr = _Writer(precision, device)
    t = wr.t
    c1, hw = _conv(
        wr, "conv1", wr.batch(batch * channels * size * size), channels, width, 3, size, batch, pad=0, bias=True
    )
    r1 = t.tensor("relu1 output", batch * width * hw * hw, wr.p)
    t.add("relu1", r1, (c1,), saved=(r1,))
    c2, hw = _conv(wr, "conv2", r1, width, 2 * width, 3, hw, batch, pad=0, bias=True)
    r2 = t.tensor("relu2 output", batch * 2 * width * hw * hw, wr.p)
    t.add("relu2", r2, (c2,), saved=(r2,))
    pooled = t.tensor("pooled (the mean of each channel)", batch * 2 * width, wr.p)
    t.add("pool", pooled, (r2,))
    wr.loss(wr.linear("fc", pooled, batch, 2 * width, classes), batch, classes)
    return t


def resnet50_tape(
    batch: int, size: int = 224, precision: str = "fp32", classes: int = 1000, device: str = "cpu"
) -> Tape:
    """Chapter 10: torchvision's ResNet-50 as a tape: convolutions save their input and weight;
    BatchNorm saves its input, batch mean and inverse std; the in-place ReLU saves its output (the
    BatchNorm's); max-pool saves its input and int64 indices; the in-place residual add saves nothing."""
    wr = _Writer(precision, device)
    t = wr.t
    bn_stats = 2 if wr.p == 2 and device == "cpu" else 4  # a CPU BatchNorm keeps 16-bit input's stats in 16 bits

    def conv_bn(name: str, x: str, cin: int, cout: int, k: int, hw: int, stride: int = 1, relu: bool = True):
        c, out_hw = _conv(wr, f"{name}.conv", x, cin, cout, k, hw, batch, stride)
        ws = (wr.param(f"{name}.bn.weight", cout), wr.param(f"{name}.bn.bias", cout))
        t.buffers += [Held(f"{name}.bn running mean and var", "buffers", 2 * cout, wr.w)]
        t.buffers += [Held(f"{name}.bn batches tracked", "buffers", 1, 8)]
        stats = (t.tensor(f"{name}.bn batch mean", cout, bn_stats), t.tensor(f"{name}.bn batch invstd", cout, bn_stats))
        bn = t.tensor(f"{name}.bn output", batch * cout * out_hw * out_hw, wr.p)
        t.add(f"{name}.bn", bn, (c, *ws), saved=(c, *stats), side=stats)
        if relu:
            t.add(f"{name}.relu", bn, (bn,), saved=(bn,))
        return bn, out_hw

    stem, hw = conv_bn("stem", wr.batch(batch * 3 * size * size), 3, 64, 7, size, stride=2)
    hw = (hw + 2 - 3) // 2 + 1
    pooled = t.tensor("stem.pool output", batch * 64 * hw * hw, wr.p)
    indices = t.tensor("stem.pool indices", batch * 64 * hw * hw, 8)
    t.add("stem.pool", pooled, (stem,), saved=(stem, indices), side=(indices,))
    block_in, c_in = pooled, 64
    for stage, (width, blocks, stride) in enumerate(((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))):
        for k in range(blocks):
            name, s = f"layer{stage + 1}.{k}", (stride if k == 0 else 1)
            a, _ = conv_bn(f"{name}.1", block_in, c_in, width, 1, hw)
            b, out_hw = conv_bn(f"{name}.2", a, width, width, 3, hw, stride=s)
            c, _ = conv_bn(f"{name}.3", b, width, 4 * width, 1, out_hw, relu=False)
            identity = block_in
            if k == 0:
                identity, _ = conv_bn(f"{name}.downsample", block_in, c_in, 4 * width, 1, hw, stride=s, relu=False)
            t.add(f"{name}.add", c, (c, identity), passes=(c, identity))
            t.add(f"{name}.relu", c, (c,), saved=(c,))
            block_in, c_in, hw = c, 4 * width, out_hw
    features = t.tensor("avgpool output", batch * 2048, wr.p)
    t.add("avgpool", features, (block_in,))
    wr.loss(wr.linear("fc", features, batch, 2048, classes), batch, classes)
    return t
