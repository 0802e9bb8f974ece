"""Data helpers for pipeline training."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class RepeatingLoader:
    """Wrap an iterable (e.g. a DataLoader) so iteration restarts instead of raising
    ``StopIteration``: ``train_batch`` pulls a fixed number of micro-batches per call."""

    def __init__(self, loader: Iterable[Any]) -> None:
        if not hasattr(loader, "__iter__"):
            raise TypeError(f"RepeatingLoader: loader must be iterable, got {type(loader)}")
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            try:
                return next(self.data_iter)
            except StopIteration:
                raise ValueError("RepeatingLoader: the wrapped loader yields no items") from None
