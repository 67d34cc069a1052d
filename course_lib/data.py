"""Datasets for the course, with the data's source always printed (loaders: course_lib.loaders).

Where the images come from (provenance and licence: data/README.md):
  shipped   data/fashion_mnist_20k.npz, the default: 10k train (1000/class) + the full 10k test
            split of Fashion-MNIST, committed to the repo, so every notebook runs offline.
  debian    with full=True: the 60k/10k set that `apt-get install dataset-fashion-mnist` puts
            in /usr/share/datasets/fashion-mnist/.
  torchvision-download  full=True or "cifar10", only when downloads are allowed (never in CI
            or under pytest), with a socket timeout. CIFAR-10 only comes this way: its licence
            is unknown, so it is never committed.
  synthetic random tensors, for throughput work where the pixels do not matter.
A dataset that is not available raises DatasetUnavailable with what to do: the loader never
substitutes one dataset for another.

How each source is read (the shipped file's checks, Debian's IDX files, torchvision's download
with a timeout) is plumbing, in course_lib/_sources.py; here is what a learner reads: which source
is used when, and how the arrays become normalised tensors.
"""

from __future__ import annotations

import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from course_lib import _sources as sources  # where the raw arrays come from: plumbing, not for reading

__all__ = ["DATA_DIR", "DatasetUnavailable", "DatasetBundle", "load_dataset", "synthetic_batches"]

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR: Path = Path(os.environ.get("COURSE_DATA_DIR") or REPO_ROOT / "data")
DATASETS = ("fashion_mnist", "cifar10", "synthetic")
FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                   "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]  # fmt: skip
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
# Per-channel statistics of the full training splits. Every Fashion-MNIST source uses the same
# numbers, so a model trained on the subset sees the same input scale as one on the full set.
FASHION_MEAN, FASHION_STD = (0.2860,), (0.3530,)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class DatasetUnavailable(RuntimeError):
    """Chapter 00: the dataset asked for is not available here; the message says how to get it."""


@dataclass
class DatasetBundle:
    """Chapter 00: what load_dataset returns: the two splits plus where they came from."""

    name: str  # "fashion_mnist" | "cifar10" | "synthetic": the data actually inside
    source: str  # "shipped" | "debian" | "torchvision-download" | "synthetic"
    train: TensorDataset  # float32 images (N, C, H, W), normalised with mean/std; int64 labels
    test: TensorDataset
    classes: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    description: str  # one line: what, how many, from where

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """(C, H, W) of one image, e.g. to size a model."""
        return tuple(self.train.tensors[0].shape[1:])


def downloads_off() -> str:
    """Why the loader may not touch the network ("" when it may): each of CI, COURSE_OFFLINE, pytest that holds."""
    on = [var for var in ("CI", "COURSE_OFFLINE") if os.environ.get(var, "").lower() in ("1", "true", "yes")]
    pytest = ["this is a pytest run"] if "PYTEST_CURRENT_TEST" in os.environ else []
    return "; ".join([f"{var}={os.environ[var]} is set" for var in on] + pytest)


def default_cache_dir() -> Path:
    """Where torchvision downloads go (never inside the repo, so never committed)."""
    if os.environ.get("COURSE_CACHE_DIR"):
        return Path(os.environ["COURSE_CACHE_DIR"])
    if "google.colab" in sys.modules:
        return Path("/content/data")
    return Path.home() / ".cache" / "amp-course"


def _shipped_path() -> Path:
    # Read the environment at call time too, so a notebook (or test) can redirect it late.
    return Path(os.environ.get("COURSE_DATA_DIR") or DATA_DIR) / sources.SHIPPED_FILE


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


# ----------------------------------------------------------------------------- assembly


