"""Data loading measured against the model's consumption rate: workers, pinning, prefetching, seeds.

Chapter 07. A training step waits for its batch whenever the input pipeline produces batches
more slowly than the model consumes them; the time spent in `next(iterator)` is the data wait.
Here the pipeline is real (torchvision.transforms.v2 augmentations applied image by image on
the CPU, as an image-folder dataset does) and the model's compute is either real or simulated:
`simulated_step(ms)` sleeps, leaving the CPU free, as a host does while its GPU computes.
The measurement (measure_loader, sweep, their table and plot) is in course_lib.chapters.ch07.data_wait.

    run = measure_loader(DataLoader(AugmentedImages(images, labels), batch_size=64, num_workers=2),
                         simulated_step(40), steps=16)
    print(run)                                   # images/s, step time with spread, data-wait fraction
    python -m course_lib.chapters.ch07.loading --json data/reference/loading_<gpu>.json
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, get_worker_info

from course_lib.chapters.ch07.data_wait import LoaderRun, cpus, format_runs, measure_loader, simulated_step, sweep
from course_lib.data import FASHION_MEAN, FASHION_STD, DatasetBundle, load_dataset
from course_lib.reference import record
from course_lib.tables import table
from course_lib.timing import time_fn

__all__ = [
    "raw_images",
    "augmentation",
    "AugmentedImages",
    "SlowStorage",
    "ArgsSwallowingDataset",
    "NumpyRngDataset",
    "reseed_numpy",
    "augment_batch",
    "DeviceLoader",
    "copy_timings",
    "format_copy_rows",
    "format_loading_reference",
]


# --------------------------------------------------------------------------- the pipeline


def raw_images(bundle: DatasetBundle) -> tuple[torch.Tensor, torch.Tensor]:
    """Chapter 07: the uint8 images (N, C, H, W) and labels behind a normalised bundle.

    load_dataset normalises once for convenience; a real pipeline decodes uint8 images and
    augments them on the CPU, so the chapter undoes the normalisation (exactly: the error of
    float32 is far below the 0.5 that rounding removes).
    """
    x, y = bundle.train.tensors
    mean = torch.tensor(bundle.mean).view(1, -1, 1, 1) * 255
    std = torch.tensor(bundle.std).view(1, -1, 1, 1) * 255
    return (x * std + mean).round_().clamp_(0, 255).to(torch.uint8), y


def augmentation(size: int = 28, mean: Sequence[float] = FASHION_MEAN, std: Sequence[float] = FASHION_STD):
    """Chapter 07: a typical training augmentation, torchvision.transforms.v2 on one uint8 image.

    Random resized crop, flip, small rotation and shift, brightness and contrast jitter, then
    float32 normalised, and random erasing. About a millisecond per 28x28 image on one core.
    """
    try:
        from torchvision.transforms import v2
    except (ImportError, RuntimeError, OSError) as e:  # a torchvision that does not match torch
        raise RuntimeError(
            f"chapter 07 needs torchvision.transforms.v2 ({type(e).__name__}: {e}); pip install -U torch torchvision"
        ) from e
    return v2.Compose(
        [
            v2.RandomResizedCrop(size, scale=(0.6, 1.0), antialias=True),
            v2.RandomHorizontalFlip(),
            v2.RandomAffine(degrees=10, translate=(0.1, 0.1)),
            v2.ColorJitter(brightness=0.3, contrast=0.3),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(list(mean), list(std)),
            v2.RandomErasing(p=0.25),
        ]
    )


class AugmentedImages(Dataset):
    """Chapter 07: uint8 images augmented one at a time in __getitem__, where the loader's workers run it."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Callable | None = None):
        self.images, self.labels = images, labels
        self.transform = transform if transform is not None else augmentation(images.shape[-1])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(self.images[i]), self.labels[i]


class SlowStorage(Dataset):
    """Chapter 07: another dataset behind storage that answers after `ms` (a network disk, say).

    Waiting is not computing: a worker that sleeps leaves its core to the others. With
    `slow_every` = k, every k-th read takes `slow_factor` times as long (a hiccup).
    """

    def __init__(self, dataset: Dataset, ms: float, slow_every: int = 0, slow_factor: float = 10.0):
        self.dataset = dataset
        self.ms = ms  # how long reading one sample takes
        self.slow_every = slow_every  # every slow_every-th sample is slow_factor times slower (0: never)
        self.slow_factor = slow_factor

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        slow = self.slow_every and i % self.slow_every == 0
        time.sleep(self.ms * (self.slow_factor if slow else 1) / 1000)
        return self.dataset[i]


