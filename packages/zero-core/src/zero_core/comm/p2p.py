"""Point-to-point transfers (pipeline stages): send/recv, their async forms and batches.

Peers are *global* ranks, as in ``torch.distributed``; ``group`` only selects the
communicator.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zero_core.comm._issue import begin, check_tensor, issue, nbytes
from zero_core.comm.groups import check_group, check_member_rank, group_ranks, require_initialized
from zero_core.comm.watchdog import get_watchdog
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
        _check_args(f"P2POp({where})", tensor, peer, group, tag, "peer")
        self.tensor, self.peer, self.group, self.tag = tensor, peer, group, tag

    def to_torch(self) -> dist.P2POp:
        return dist.P2POp(self.op, self.tensor, self.peer, self.group, self.tag)

    def __repr__(self) -> str:
        return (
            f"P2POp({self.op.__name__}, shape={tuple(self.tensor.shape)}, peer={self.peer}, tag={self.tag})"
        )


def _check_args(where: str, tensor: Any, peer: Any, group: Any, tag: Any, peer_name: str) -> None:
    """Validates a transfer's arguments; a ``src`` peer may be None (receive from any rank)."""
    check_tensor(tensor, "tensor", where)
    require_initialized(where)
    check_group(group, where)
    check_member_rank(peer, group, peer_name, where, optional=peer_name == "src")
    if peer is not None and peer == dist.get_rank():
        raise ValueError(
            f"zero_core.comm.{where}: {peer_name}={peer} is this rank; a rank cannot send to itself"
        )
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"zero_core.comm.{where}: tag must be an int, got {tag!r}")


def _transfer(
    op: str, tensor: torch.Tensor, peer: int | None, group: Any, tag: int, peer_name: str, *, async_op: bool
) -> Any:
    """Validate, then run ``torch.distributed.<op>`` through ``issue`` (logged). Returns a ``Work``
    for the async ops, else what torch returned (the sender's rank for ``recv``)."""
    _check_args(op, tensor, peer, group, tag, peer_name)
    returned: list[Any] = []

    def call(_async: bool) -> Any:  # isend/irecv are asynchronous by name, send/recv block
        returned.append(getattr(dist, op)(tensor, peer, group=group, tag=tag))
        return returned[0]

    where = {"peer": peer} if op in ("send", "isend") else {}
    work = issue(
        op, group, nbytes(tensor), tensor.device, call, async_op=async_op, waitable=False, where=where
    )
    return work if async_op else returned[0]


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocks until handed to the transport)."""
    _transfer("send", tensor, dst, group, tag, "dst", async_op=False)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> int:
    """Receive into ``tensor`` from global rank ``src`` (any rank when None); returns the sender."""
    return _transfer("recv", tensor, src, group, tag, "src", async_op=False)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Work:
    """Start sending ``tensor`` to global rank ``dst``; do not modify it before ``wait()``."""
    return _transfer("isend", tensor, dst, group, tag, "dst", async_op=True)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Work:
    """Start receiving into ``tensor`` from global rank ``src`` (any rank when None)."""
    return _transfer("irecv", tensor, src, group, tag, "src", async_op=True)


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
    if record is not None:  # only the sends count by link: See [Note: bytes by link class]
        sends = [("isend" if p.op is dist.isend else "irecv", p.peer, nbytes(p.tensor)) for p in torch_ops]
        _add_links(record, sends)
    works = dist.batch_isend_irecv(torch_ops)
    if record is not None:
        record.pending = len(works)
    # each handle is bounded by the collective watchdog (see [Note: collective watchdog])
    wd = get_watchdog()
    ranks = group_ranks(first.group)
    return [
        Work(w, record=record, watchdog=wd, token=wd.begin("batch_isend_irecv", ranks, w) if wd else None)
        for w in works
    ]


def _add_links(record: Any, sends: list[tuple[str, int, int]]) -> None:
    from zero_core.comm.link_bytes import p2p_sends
    from zero_core.comm.logger import comms_logger
    from zero_core.comm.topology import ranks_per_node

    intra, inter = p2p_sends(sends, dist.get_rank(), ranks_per_node(dist.get_world_size()))
    comms_logger.add_links(record.key, intra, inter)
