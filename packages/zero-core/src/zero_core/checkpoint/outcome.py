"""A collective save or load succeeds or fails on every rank together, with one error.

[Note: collective save outcome]
A save fails on one rank (a full disk, a permission, a bug in a strategy) while its peers
succeed. Raising at once on that rank alone left the others waiting at the save's next barrier
until the watchdog's timeout, which then blamed the network; rank 0 deleted the staging folder
while other ranks still wrote into it; and a job that caught the error and trained on had its
ranks in different collectives. So every collective of a save (and the one of a load that
follows its local reads) is an *outcome agreement*: each rank catches what failed locally and
still joins, one all-reduce of a flag tells every rank whether any failed, and only then (on
that error path alone) an all-gather of the messages, so every rank raises the same
:class:`CheckpointRankError` naming each failed rank, its file and why (the failed rank's own
exception chained as the cause). Because no rank leaves before the agreement, the ranks stay in
step: rank 0 removes a failed save's staging folder after it, when nobody writes into it any
more, and training can go on after a caught error. The previous checkpoint and ``latest`` are
untouched, since the commit only happens after a successful agreement.

What is not an exception (``sys.exit``, a signal, a crash) ends the rank: its peers leave the
agreement with ``PeerFailedError`` naming it (see [Note: failed ranks]), and the staging folder
is left to the next save of the tag, as after a kill -9.
"""

from __future__ import annotations

from typing import Any

import torch

from zero_core import comm
from zero_core.checkpoint.format import CheckpointError


class CheckpointRankError(CheckpointError):
    """A collective save or load failed on some ranks; raised on every rank with one message.
    ``failed_ranks`` lists them (global ranks)."""

    def __init__(self, message: str, failed_ranks: list[int]) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.failed_ranks))


def describe(exc: BaseException) -> str:
    """``Type: message`` of a local failure, on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def attempt(fn: Any) -> BaseException | None:
    """Run ``fn()``; the ``Exception`` it raised, or None (other exceptions end the process)."""
    try:
        fn()
    except Exception as exc:
        return exc
    return None


def all_done_writing(raised: BaseException, error: BaseException | None) -> bool:
    """Whether :func:`agree` raising ``raised`` (this rank's local ``error``) means that no rank
    writes into the save's staging directory any more: the ranks agreed on the failure, or this
    process is the only rank. Not when a rank ended instead (``PeerFailedError``)."""
    return isinstance(raised, CheckpointRankError) or (error is not None and raised is error)


def _device() -> torch.device:
    from zero_core.accelerator import get_accelerator

    acc = get_accelerator()
    return acc.device(acc.current_device())


def agree(group: Any, error: BaseException | None, what: str, after: str = "") -> None:
    """Collective over ``group``: raise on every rank when ``error`` is set on any.

    ``what`` names the operation ("save_checkpoint of tag 'x' in DIR, writing the rank files");
    ``after`` is appended to the message (what was kept). Single process: ``error`` itself is raised.
    """
    if not comm.is_initialized() or comm.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=_device())
    comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return
    texts: list[Any] = [None] * comm.get_world_size(group)
    comm.all_gather_object(texts, None if error is None else describe(error), group=group)
    ranks = comm.group_ranks(group)
    failed = [(r, t) for r, t in zip(ranks, texts) if t is not None]
    which = ", ".join(str(r) for r, _ in failed)
    msg = f"{what} failed on rank{'s' if len(failed) > 1 else ''} {which}: " + "; ".join(
        f"rank {r}: {t}" for r, t in failed
    )
    raise CheckpointRankError(msg + (f". {after}" if after else ""), [r for r, _ in failed]) from error
