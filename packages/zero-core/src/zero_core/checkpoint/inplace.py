"""Destinations for a load: the live training state, overwritten in place.

[Note: loading into the live state]
A load overwrites every byte of the state it restores, so the cheapest destination is the
memory that already holds that state. Reading a range into a fresh tensor costs the read plus
the page faults of the new memory (the kernel zeroes each page on first touch: 0.15-0.25 s per
400 MB on this machine, more than the read from the page cache itself), and ``torch.zeros``
or a copy into the final tensor adds one more pass each. So loaders:

* read module weights and fp32 masters with ``CheckpointReader.read_into`` straight into
  their storage (see [Note: reading into place] in ``fragments.py``); where the master is a
  view of the module weights (ZeRO-1/2 fp32, see [Note: fp32 master aliasing]) the weights
  already loaded are the master and are not read a second time;
* read each elementwise optimizer state into the tensor the optimizer already holds for
  that key (:func:`state_buffer`) when it has the right size, dtype and device, else into a
  new ``torch.empty`` tensor; elements that no checkpoint range covers (the padding of a flat
  shard, parameters missing from a non-strict load) are zeroed (:func:`zero_uncovered`),
  which is what a fresh optimizer holds there.

Under an engine load the reads are deferred to one pass per tensor file that also verifies
it (see [Note: single-pass load] in ``single_pass.py``): a loader must not use what it read
into these tensors before ``CheckpointReader.finish_single_pass`` returns.

Consequence, as for module parameters: a reference taken earlier to an optimizer state tensor
(``optimizer.state_dict()`` shares them) sees the loaded values. States kept by an offload
store are never reused: they go through the store's own ``load_state``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def state_buffer(current: Any, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A flat tensor of ``numel`` elements to read an optimizer state into.

    ``current`` (the optimizer's tensor for that state, or None) is reused, as a flat view, when
    it is a contiguous tensor with ``numel`` elements of ``dtype`` on ``device``; otherwise a new
    uninitialised tensor is returned (the caller writes or zeroes every element).
    See [Note: loading into the live state].
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"state_buffer: numel must be a non-negative int, got {numel!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"state_buffer: dtype must be a torch.dtype, got {type(dtype).__name__}")
    device = torch.device(device)
    if (
        torch.is_tensor(current)
        and current.numel() == numel
        and current.dtype == dtype
        and current.device == device
        and current.is_contiguous()
        and not current.requires_grad
    ):
        return current.detach().view(-1)
    return torch.empty(numel, dtype=dtype, device=device)


def zero_uncovered(buf: torch.Tensor, covered: Iterable[tuple[int, int]]) -> None:
    """Zero the elements of the flat tensor ``buf`` outside every ``[lo, hi)`` range of ``covered``."""
    if buf.dim() != 1:
        raise ValueError(f"zero_uncovered: expected a flat (1-D) tensor, got shape {tuple(buf.shape)}")
    n = buf.numel()
    pos = 0
    with torch.no_grad():
        for lo, hi in sorted(covered):
            if not 0 <= lo <= hi <= n:
                raise ValueError(f"zero_uncovered: range [{lo}, {hi}) is outside a tensor of {n} elements")
            if lo > pos:
                buf[pos:lo].zero_()
            pos = max(pos, hi)
        if pos < n:
            buf[pos:].zero_()
