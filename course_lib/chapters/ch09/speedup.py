"""A deliberately slow training script, and the settings that make it fast: exercise 09.

Chapter 09's exercise hands you `run_script(settings)`, a complete training script (data, model,
optimizer, loop, evaluation) whose every choice is one entry of a settings dict. `SLOW` holds
the choices of its author, each of them a mistake seen in real scripts that costs time and
changes nothing that is learned. Your job is to find them, measure them, and return settings
that train the same model to the same accuracy in much less time.

    result = run_script(SLOW)                 # {"seconds", "accuracy", "steps", "samples", ...}
    faster = run_script({**SLOW, "detect_anomaly": False})

The recipe (RECIPE: seed, data, model, batch size, learning rate, epochs) decides what is
learned and is not yours to change; the rest decides how fast the same thing is computed.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings

import torch
from torch.utils.data import Dataset, TensorDataset

from course_lib.data import load_dataset
from course_lib.device import pick_device, recommend_precision
from course_lib.loaders import SeededSampler, make_loader
from course_lib.models import MLP
from course_lib.train import AMP_DTYPES, amp_step

__all__ = ["SLOW", "RECIPE", "CHOICES", "validate_settings", "run_script", "format_result", "format_speedup"]

SLOW: dict = {
    # the recipe: what is learned
    "seed": 0,
    "train_size": 2000,
    "test_size": 1000,
    "batch_size": 32,
    "lr": 2e-3,
    "epochs": 2,
    # how it is computed
    "data": "per_sample",  # "per_sample" | "tensors" | "device"  (see _batches)
    "num_workers": 2,  # DataLoader worker processes ("per_sample" and "tensors" only)
    "persistent_workers": False,  # keep the workers between epochs (and between evaluations)
    "eval_every": 10,  # evaluate on the whole test set every N steps (None: only at the end)
    "log_every": 1,  # read the loss back with .item() every N steps
    "detect_anomaly": True,  # torch.autograd.detect_anomaly around the training
    "precision": "fp32",  # "fp32" | "bf16" | "fp16" | "auto" (course_lib.device.recommend_precision)
    "optimizer": "for-loop",  # AdamW implementation: "for-loop" | "foreach" | "fused"
    "max_steps": None,  # stop after this many optimizer steps (None: all epochs)
}
RECIPE = ("seed", "train_size", "test_size", "batch_size", "lr", "epochs")
CHOICES = {
    "data": ("per_sample", "tensors", "device"),
    "precision": ("fp32", "bf16", "fp16", "auto"),
    "optimizer": ("for-loop", "foreach", "fused"),
    "persistent_workers": (False, True),
    "detect_anomaly": (False, True),
}


def validate_settings(settings: object) -> dict:
    """Chapter 09: SLOW updated with `settings`, or ValueError saying what is wrong with them."""
    if not isinstance(settings, dict):
        raise ValueError(f"settings must be a dict like SLOW, not {type(settings).__name__}")
    unknown = sorted(set(settings) - set(SLOW))
    if unknown:
        raise ValueError(f"unknown settings {unknown}; the script takes {sorted(SLOW)}")
    s = {**SLOW, **settings}
    for key, allowed in CHOICES.items():
        if s[key] not in allowed or type(s[key]) is not type(allowed[0]):
            raise ValueError(f"{key}={s[key]!r}: choose one of {list(allowed)}")
    ints = {
        "num_workers": (0, 16),
        "log_every": (1, 10**6),
        "eval_every": (1, 10**6),
        "max_steps": (1, 10**6),
        "seed": (0, 2**31),
        "train_size": (1, 10_000),
        "test_size": (1, 10_000),
        "batch_size": (1, 4096),
        "epochs": (1, 100),
    }
    for key, (lo, hi) in ints.items():
        value = s[key]
        if (value is None and key in ("eval_every", "max_steps")) or (type(value) is int and lo <= value <= hi):
            continue
        raise ValueError(
            f"{key}={value!r}: expected an int from {lo} to {hi}"
            + (" or None" if key in ("eval_every", "max_steps") else "")
        )
    if not (isinstance(s["lr"], float) and 0 < s["lr"] < 1):
        raise ValueError(f"lr={s['lr']!r}: expected a float between 0 and 1")
    if s["persistent_workers"] and (s["num_workers"] == 0 or s["data"] == "device"):
        raise ValueError("persistent_workers=True needs a DataLoader with num_workers > 0")
    return s


# --------------------------------------------------------------------------- the data


@functools.cache
def _uint8(train_size: int, test_size: int) -> tuple[torch.Tensor, ...]:
    """The shipped Fashion-MNIST as stored: uint8 images (N, 1, 28, 28) and labels."""
    bundle = load_dataset(train_size=train_size, test_size=test_size, verbose=False)
    mean, std = bundle.mean[0] * 255, bundle.std[0] * 255
    out = []
    for x, y in (bundle.train.tensors, bundle.test.tensors):
        out += [(x * std + mean).round_().clamp_(0, 255).to(torch.uint8), y]
    return tuple(out)


def _normalise(x: torch.Tensor) -> torch.Tensor:
    """uint8 -> float32 in [0, 1] -> standardised (Fashion-MNIST's mean and std)."""
    return (x.float() / 255 - 0.2860) / 0.3530


class PerSampleImages(Dataset):
    """What many scripts do: keep the raw images, convert and normalise one image per __getitem__."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _normalise(self.images[i]), self.labels[i]


def _batches(s: dict, images: torch.Tensor, labels: torch.Tensor, device: torch.device, shuffle: bool):
    """An iterable of (x, y) batches on `device`, in SeededSampler's order when shuffling.

    per_sample: a DataLoader over PerSampleImages (the transform runs for every image, every epoch);
    tensors:    normalised once, a DataLoader over a TensorDataset (still one __getitem__ per image);
    device:     normalised once and moved to the device once; batches are slices, no DataLoader.
    All three give the same batches in the same order, so the same model is learned.
    """
    if s["data"] == "device":
        x, y = _normalise(images).to(device), labels.to(device)
        sampler = SeededSampler(len(y), s["seed"]) if shuffle else None

        def epoch():
            order = torch.tensor(list(sampler), device=device) if sampler else torch.arange(len(y), device=device)
            for i in range(0, len(y), s["batch_size"]):
                idx = order[i : i + s["batch_size"]]
                yield x[idx], y[idx]

        class _Epochs:  # re-iterable like a DataLoader; the sampler advances one epoch per pass
            def __iter__(self):
                return epoch()

        return _Epochs()
    dataset = (
        PerSampleImages(images, labels) if s["data"] == "per_sample" else TensorDataset(_normalise(images), labels)
    )
    return make_loader(
        dataset,
        s["batch_size"],
        shuffle=shuffle,
        seed=s["seed"],
        num_workers=s["num_workers"],
        persistent_workers=s["persistent_workers"],
    )


# --------------------------------------------------------------------------- the script


def run_script(settings: dict | None = None, device: str = "auto") -> dict:
    """Chapter 09: train an MLP on the shipped Fashion-MNIST as `settings` say (SLOW, updated).

    Returns seconds (data preparation, training and every evaluation: the wall time from the
    raw images in memory to the final accuracy), the final test accuracy, the optimizer steps,
    samples trained on, evaluations run and losses read back. The script is the lesson; the
    clock and the counts (`_Tally`), evaluation and anomaly mode are its instruments, below.
    """
    s = validate_settings(settings or {})
    dev = pick_device(device)
    precision = recommend_precision(dev).precision if s["precision"] == "auto" else s["precision"]
    dtype = AMP_DTYPES[precision]
    train_x, train_y, test_x, test_y = _uint8(s["train_size"], s["test_size"])
    tally = _Tally()  # the clock starts here
    torch.manual_seed(s["seed"])
    model = MLP(hidden=256, depth=2).to(dev)
    impl = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], **impl[s["optimizer"]])
    scaler = torch.amp.GradScaler(dev.type, enabled=precision == "fp16")
    train = _batches(s, train_x, train_y, dev, shuffle=True)
    test = _batches(s, test_x, test_y, dev, shuffle=False)
    with _anomaly_mode(s["detect_anomaly"]):
        for _ in range(s["epochs"]):
            for x, y in train:
                if s["max_steps"] is not None and tally.steps >= s["max_steps"]:
                    break
                step = amp_step(model, opt, scaler, [(x.to(dev), y.to(dev))], dtype)  # the course's AMP step
                tally.step(len(y))
                if tally.steps % s["log_every"] == 0:
                    tally.losses.append(step.loss.item())  # a device-to-host copy: the host waits for the GPU
                if s["eval_every"] and tally.steps % s["eval_every"] == 0:
                    _evaluate(model, test, len(test_y), dev, dtype)
                    tally.evaluations += 1
    accuracy = _evaluate(model, test, len(test_y), dev, dtype)
    return tally.result(accuracy, precision, dev)


# --------------------------------------------------------------------------- run_script's instruments


class _Tally:
    """The clock and the counts of one run_script run: what it did, beside what it teaches."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.steps = self.samples = self.evaluations = 0
        self.losses: list[float] = []  # the losses read back, where the settings read them

    def step(self, samples: int) -> None:
        self.steps, self.samples = self.steps + 1, self.samples + samples

    def result(self, accuracy: float, precision: str, dev: torch.device) -> dict:
        return {
            "seconds": time.perf_counter() - self.t0,
            "accuracy": accuracy,
            "steps": self.steps,
            "samples": self.samples,
            "evaluations": self.evaluations + 1,  # and the final one
            "losses_read": len(self.losses),
            "precision": precision,
            "device": str(dev),
        }


def _evaluate(model: torch.nn.Module, test, n: int, dev: torch.device, dtype: torch.dtype | None) -> float:
    """The test accuracy, under the run's autocast; the model back in training mode after."""
    model.eval()
    correct = torch.zeros((), device=dev)
    with torch.no_grad(), torch.autocast(dev.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        for x, y in test:
            correct += (model(x.to(dev)).argmax(1) == y.to(dev)).sum()
    model.train()
    return correct.item() / n


def _anomaly_mode(on: bool) -> contextlib.AbstractContextManager:
    """torch.autograd.detect_anomaly where the settings ask for it, without its warning about the runtime."""
    if not on:
        return contextlib.nullcontext()
    with warnings.catch_warnings():  # torch warns that anomaly mode "will increase the runtime"
        warnings.simplefilter("ignore")
        return torch.autograd.detect_anomaly()


def format_result(label: str, r: dict) -> str:
    """Chapter 09: one run_script result on one line (at most 100 characters)."""
    return (
        f"{label[:20]:<20}{r['seconds']:>6.2f} s  accuracy {r['accuracy']:.3f}  {r['steps']} steps"
        f"  {r['samples']:,} samples  {r['evaluations']} evaluations  {r['losses_read']} .item()"
    )


def format_speedup(ratio: float) -> str:
    """Chapter 09: a ratio of times, old / new, in words: "5.23x faster", or below 1 "1.25x slower"
    (never "0.80x faster" for something slower)."""
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
