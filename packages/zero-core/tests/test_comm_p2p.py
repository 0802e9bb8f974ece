"""zero_core.comm point-to-point: send/recv, isend/irecv, batch_isend_irecv on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from zero_core import comm
from zero_core.testing import multirank


@multirank(world_sizes=(2,))
def test_send_recv_blocking_and_any_source():
    rank = comm.get_rank()
    if rank == 0:
        comm.send(torch.arange(4, dtype=torch.bfloat16), 1, tag=3)
        comm.send(torch.full((2,), 9.0), 1)
    else:
        buf = torch.empty(4, dtype=torch.bfloat16)
        assert comm.recv(buf, 0, tag=3) == 0
        assert torch.equal(buf, torch.arange(4, dtype=torch.bfloat16))
        buf2 = torch.empty(2)
        assert comm.recv(buf2) == 0  # any source: returns the sender
        assert buf2.tolist() == [9.0, 9.0]


@multirank(world_sizes=(2,))
def test_isend_irecv_and_batch_ring():
    rank = comm.get_rank()
    peer = 1 - rank
    out = torch.full((3,), float(rank))
    inp = torch.empty(3)
    works = [comm.isend(out, peer), comm.irecv(inp, peer)]
    for w in works:
        w.wait()
    assert inp.tolist() == [float(peer)] * 3

    send_buf = torch.full((5,), 10.0 + rank)
    recv_buf = torch.empty(5)
    ops = [comm.P2POp(comm.isend, send_buf, peer), comm.P2POp(comm.irecv, recv_buf, peer)]
    for w in comm.batch_isend_irecv(ops):
        w.wait()
    assert recv_buf.tolist() == [10.0 + peer] * 5
    # torch's own P2POp is accepted too
    ops = [
        torch.distributed.P2POp(torch.distributed.isend, send_buf * 2, peer),
        torch.distributed.P2POp(torch.distributed.irecv, recv_buf, peer),
    ]
    for w in comm.batch_isend_irecv(ops):
        w.wait()
    assert recv_buf.tolist() == [2 * (10.0 + peer)] * 5


@multirank(world_sizes=(2,))
def test_p2p_validation():
    rank = comm.get_rank()
    with pytest.raises(ValueError, match="cannot send to itself"):
        comm.send(torch.ones(1), rank)
    with pytest.raises(ValueError, match="dst must be the global rank"):
        comm.isend(torch.ones(1), 5)
    with pytest.raises(TypeError, match="tag must be an int"):
        comm.irecv(torch.ones(1), 1 - rank, tag="a")
    with pytest.raises(ValueError, match="non-empty list"):
        comm.batch_isend_irecv([])
    with pytest.raises(TypeError, match="expected P2POp"):
        comm.batch_isend_irecv([("isend", torch.ones(1), 1)])
    with pytest.raises(ValueError, match="op must be zero_core.comm.isend or irecv"):
        comm.P2POp(comm.send, torch.ones(1), 1 - rank)
    with pytest.raises(ValueError, match="cannot send to itself"):
        comm.P2POp(comm.isend, torch.ones(1), rank)
