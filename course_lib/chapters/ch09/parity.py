"""Does mixed precision learn the same model? Chapter 09's answer, measured against seed noise.

A speed-up is worth nothing if the model learns less. `accuracy_parity` trains the course's CNN
three times (fp32 with two seeds, the device's mixed precision with the first); `read_parity`
compares the mixed-precision difference with the difference two fp32 seeds make.
"""

from __future__ import annotations

import textwrap

import torch
from tqdm.auto import tqdm

from course_lib.data import load_dataset
from course_lib.device import mixed_precision_for, pick_device
from course_lib.loaders import make_loader
from course_lib.models import SimpleCNN
from course_lib.train import History, TrainConfig, Trainer

__all__ = ["accuracy_parity", "read_parity"]


def accuracy_parity(
    device: str = "auto",
    train_size: int | None = None,
    test_size: int = 1000,
    epochs: int = 3,
    batch: int = 64,
    width: int | None = None,
    lr: float = 5e-3,
) -> dict[str, History]:
    """Chapter 09: the course's CNN trained on the shipped Fashion-MNIST three times: fp32 with seed 0,
    fp32 with seed 1 (how much two seeds differ: the noise), and mixed precision with seed 0.

    Defaults: on a GPU the full width (64) on the 10,000 shipped images; on a CPU width 16 on 2,048.
    """
    dev = pick_device(device)
    cuda = dev.type == "cuda"
    ds = load_dataset(train_size=train_size or (None if cuda else 2048), test_size=test_size, verbose=False)
    runs = {}
    three = (
        ("fp32, seed 0", "fp32", 0),
        ("fp32, seed 1", "fp32", 1),
        (f"{mixed_precision_for(dev)}, seed 0", mixed_precision_for(dev), 0),
    )
    for label, precision, seed in tqdm(three, desc="runs", leave=False):  # a bar while they train, gone after
        torch.manual_seed(seed)
        model = SimpleCNN(in_channels=1, width=width or (64 if cuda else 16))
        cfg = TrainConfig(precision=precision, device=str(dev), epochs=epochs, log_every=8, progress=False)
        trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=lr), cfg)
        runs[label] = trainer.fit(
            make_loader(ds.train, batch, seed=seed), eval_loader=make_loader(ds.test, 500, shuffle=False)
        )
    return runs


def read_parity(runs: dict[str, History]) -> str:
    """Chapter 09: the mixed-precision run against the fp32 run of the same seed, measured against the
    difference two fp32 seeds make: is AMP's effect on accuracy larger than the noise?"""
    a, seed1, b = runs
    acc = {k: h.eval[-1]["accuracy"] for k, h in runs.items()}
    noise, effect = abs(acc[a] - acc[seed1]), abs(acc[b] - acc[a])
    verdict = (
        "within the seed-to-seed noise"
        if effect <= noise
        else "larger than the seed-to-seed noise of this run; repeat with more seeds before concluding"
    )
    return "\n".join(
        [
            "test accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in acc.items()),
            textwrap.fill(
                f"{b} vs {a}: {effect:.3f} apart; {a} vs {seed1}: {noise:.3f} apart. The "
                f"mixed-precision difference is {verdict}.",
                100,
            ),
        ]
    )
