"""What stage 3 keeps of the gradient shards it hands to an offload that holds them on NVMe.

With ZeRO-Infinity (zero-offload's optimizer offload on NVMe, see [Note: ZeRO-Infinity
streaming] there) a reduced gradient shard is written to a swap file as soon as its bucket is
staged, and the strategy drops its own copy: holding every shard until the step would hold the
rank's whole gradient partition. Clipping and the fp16 overflow check still need, per shard,
its squared norm and whether it holds an inf or a NaN; :class:`StreamedGradients` keeps those
two device scalars per parameter (by record id, so a gradient replaced with
``safe_set_*_grad`` after backward replaces its own entry) and folds them into the strategy's
``grad_norm_sq`` / ``local_overflow``, on the device (See [Note: scalars stay on the device in
the step]).
"""

from __future__ import annotations

from typing import Any

import torch

from zero_core.utils.grad_norm import any_nonfinite, sum_of_squares


class StreamedGradients:
    """Norm and overflow terms of the gradient shards dropped after streaming (see the module doc)."""

    def __init__(self) -> None:
        self._sq: dict[int, torch.Tensor] = {}
        self._bad: dict[int, torch.Tensor] = {}

    def drop(self, st: Any) -> None:
        """Record ``st.grad_shard``'s terms, then drop the shard (the offload holds it now)."""
        self._sq[st.id] = sum_of_squares([st.grad_shard])
        self._bad[st.id] = any_nonfinite([st.grad_shard])
        st.grad_shard = None

    def clear(self) -> None:
        """A new accumulation boundary or ``zero_grad``: nothing is streamed any more."""
        self._sq.clear()
        self._bad.clear()

    def add_norm_sq(self, total: torch.Tensor) -> torch.Tensor:
        if not self._sq:
            return total
        return total + torch.stack([q.to(total.device) for q in self._sq.values()]).sum()

    def add_overflow(self, bad: torch.Tensor) -> torch.Tensor:
        if not self._bad:
            return bad
        return bad | torch.stack([b.to(bad.device) for b in self._bad.values()]).any()

    def tensors(self) -> list[torch.Tensor]:
        """The scalars held (for the memory breakdown)."""
        return [*self._sq.values(), *self._bad.values()]
