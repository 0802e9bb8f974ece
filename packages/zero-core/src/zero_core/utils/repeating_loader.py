"""``RepeatingLoader``: iterate a data loader forever, restarting it when it is exhausted."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class RepeatingLoader:
    """Wraps an iterable (e.g. a DataLoader) so that ``next`` never raises StopIteration.

    Each restart calls ``iter`` on the wrapped loader again, so a DistributedSampler-backed
    loader moves to its next epoch (and reshuffles) on every pass.
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        if not hasattr(loader, "__iter__"):
            raise TypeError(f"RepeatingLoader needs an iterable, got {type(loader).__name__}")
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            try:
                return next(self.data_iter)
            except StopIteration:
                raise ValueError("RepeatingLoader: the wrapped loader yields no batches") from None
