"""course_lib.chapters.ch10: a seeded sweep of training steps, each predicted by `predict_step` and measured
by MemTracker on this CPU (`measured_step`): every one within 2%, and most to the byte.

The generator draws steps across every model of the course (the GPT, the MLP, SimpleCNN, torchvision's
ResNet-50), every precision recipe, every optimizer and implementation, checkpointing and both attention
kinds, and the shapes that move the peak to each moment a peak can fall at. The shapes are small:
MemTracker runs on fake tensors, so a step's cost is its number of ops (about a third of a second for a
one- or two-block GPT, two for ResNet-50's 160 layers), not its size. The rest of chapter 10's tests
(the tapes, the recorded GPU run, the explorer, the options refused) are in tests/test_memory_model.py.
"""

import random
import time

import pytest

from course_lib.chapters.ch10.measure import measured_step
from course_lib.chapters.ch10.predict import OPTIMIZERS, PRECISIONS, Step, predict_step
from course_lib.models import GPTConfig

TARGET = 0.02


def sweep_steps(seed: int = 42) -> list[Step]:
    """Every precision with every optimizer it takes, on a GPT of random shape, attention and
    checkpointing (one block, or two a time in three), and four more drawn at random; long
    materialized sequences (a block's re-run, and one block's forward), few tokens (the tied weight's
    gradient sum); the MLP and SimpleCNN twice in every precision; ResNet-50 in three."""
    rng = random.Random(seed)

    def gpt(precision: str, optimizer: str, config: GPTConfig | None = None, **how) -> Step:
        n_head = rng.choice((1, 2, 4))
        config = config or GPTConfig(
            vocab_size=rng.choice((64, 256, 1024)),
            block_size=256,
            n_layer=rng.choice((1, 1, 2)),
            n_head=n_head,
            n_embd=n_head * rng.choice((8, 16)),
        )
        shape = {
            "batch": rng.randint(1, 4),
            "seq": rng.choice((8, 32, 64)),
            "attention": rng.choice(("sdpa", "materialized")),
            "checkpointing": rng.random() < 0.4,
            "logits_held": rng.random() < 0.8,
            **how,
        }
        return Step("gpt", config=config, precision=precision, optimizer=optimizer, **shape)

    def takes(precision: str) -> list[str]:
        return [o for o in OPTIMIZERS if precision != "bf16-master" or o.startswith("adamw")]

    steps = [gpt(p, o) for p in PRECISIONS for o in takes(p)]
    steps += [
        gpt(p, "adamw-fused", seq=256, attention="materialized", checkpointing=True)
        for p in ("fp32", "bf16", "bf16-pure")
    ]
    steps += [gpt(p, "adamw-fused", batch=1, seq=4) for p in ("fp32", "bf16", "bf16-master")]
    one_block = GPTConfig(vocab_size=256, block_size=256, n_layer=1, n_head=4, n_embd=32)  # T x T in forward
    steps += [
        gpt(p, "adamw", one_block, batch=2, seq=256, attention="materialized", checkpointing=False)
        for p in ("fp32", "bf16")
    ]
    for _ in range(4):  # and a few more, every option drawn
        precision = rng.choice(PRECISIONS)
        steps.append(gpt(precision, rng.choice(takes(precision))))
    for precision in PRECISIONS * 2:
        optimizer = rng.choice(takes(precision))
        steps.append(
            Step(
                "mlp",
                rng.choice((16, 64, 512)),
                width=rng.choice((32, 128, 512)),
                depth=rng.randint(1, 3),
                precision=precision,
                optimizer=optimizer,
            )
        )
        steps.append(
            Step(
                "simplecnn",
                rng.randint(1, 16),
                size=rng.choice((12, 28)),
                width=rng.choice((8, 16, 32)),
                precision=precision,
                optimizer=rng.choice(("sgd", "sgd-momentum", "adamw-fused", "adamw"))
                if precision != "bf16-master"
                else "adamw-foreach",
            )
        )
    # ResNet-50's AdamW for-loop and foreach steps cost most to measure (a few ops for each of its 161
    # tensors); the GPT rows measure those implementations, ResNet-50 the fused one
    for precision, optimizer in (("fp32", "sgd-momentum"), ("bf16", "adamw-fused"), ("bf16-pure", "sgd")):
        steps.append(Step("resnet50", 2, size=rng.choice((32, 64)), precision=precision, optimizer=optimizer))
    return steps


SWEEP = sweep_steps()
RESULTS: dict[int, tuple[int, int, float]] = {}  # index -> (predicted, measured, CPU seconds)


def test_the_sweep_covers_every_model_precision_optimizer_checkpointing_and_attention():
    assert len(SWEEP) >= 60
    assert {s.model for s in SWEEP} == {"gpt", "mlp", "simplecnn", "resnet50"}
    assert {s.precision for s in SWEEP} == set(PRECISIONS)
    assert {s.optimizer for s in SWEEP} == set(OPTIMIZERS)
    for model in ("gpt", "mlp", "simplecnn", "resnet50"):
        kinds = {s.optimizer_kind.split("-")[0] for s in SWEEP if s.model == model}
        assert {"sgd", "adamw"} <= kinds, (model, kinds)
    gpt = [s for s in SWEEP if s.model == "gpt"]
    assert {(s.checkpointing, s.gpt.sdpa) for s in gpt} == {(c, a) for c in (False, True) for a in (False, True)}
    assert {s.gpt.n_layer for s in gpt} == {1, 2} and {s.logits_held for s in gpt} == {False, True}


@pytest.mark.parametrize("i", range(len(SWEEP)), ids=lambda i: f"{i:02d}-{SWEEP[i].model}-{SWEEP[i].precision}")
def test_every_swept_step_is_predicted_within_two_percent(i):
    step = SWEEP[i]
    start = time.process_time()
    measured = measured_step(step)["Total"]
    prediction = predict_step(step)
    RESULTS[i] = (prediction.peak, measured, time.process_time() - start)
    assert abs(prediction.peak / measured - 1) < TARGET, (step, prediction.moment, prediction.peak, measured)


def test_most_swept_steps_are_predicted_to_the_byte():
    if len(RESULTS) < len(SWEEP):
        pytest.skip("runs after the whole sweep, in the same process")
    exact = sum(p == m for p, m, _ in RESULTS.values())
    # On the torch this course is developed on every step is exact. On the declared floor (torch 2.6)
    # the GPT steps under a GradScaler measure 4 bytes more at the start of backward (one more
    # one-element fp32 gradient alive there): within 2%, not to the byte.
    assert exact >= 0.85 * len(SWEEP), f"{exact} of {len(SWEEP)} to the byte"


def test_the_sweep_reaches_every_moment_a_peak_can_fall_at():
    names = [predict_step(s).moment for s in SWEEP]
    assert {n.split(":")[0] for n in names} >= {"forward", "recompute", "backward", "step"}
    assert any("T x T" in n or "masked_fill" in n or "softmax" in n for n in names if n.startswith("forward"))
    assert any("wte.weight's gradients summed" in n for n in names) and any(n.endswith("log-softmax") for n in names)
    assert any(n.startswith("step: bf16 gradients copied") for n in names)
    for kind in ("forloop", "foreach"):
        assert any(n == f"step: adamw-{kind}" for n in names), kind
