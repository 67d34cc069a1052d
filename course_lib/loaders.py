"""DataLoaders with a reproducible order: the sampler and the one place a loader is built.

Chapter 00 builds its first loader with `make_loader`; chapter 07 turns its knobs (workers,
pinned memory, prefetching) and measures what each does. The datasets themselves come from
course_lib.data.
"""

from __future__ import annotations

from typing import Iterator, Sized

import torch
from torch.utils.data import DataLoader, Sampler, SequentialSampler

__all__ = ["SeededSampler", "make_loader"]


class SeededSampler(Sampler[int]):
    """Chapter 07: a shuffling sampler whose order is a pure function of (seed + epoch).

    Like DistributedSampler: set_epoch(e) selects epoch e's order, so a run resumed at epoch e
    sees exactly the batches the uninterrupted run would have seen. Unlike it, forgetting
    set_epoch does not repeat one order forever: each iteration advances to the next epoch.
    """

    def __init__(self, data_source: Sized | int, seed: int = 0) -> None:
        self.n = data_source if isinstance(data_source, int) else len(data_source)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        self.epoch += 1
        return iter(order)


def make_loader(
    dataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    drop_last: bool = False,
) -> DataLoader:
    """Chapter 00: a DataLoader with a reproducible order; chapter 07 turns its knobs.

    These are DataLoader arguments, not Dataset arguments (a popular article passed them to a
    Dataset). persistent_workers and prefetch_factor need num_workers > 0; DataLoader itself
    says so if they are misused.
    """
    sampler = SeededSampler(dataset, seed) if shuffle else SequentialSampler(dataset)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        prefetch_factor=prefetch_factor,
        drop_last=drop_last,
        # seeds the workers' RNGs, so random transforms in workers are repeatable too
        generator=torch.Generator().manual_seed(seed),
    )
