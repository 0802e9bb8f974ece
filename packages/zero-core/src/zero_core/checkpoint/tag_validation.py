"""``checkpoint.tag_validation``: what ``save_checkpoint`` does when ranks pass different tags.

[Note: checkpoint tag agreement]
Every rank of a save writes its shard under one tag directory, so the ranks must agree on the
tag (``tag=f"step{rank}"`` by mistake, or a timestamp taken on each rank). DeepSpeed's config
key ``checkpoint.tag_validation`` says what happens when they do not: ``"Fail"`` raises on
every rank, ``"Warn"`` (the default) warns and saves, ``"Ignore"`` saves without comparing.
Where DeepSpeed then writes each rank's files under that rank's own tag (a checkpoint no tag
of which is complete), every rank here saves under rank 0's tag, so the result loads: the tag
is broadcast from rank 0 in every mode (one small collective), and only Warn and Fail compare.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from zero_core import comm

MODES = ("ignore", "warn", "fail")


def _device() -> torch.device:
    from zero_core.accelerator import get_accelerator

    acc = get_accelerator()
    return acc.device(acc.current_device())


def _broadcast_str(text: str, group: Any, device: torch.device) -> str:
    """Rank 0's ``text`` on every rank of ``group``."""
    src = comm.get_global_rank(group, 0) if group is not None else 0
    data = text.encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    comm.broadcast(length, src=src, group=group)
    buf = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if comm.get_rank(group) == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    comm.broadcast(buf, src=src, group=group)
    return bytes(buf.cpu().tolist()).decode()


def agree_on_tag(tag: str, mode: str, group: Any = None) -> str:
    """The tag every rank of ``group`` saves under: rank 0's. See [Note: checkpoint tag agreement].

    ``mode`` is ``checkpoint.tag_validation`` (any case): with ``"Fail"`` a disagreement raises
    :class:`~zero_core.checkpoint.format.CheckpointError` on every rank, with ``"Warn"`` it warns
    (naming both tags) and saves under rank 0's, with ``"Ignore"`` nothing is compared.
    Collective: call on every rank of ``group``.
    """
    if not isinstance(mode, str) or mode.lower() not in MODES:
        raise ValueError(f'checkpoint.tag_validation must be "Ignore", "Warn" or "Fail", got {mode!r}')
    if not comm.is_initialized() or comm.get_world_size(group) == 1:
        return tag
    device = _device()
    first = _broadcast_str(tag, group, device)
    if mode.lower() == "ignore":
        return first
    differs = torch.tensor([int(first != tag)], dtype=torch.int32, device=device)
    comm.all_reduce(differs, op=comm.ReduceOp.MAX, group=group)
    if differs.item():
        msg = (
            f"save_checkpoint: ranks passed different tags (rank 0: {first!r}, this rank: {tag!r}); "
            "pass the same tag on every rank"
        )
        if mode.lower() == "fail":
            from zero_core.checkpoint.format import CheckpointError

            raise CheckpointError(msg + ' (checkpoint.tag_validation is "Fail")')
        warnings.warn(f"{msg}; saving under rank 0's tag {first!r}", UserWarning, stacklevel=3)
    return first
