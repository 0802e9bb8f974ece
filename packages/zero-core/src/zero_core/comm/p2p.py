"""Point-to-point transfers (pipeline stages): send/recv, their async forms and batches.

Peers are *global* ranks, as in ``torch.distributed``; ``group`` only selects the
communicator.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zero_core.comm._issue import begin, check_tensor, issue, nbytes
from zero_core.comm.groups import check_group, group_ranks, require_initialized
from zero_core.comm.work import Work


class P2POp:
    """One operation of ``batch_isend_irecv``: ``P2POp(zero_core.comm.isend, tensor, peer)``.

    Mirrors ``torch.distributed.P2POp`` (which is also accepted by ``batch_isend_irecv``), but
    takes this module's ``isend``/``irecv`` as well as torch's.
    """

    __slots__ = ("op", "tensor", "peer", "group", "tag")

    def __init__(self, op: Any, tensor: torch.Tensor, peer: int, group: Any = None, tag: int = 0) -> None:
        if op in (isend, dist.isend):
            self.op = dist.isend
        elif op in (irecv, dist.irecv):
            self.op = dist.irecv
        else:
            raise ValueError(f"zero_core.comm.P2POp: op must be zero_core.comm.isend or irecv, got {op!r}")
        where = "isend" if self.op is dist.isend else "irecv"
        check_tensor(tensor, "tensor", f"P2POp({where})")
        _check_peer(peer, group, "peer", f"P2POp({where})")
        _check_tag(tag, f"P2POp({where})")
        self.tensor, self.peer, self.group, self.tag = tensor, peer, group, tag

    def to_torch(self) -> dist.P2POp:
        return dist.P2POp(self.op, self.tensor, self.peer, self.group, self.tag)

    def __repr__(self) -> str:
        return (
            f"P2POp({self.op.__name__}, shape={tuple(self.tensor.shape)}, peer={self.peer}, tag={self.tag})"
        )


def _check_peer(peer: Any, group: Any, name: str, where: str, *, optional: bool = False) -> None:
    require_initialized(where)
    check_group(group, where)
    if peer is None and optional:
        return
    ranks = group_ranks(group)
    if isinstance(peer, bool) or not isinstance(peer, int) or peer not in ranks:
        raise ValueError(
            f"zero_core.comm.{where}: {name} must be the global rank of a group member {list(ranks)}, got {peer!r}"
        )
    if peer == dist.get_rank():
        raise ValueError(f"zero_core.comm.{where}: {name}={peer} is this rank; a rank cannot send to itself")


def _check_tag(tag: Any, where: str) -> None:
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"zero_core.comm.{where}: tag must be an int, got {tag!r}")


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocks until handed to the transport)."""
    check_tensor(tensor, "tensor", "send")
    _check_peer(dst, group, "dst", "send")
    _check_tag(tag, "send")
    issue(
        "send",
        group,
        nbytes(tensor),
        tensor.device,
        lambda: dist.send(tensor, dst, group=group, tag=tag),
        async_op=False,
    )


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> int:
    """Receive into ``tensor`` from global rank ``src`` (any rank when None); returns the sender."""
    check_tensor(tensor, "tensor", "recv")
    _check_peer(src, group, "src", "recv", optional=True)
    _check_tag(tag, "recv")
    sender: list[int] = []
    issue(
        "recv",
        group,
        nbytes(tensor),
        tensor.device,
        lambda: sender.append(dist.recv(tensor, src, group=group, tag=tag)),
        async_op=False,
    )
    return sender[0]


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Work:
    """Start sending ``tensor`` to global rank ``dst``; do not modify it before ``wait()``."""
    check_tensor(tensor, "tensor", "isend")
    _check_peer(dst, group, "dst", "isend")
    _check_tag(tag, "isend")
    work = issue(
        "isend",
        group,
        nbytes(tensor),
        tensor.device,
        lambda: dist.isend(tensor, dst, group=group, tag=tag),
        async_op=True,
    )
    assert work is not None
    return work


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Work:
    """Start receiving into ``tensor`` from global rank ``src`` (any rank when None)."""
    check_tensor(tensor, "tensor", "irecv")
    _check_peer(src, group, "src", "irecv", optional=True)
    _check_tag(tag, "irecv")
    work = issue(
        "irecv",
        group,
        nbytes(tensor),
        tensor.device,
        lambda: dist.irecv(tensor, src, group=group, tag=tag),
        async_op=True,
    )
    assert work is not None
    return work


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Issue a list of ``P2POp`` (isend/irecv) together; returns one handle per op.

    Logged as one ``batch_isend_irecv`` whose bytes are the sum over the ops and whose time ends
    when the last handle is waited on.
    """
    require_initialized("batch_isend_irecv")
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError("zero_core.comm.batch_isend_irecv: p2p_op_list must be a non-empty list of P2POp")
    torch_ops = []
    for i, p in enumerate(p2p_op_list):
        if isinstance(p, P2POp):
            torch_ops.append(p.to_torch())
        elif isinstance(p, dist.P2POp):
            torch_ops.append(p)
        else:
            raise TypeError(
                f"zero_core.comm.batch_isend_irecv: item {i} is a {type(p).__name__}, expected P2POp"
            )
    first = torch_ops[0]
    record = begin(
        "batch_isend_irecv", first.group, sum(nbytes(p.tensor) for p in torch_ops), first.tensor.device
    )
    works = dist.batch_isend_irecv(torch_ops)
    if record is not None:
        record.pending = len(works)
    return [Work(w, record=record) for w in works]
