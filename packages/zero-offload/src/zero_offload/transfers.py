"""Copies between device and host for offload: pinned endpoints, non-blocking, fenced by events.

[Note: offload copies]
A copy between a GPU and host memory only runs asynchronously when the host side is pinned
(page-locked); from pageable memory CUDA stages it through a pinned bounce buffer and the host
waits. So the host buffers that copies go to or come from (the staged gradients, the weights
copied back to the device, parameter homes) are allocated through the accelerator's
``pin_memory`` (:func:`host_buffer`; a no-op on a CPU-only machine), and the copies are issued
with ``non_blocking=True`` on the compute stream, where they run behind the work that produced
their source. The host must not read (a CPU optimizer step) or overwrite (the next step's
results) such a buffer before the copy has finished, and it cannot know that from program
order any more: each group of copies is followed by :meth:`CopyFence.mark`, an event recorded
on the current stream, and the host code about to touch the buffer calls
:meth:`CopyFence.wait`, which waits for that event only (not for everything queued on the
device, as a stream synchronisation would). On the CPU the accelerator's events are no-ops and
copies are synchronous, so the CPU path computes exactly what it did before.
"""

from __future__ import annotations

from typing import Any

import torch
from zero_core.accelerator import get_accelerator


def host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A zeroed host buffer, pinned through the accelerator when ``pin`` (and it can pin)."""
    t = torch.zeros(numel, dtype=dtype, device="cpu")
    return get_accelerator().pin_memory(t) if pin else t


class CopyFence:
    """An event behind the latest non-blocking copies; see [Note: offload copies]."""

    def __init__(self) -> None:
        self._event: Any = None
        self.pending = False  # marked and not waited for since

    def mark(self) -> None:
        """Record the event on the current stream, behind the copies issued so far."""
        if self._event is None:
            self._event = get_accelerator().Event()
        self._event.record()
        self.pending = True

    def wait(self) -> None:
        """Block the host until the copies before the last :meth:`mark` have finished."""
        if self.pending:
            self._event.synchronize()
            self.pending = False