class ArgsSwallowingDataset(AugmentedImages):
    """Chapter 07: a Dataset that, like many hand-written ones, accepts and ignores **kwargs.

    Given DataLoader arguments (num_workers=16, pin_memory=True ...) it raises nothing, and the
    loader built on it runs with DataLoader's defaults: one process, no pinning.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Callable | None = None, **kwargs):
        super().__init__(images, labels, transform)


class NumpyRngDataset(Dataset):
    """Chapter 07: items drawn from a numpy Generator the dataset owns, as some augmentation code does.

    Every forked worker gets a copy of that Generator in the same state, so the workers draw the
    same "random" numbers, unless `reseed_numpy` re-seeds it in each worker.
    """

    def __init__(self, n: int = 8, seed: int = 0):
        self.n, self.rng = n, np.random.default_rng(seed)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> float:
        return float(self.rng.random())


def reseed_numpy(worker_id: int) -> None:
    """Chapter 07: a worker_init_fn: give the dataset's numpy Generator this worker's own seed.

    DataLoader seeds torch and `random` in each worker with base_seed + worker_id (and the
    global numpy RNG too); get_worker_info().seed is that number, different for every worker
    and, with the loader's `generator` seeded, the same in every run.
    """
    info = get_worker_info()
    info.dataset.rng = np.random.default_rng(info.seed)


# --------------------------------------------------------------------------- no loader at all


def augment_batch(
    x: torch.Tensor,
    generator: torch.Generator,
    mean: Sequence[float] = FASHION_MEAN,
    std: Sequence[float] = FASHION_STD,
    pad: int = 2,
) -> torch.Tensor:
    """Chapter 07: a whole uint8 batch augmented at once on its device, a different draw per image.

    Random shift by up to `pad` pixels (zero padding), horizontal flip, brightness and contrast
    jitter, then normalised float32. A few tensor ops per batch instead of a few per image.
    """
    n, c, h, w = x.shape
    dev = x.device
    xp = F.pad(x.float().div_(255), (pad,) * 4)
    dy, dx = torch.randint(0, 2 * pad + 1, (2, n), device=dev, generator=generator)
    rows = (dy[:, None] + torch.arange(h, device=dev))[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w, device=dev))[:, None, None, :]
    out = xp[
        torch.arange(n, device=dev)[:, None, None, None], torch.arange(c, device=dev)[None, :, None, None], rows, cols
    ]
    flip = torch.rand(n, 1, 1, 1, device=dev, generator=generator) < 0.5
    out = torch.where(flip, out.flip(-1), out)
    scale = 1 + 0.3 * (2 * torch.rand(n, 1, 1, 1, device=dev, generator=generator) - 1)
    shift = 0.3 * (2 * torch.rand(n, 1, 1, 1, device=dev, generator=generator) - 1) * out.mean((1, 2, 3), True)
    out = (out * scale + shift).clamp_(0, 1)
    m = torch.tensor(mean, device=dev).view(1, -1, 1, 1)
    s = torch.tensor(std, device=dev).view(1, -1, 1, 1)
    return (out - m) / s


class DeviceLoader:
    """Chapter 07: a small dataset kept whole on the device: shuffled and augmented there, batch by batch.

    No workers, no pinning, no copies: each epoch is a randperm and slices. Right when the
    dataset (uint8 here: 1 byte a pixel) fits beside the model, and the augmentations are
    tensor ops; an ImageNet-sized set or JPEG decoding needs a loader.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        device="cpu",
        seed: int = 0,
        augment: bool = True,
    ):
        self.x, self.y = images.to(device), labels.to(device)
        self.batch_size, self.augment = batch_size, augment
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __len__(self) -> int:
        return len(self.x) // self.batch_size  # drop_last: every step sees a full batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(len(self.x), device=self.x.device, generator=self.generator)
        for i in range(len(self)):
            idx = order[i * self.batch_size : (i + 1) * self.batch_size]
            x = self.x[idx]
            yield (augment_batch(x, self.generator) if self.augment else x.float()), self.y[idx]


# --------------------------------------------------------------------------- pinned memory (GPU)