def _balanced_prefix(y: np.ndarray, n: int | None, num_classes: int) -> np.ndarray:
    """Indices of the first n//k images of every class (remainder to the lowest classes), in order.

    Deterministic and class-balanced, so a 2,000-image CPU run still sees every class equally.
    """
    if n is None or n >= len(y):
        return np.arange(len(y))
    picks = [np.flatnonzero(y == c)[: n // num_classes + (c < n % num_classes)] for c in range(num_classes)]
    return np.sort(np.concatenate(picks))


def _to_dataset(x: np.ndarray, y: np.ndarray, mean, std) -> TensorDataset:
    xt = torch.from_numpy(x)
    if xt.ndim == 3:
        xt = xt.unsqueeze(1)  # (N, H, W) -> (N, 1, H, W)
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    # Normalise once here, not per batch: the data is small and this keeps loaders trivial.
    # (x - 255 m) / (255 s) is (x / 255 - m) / s with one pass less over the data.
    xt = xt.to(torch.float32).sub_(m * 255).div_(s * 255)
    return TensorDataset(xt, torch.from_numpy(np.asarray(y)).to(torch.int64))


def _synthetic(train_size: int | None, test_size: int | None) -> tuple:
    """synthetic_batches' random images and labels as two datasets: train (seed 0) and test (seed 1)."""
    sizes = (train_size or 10_000, test_size or 2_000)
    return tuple(TensorDataset(*synthetic_batches(1, n, seed=seed)[0]) for seed, n in enumerate(sizes))


def synthetic_batches(
    n_batches: int, batch_size: int, shape=(3, 32, 32), num_classes=10, device="cpu", dtype=torch.float32, seed=0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Chapter 07: random (x, y) batches made on `device`, for throughput: no PIL, no host-to-device copy
    (torchvision's FakeData tops out near 1.5k img/s on a CPU), so a step measures the model, not the
    input pipeline (chapter 00's table, chapter 08's DDP worker). Cycle a few for long runs: each costs
    memory (3x224x224 fp32 x 256 is ~150 MB)."""
    g = torch.Generator(device=device).manual_seed(seed)
    batches = []
    for _ in range(n_batches):  # x then y from one generator: the same seed gives the same batches
        x = torch.randn(batch_size, *shape, generator=g, device=device, dtype=dtype)
        batches.append((x, torch.randint(0, num_classes, (batch_size,), generator=g, device=device)))
    return batches


def load_dataset(
    name: str = "fashion_mnist",
    *,
    full: bool = False,
    allow_download: bool | None = None,
    root: str | Path | None = None,
    train_size: int | None = None,
    test_size: int | None = None,
    verbose: bool = True,
) -> DatasetBundle:
    """Chapter 00: load a dataset as normalised float32 tensors, printing where it came from.

    name: "fashion_mnist" (default: the shipped 10k/10k subset), "cifar10" (download only:
      its licence is unknown, so it is never shipped), or "synthetic" (random 3x32x32 images
      with random labels, for throughput work).
    full: Fashion-MNIST's full 60k/10k, from the Debian package or a download.
    allow_download: None means allowed unless downloads_off() names a reason (CI, COURSE_OFFLINE, pytest).
    root: torchvision's download/cache folder (default: default_cache_dir()).
    train_size / test_size: keep a class-balanced deterministic prefix (fast CPU runs).
    What you ask for is what you get: a dataset that is not available raises
    DatasetUnavailable saying how to get it; another dataset is never substituted.
    """
    key = name.lower().replace("-", "_")
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    for arg, n in (("train_size", train_size), ("test_size", test_size)):
        if n is not None and n < 1:
            raise ValueError(f"{arg} must be a positive number of images or None (all), got {n}")
    off = downloads_off()  # why downloads are off ("" if they are on)
    if allow_download is not None:
        off = "" if allow_download else "allow_download=False was passed"
    allow = not off
    root = Path(root) if root is not None else default_cache_dir()
    notes: list[str] = []

    def say(msg: str) -> None:
        notes.append(msg)
        if verbose:
            print(f"data: note: {msg}")

    def why() -> str:  # why torchvision gave nothing, saying only the reason that applies here
        had = f"the copy in {root} did not load ({notes[-1]})" if notes else f"it is not in {root}"
        return f"{had}, and downloads are off ({off})" if off else f"downloading it failed ({notes[-1]})"

    if key == "synthetic":
        train, test = _synthetic(train_size, test_size)
        what = (
            f"synthetic random images, 3x32x32 ({len(train):,} train / {len(test):,} test), labels random: "
            "for throughput, not accuracy"
        )
        bundle = DatasetBundle(
            name="synthetic",
            source="synthetic",
            train=train,
            test=test,
            classes=[f"class {i}" for i in range(10)],
            mean=(0.0,) * 3,
            std=(1.0,) * 3,
            description=what,
        )
        if verbose:
            print(textwrap.fill(f"data: {bundle.description}", 100, subsequent_indent="      "))
        return bundle

    raw, source, origin = None, "", ""
    debian_origin = f"from {sources.DEBIAN_DIR} (Debian package dataset-fashion-mnist)"
    torchvision_origin = f"via torchvision, cached in {root}"
    if key == "cifar10":
        if allow or sources.torchvision_cached("cifar10", root):
            raw = sources.torchvision_arrays("cifar10", root, download=allow, say=say)
            source, origin = "torchvision-download", torchvision_origin
        if raw is None:
            fix = "Online, load_dataset('cifar10', allow_download=True) fetches it (170 MB)" if off else "Fix that"
            raise DatasetUnavailable(
                f"CIFAR-10 is not shipped with the course (its licence is unknown); {why()}. {fix}; "
                "offline, use load_dataset('fashion_mnist') or 'synthetic'."
            )
    elif full:
        if (files := sources.debian_files(sources.DEBIAN_DIR)) is not None:
            raw, source, origin = tuple(sources.read_idx(f) for f in files), "debian", debian_origin
        elif allow or sources.torchvision_cached("fashion_mnist", root):
            raw = sources.torchvision_arrays("fashion_mnist", root, download=allow, say=say)
            source, origin = "torchvision-download", torchvision_origin
        if raw is None:
            raise DatasetUnavailable(
                f"the full Fashion-MNIST (60k/10k) is not here: {sources.DEBIAN_DIR} is not installed; {why()}. "
                "Install it with `sudo apt-get install dataset-fashion-mnist`, go online with load_dataset(full=True, "
                "allow_download=True), or use the shipped subset: load_dataset() without full=True."
            )
    else:
        path = _shipped_path()
        if path.is_file():  # present but broken -> _load_shipped raises: never mask a bad file
            a = sources.load_shipped(path)
            raw = (a["x_train"], a["y_train"], a["x_test"], a["y_test"])
            source, origin = "shipped", f"from {_display(path)}"
        else:
            raise DatasetUnavailable(
                f"the shipped Fashion-MNIST subset {path} is missing. Restore it with "
                f"`git checkout -- data/{sources.SHIPPED_FILE}` (or re-clone the course), or rebuild it with "
                f"`python data/build_subset.py` (needs `apt-get install dataset-fashion-mnist`)."
            )

    x_train, y_train, x_test, y_test = raw
    is_cifar = key == "cifar10"
    classes = CIFAR10_CLASSES if is_cifar else FASHION_CLASSES
    for arg, n, y in (("train_size", train_size, y_train), ("test_size", test_size, y_test)):
        if n is not None and n > len(y):
            say(f"{arg}={n:,} is more than this source has; using all {len(y):,}")
    it = _balanced_prefix(y_train, train_size, len(classes))
    ie = _balanced_prefix(y_test, test_size, len(classes))
    mean, std = (CIFAR10_MEAN, CIFAR10_STD) if is_cifar else (FASHION_MEAN, FASHION_STD)
    train = _to_dataset(x_train[it], y_train[it], mean, std)
    test = _to_dataset(x_test[ie], y_test[ie], mean, std)
    kind = "shipped subset" if source == "shipped" else "full set"
    prefix = ", class-balanced prefix" if train_size is not None or test_size is not None else ""
    description = (
        f"{'CIFAR-10' if is_cifar else 'Fashion-MNIST'}, {kind} ({len(train):,} train / "
        f"{len(test):,} test{prefix}) {origin}"
    )
    bundle = DatasetBundle(
        name=key,
        source=source,
        train=train,
        test=test,
        classes=list(classes),
        mean=tuple(mean),
        std=tuple(std),
        description=description,
    )
    if verbose:
        print(textwrap.fill(f"data: {bundle.description}", 100, subsequent_indent="      "))
    return bundle
