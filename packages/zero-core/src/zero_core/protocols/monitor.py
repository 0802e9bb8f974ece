"""The ``Monitor`` protocol: a sink for training metrics (TensorBoard, W&B, CSV ...).

The engine builds a list of ``(name, value, global_step)`` events per step (for example
``("Train/Samples/train_loss", 0.42, 1000)``) and hands it to every enabled monitor, so a
monitor only has to know how to persist scalars.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

#: One metric sample: (name, value, global step).
Event = tuple[str, float, int]


@runtime_checkable
class Monitor(Protocol):
    """A metrics writer; ``enabled`` False means the engine skips it entirely."""

    enabled: bool

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """Persist ``events``; each is ``(name, value, global_step)``."""
        ...

    def close(self) -> None:
        """Flush and release files/runs; later ``write_events`` calls are an error."""
        ...
