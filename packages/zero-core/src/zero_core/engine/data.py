"""The training data loader ``initialize`` builds when given ``training_data``.

Each data-parallel rank reads its shard through a DistributedSampler, which gives every rank
the same number of samples (so every rank runs the same number of steps, which collectives
require): by default, as in DeepSpeed (``dataloader_drop_last: false``), it repeats a few samples
to fill the last ranks and the last micro-batch of an epoch may be short; with
``dataloader_drop_last: true`` the remainders are dropped instead, so every micro-batch is full
(the default of this class, which the pipeline engine relies on). The sampler is reseeded per
epoch (``seed + epoch``) when the loader is iterated again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from zero_core.utils.nested import map_tensors

_T = TypeVar("_T")


class ZeroDataLoader:
    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        collate_fn: Callable[..., Any] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        num_workers: int = 0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"train_micro_batch_size_per_gpu must be >= 1, got {batch_size}")
        self.sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            num_workers=num_workers,
        )
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)


def move_to_device(batch: _T, device: torch.device) -> _T:
    """``batch`` with its tensors (nested as :func:`map_tensors` walks) moved to ``device``."""
    return map_tensors(batch, lambda t: t.to(device))


def cast_floating(batch: _T, dtype: torch.dtype) -> _T:
    """``batch`` with its floating-point tensors (nested as :func:`map_tensors` walks) cast to ``dtype``.

    The engine's forward applies it with ``fp16.auto_cast`` (DeepSpeed's switch for feeding fp32
    inputs to an fp16 model). Integer tensors (token ids, labels, masks) are left alone: DeepSpeed
    calls ``.half()`` on every tensor, which would turn token ids into floats.
    """
    return map_tensors(batch, lambda t: t.to(dtype) if t.is_floating_point() else t)