def copy_timings(device: str = "cuda", mib: int = 64, busy_ms: float = 20.0, iters: int = 10) -> list[dict]:
    """Chapter 07: a host->device copy of `mib` MiB from pageable memory, pinned memory, and pinned each time.

    Per row: `copy_ms`, the copy alone (median, middle half; GB/s); `host_ms`, how long
    `.to(device, non_blocking=True)` holds the Python thread when the GPU still has `busy_ms` of
    queued work (in the current stream, as in a training loop); `both_ms`, that work plus the
    copy issued on a side stream, end to end: busy_ms + copy_ms if they ran one after the other.
    """
    dev = torch.device(device)
    pageable = torch.randn(mib * 2**18)
    pinned = pageable.pin_memory()
    a = torch.randn(4096, 4096, device=dev)
    one = time_fn(lambda: a @ a, warmup=2, iters=5, device=dev).median_ms
    reps = max(1, round(busy_ms / one))  # matmuls that keep the GPU busy for about busy_ms
    side = torch.cuda.Stream(dev)
    rows = []
    for name, src, pin_each in (
        ("pageable .to()", pageable, False),
        ("pinned, non_blocking", pinned, False),
        ("pin_memory() each time", pageable, True),
    ):

        def copy() -> torch.Tensor:
            return (src.pin_memory() if pin_each else src).to(dev, non_blocking=True)

        t = time_fn(copy, warmup=2, iters=iters, device=dev)
        held = []
        both = []
        for stream in [None] * iters + [side] * iters:
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ a
            t1 = time.perf_counter()
            with torch.cuda.stream(stream):  # None: the current stream
                copy()
            t2 = time.perf_counter()
            torch.cuda.synchronize(dev)
            if stream is None:
                held.append((t2 - t1) * 1000)
            else:
                both.append((time.perf_counter() - t0) * 1000)
        lo, hi = t.quartiles_ms
        rows.append(
            {
                "copy": name,
                "mib": mib,
                "copy_ms": t.median_ms,
                "copy_lo": lo,
                "copy_hi": hi,
                "gb_per_s": mib * 2**20 / 1e6 / t.median_ms,
                "busy_ms": reps * one,
                "host_ms": float(np.median(held)),
                "both_ms": float(np.median(both)),
            }
        )
    return rows


def format_copy_rows(rows: Sequence[dict]) -> str:
    """Chapter 07: copy_timings as a table."""
    columns = [
        ("host memory", "copy", ""),
        ("copy ms (middle half)", lambda r: f"{r['copy_ms']:.2f} ({r['copy_lo']:.2f}-{r['copy_hi']:.2f})", ""),
        ("GB/s", "gb_per_s", ".1f"),
        ("host held ms", "host_ms", ".2f"),
        ("busy+copy ms", "both_ms", ".2f"),
    ]
    text = table(rows, columns)
    if rows:
        text += f"\n(copies of {rows[0]['mib']} MiB; before each, {rows[0]['busy_ms']:.1f} ms of GPU work was queued)"
    return text


def format_loading_reference(ref: dict) -> str:
    """Chapter 07: a recorded loading_<gpu>.json: the copy table and the loader sweep."""
    parts = [format_copy_rows(ref["copies"])] if ref.get("copies") else []
    if ref.get("sweep"):
        s = ref["sweep"]
        parts.append(
            f"loader sweep on {s['cpus']} cores: one core augments {s['per_core']:,.0f} images/s; "
            f"the simulated model\ntakes {s['demand']:,.0f} images/s"
        )
        parts.append(format_runs([LoaderRun(**r) for r in s["runs"]]))
    return "\n".join(parts)


def _sweep_workers(cores: int | None = None) -> list[int]:
    """The num_workers values the recorded sweep tries: 0, 1, 2, 4, 8, 12, 16 as far as this machine's
    cores go, and the cores themselves (a Colab VM has 2), as chapter 07 sizes workers."""
    n = cores or cpus()
    return sorted({w for w in (0, 1, 2, 4, 8, 12, 16) if w <= n} | {n})


def _sweep_record(batch_size: int, workers: Sequence[int], demand_x: float, steps: int) -> dict:
    """The loader sweep of the chapter, at `demand_x` times one core's rate, as plain data."""
    images, labels = raw_images(load_dataset(train_size=4000, verbose=False))
    ds = AugmentedImages(images, labels)
    base = measure_loader(DataLoader(ds, batch_size=batch_size), simulated_step(0), steps=8, label="load only")
    per_core = base.images_per_s
    step = simulated_step(1000 * batch_size / (demand_x * per_core))
    runs = sweep(
        lambda w: DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=w, persistent_workers=w > 0),
        workers,
        step,
        label=lambda w: f"num_workers={w}",
        desc="num_workers",
        steps=steps,
    )
    return {
        "cpus": cpus(),
        "per_core": per_core,
        "demand": demand_x * per_core,
        "batch_size": batch_size,
        "runs": [r.__dict__ for r in runs],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m course_lib.chapters.ch07.loading",
        description="pinned vs pageable copies to the GPU; a DataLoader num_workers sweep",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mib", type=int, default=64, help="size of the copied batch")
    p.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=None,
        help="num_workers values to sweep (default: 0, 1, 2, 4, 8, 12, 16 up to this machine's cores, and the cores)",
    )
    p.add_argument("--demand", type=float, default=6.0, help="the simulated model's rate, x one core's rate")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--json", help="also write the results with provenance (data/reference/loading_<gpu>.json)")
    args = p.parse_args(argv)
    copies = copy_timings(args.device, args.mib) if args.device.startswith("cuda") else []
    workers = args.workers or _sweep_workers()
    payload = {"copies": copies, "sweep": _sweep_record(64, workers, args.demand, args.steps)}
    command = "python -m course_lib.chapters.ch07.loading " + " ".join(argv if argv is not None else sys.argv[1:])
    record(command, format_loading_reference(payload), args.json, **payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
