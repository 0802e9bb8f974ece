"""``engine.no_sync()``: accumulate gradients locally, without reducing them across ranks.

[Note: no_sync]
DeepSpeed's engine offers ``no_sync()`` with the semantics of DDP's: backward passes run
inside the context leave their gradients on this rank only (no all-reduce), so a script can
accumulate several micro-batches for the cost of one reduction. The backward that follows
outside the context, on an accumulation boundary, reduces everything accumulated so far,
local contributions included, and ``engine.step()`` then applies the average over ranks of
the sum of every rank's micro-batch gradients (each already divided by
``gradient_accumulation_steps``, as every ``engine.backward`` does).

It exists only where full gradients stay on each rank between reductions: stage 0 (plain
data parallel) and stage 1 (partitioned optimizer states). Stages 2 and 3 partition the
gradient itself, reducing every micro-batch into its owner's shard, so there is nothing local
to accumulate; as DeepSpeed does we refuse to enter the context there, with DeepSpeed's
message. Also as DeepSpeed: the context does not nest, and ``engine.step()`` inside it is an
error (a step would apply gradients that were never averaged). The errors are
:class:`NoSyncError`, an ``AssertionError`` (what DeepSpeed raises, so ported ``except``
clauses and tests keep working) that is also a ``RuntimeError``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class NoSyncError(RuntimeError, AssertionError):
    """``no_sync()`` used where DeepSpeed forbids it. See [Note: no_sync]."""


class NoSyncGuard:
    """The state behind ``engine.no_sync()``: held by the engine (``engine._no_sync_guard``), which
    delegates ``no_sync()`` and its two checks here. See [Note: no_sync]."""

    def __init__(self) -> None:
        self.inside = False

    @contextlib.contextmanager
    def context(self, stage: int) -> Iterator[None]:
        """Backward passes inside the context keep their gradients local (stages 0 and 1)."""
        if stage >= 2:
            raise NoSyncError(
                f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO "
                f"stage {stage}: stages 2 and 3 reduce every micro-batch's gradient into its owner's "
                "shard, so there is no local gradient to accumulate. Drop no_sync (gradient "
                "accumulation already reduces once per micro-batch there) or use stage 0 or 1"
            )
        if self.inside:
            raise NoSyncError("no_sync context manager reentry is unsupported: it is already active")
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def reduce_in_this_backward(self, boundary: bool) -> bool:
        """Whether the strategy reduces gradients in the current backward (never inside no_sync)."""
        return boundary and not self.inside

    def require_outside(self, what: str) -> None:
        if self.inside:
            raise NoSyncError(
                f"It is illegal to call Engine.{what}() inside no_sync context manager: the gradients "
                "accumulated there are not averaged over ranks yet; leave the context and run one "
                "more backward first"
            )
