"""gloo's reduce-scatter and all-gather as direct exchanges (see [Note: gloo direct collectives]):
the same results as torch's gloo collectives, for every layout, dtype, group and world size the
library uses, and the same failure behaviour."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from zero_core import comm
from zero_core.comm import ReduceOp, gloo_direct
from zero_core.testing import RankFailedError, multirank, run_multirank
from zero_core.utils.tensor_alias import apart_or_slot


def _native(fn):
    """Run ``fn`` with the direct path off (torch's gloo collective)."""
    old = os.environ.get(gloo_direct.ENV_SWITCH)
    os.environ[gloo_direct.ENV_SWITCH] = "0"
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[gloo_direct.ENV_SWITCH]
        else:
            os.environ[gloo_direct.ENV_SWITCH] = old


def _input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _within_rounding(out, op, rank, numel, world_size, dtype) -> None:
    """``out`` is the exact sum (or mean) of every rank's chunk up to ``world_size`` roundings."""
    parts = torch.stack(
        [
            _input(r, numel * world_size, dtype).view(world_size, numel)[rank].double()
            for r in range(world_size)
        ]
    )
    exact, bound = parts.sum(0), parts.abs().sum(0) * world_size * torch.finfo(dtype).eps
    if op == ReduceOp.AVG:
        exact, bound = exact / world_size, bound / world_size
    assert bool(((out.double() - exact).abs() <= bound + torch.finfo(dtype).tiny).all())


SIZES = (1, 7, 1000, 65_537)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@multirank(world_sizes=(2, 4))
def test_reduce_scatter_matches_torch(world_size):
    rank = comm.get_rank()
    for numel in SIZES:
        for dtype in DTYPES:
            full = _input(rank, numel * world_size, dtype)
            assert gloo_direct.applies(None, full, reduce=True)
            for op in (ReduceOp.SUM, ReduceOp.AVG):
                out = torch.empty(numel, dtype=dtype)
                comm.reduce_scatter_tensor(out, full.clone(), op=op)
                ref = torch.empty(numel, dtype=dtype)
                _native(lambda: comm.reduce_scatter_tensor(ref, full.clone(), op=op))  # noqa: B023
                if dtype in (torch.float32, torch.float64):
                    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
                else:  # additions in another order than gloo's: both within the rounding bound
                    _within_rounding(out, op, rank, numel, world_size, dtype)
                    _within_rounding(ref, op, rank, numel, world_size, dtype)
            # exactly the sum of every rank's chunk, in group-rank order
            every = [
                _input(r, numel * world_size, dtype).view(world_size, numel)[rank] for r in range(world_size)
            ]
            want = every[0].clone()
            for part in every[1:]:
                want += part
            out = torch.empty(numel, dtype=dtype)
            comm.reduce_scatter_tensor(out, full)
            assert torch.equal(out, want)


@multirank(world_sizes=(2, 4))
def test_reduce_scatter_in_place_and_async(world_size):
    rank = comm.get_rank()
    numel = 4099
    full = _input(rank, numel * world_size, torch.float32)
    want = torch.stack([_input(r, numel * world_size, torch.float32) for r in range(world_size)]).sum(0)
    mine = full.view(world_size, numel)[rank]  # output = this rank's own chunk of the input
    work = comm.reduce_scatter_tensor(mine, full, async_op=True)
    assert isinstance(work, comm.Work)
    assert work.wait() is True and work.is_completed()
    torch.testing.assert_close(mine, want.view(world_size, numel)[rank], rtol=1e-6, atol=1e-6)
    # several in flight at once on one group complete in any wait order
    ins = [_input(rank + 10 * k, 64 * world_size, torch.float32) for k in range(3)]
    outs = [torch.empty(64) for _ in ins]
    works = [comm.reduce_scatter_tensor(o, i, async_op=True) for o, i in zip(outs, ins)]
    for w in reversed(works):
        w.wait()
    for k, o in enumerate(outs):
        ref = torch.stack(
            [_input(r + 10 * k, 64 * world_size, torch.float32) for r in range(world_size)]
        ).sum(0)
        torch.testing.assert_close(o, ref.view(world_size, 64)[rank], rtol=1e-6, atol=1e-6)
    # a future resolves after the result is final
    out = torch.empty(numel)
    fresh = _input(rank, numel * world_size, torch.float32)  # ``full`` was reduced in place above
    comm.reduce_scatter_tensor(out, fresh, op=ReduceOp.AVG, async_op=True).get_future().wait()
    ref = torch.stack([_input(r, numel * world_size, torch.float32) for r in range(world_size)]).mean(0)
    torch.testing.assert_close(out, ref.view(world_size, numel)[rank], rtol=1e-5, atol=1e-6)


@multirank(world_sizes=(2, 4))
def test_all_gather_matches_torch(world_size):
    rank = comm.get_rank()
    for numel in SIZES:
        for dtype in (*DTYPES, torch.int64, torch.bool, torch.uint8):
            piece = _input(rank, numel, torch.float32)
            piece = (piece > 0) if dtype == torch.bool else (piece * 100).to(dtype)
            assert gloo_direct.applies(None, piece, reduce=False)
            out = torch.empty(numel * world_size, dtype=dtype)
            comm.all_gather_into_tensor(out, piece)
            ref = torch.empty_like(out)
            _native(lambda: comm.all_gather_into_tensor(ref, piece))  # noqa: B023
            assert torch.equal(out, ref)
    # in place: the input is this rank's slot of the output; async; a 2-D output
    out = torch.zeros(world_size, 513)
    out[rank] = float(rank + 1)
    comm.all_gather_into_tensor(out, out[rank], async_op=True).wait()
    assert torch.equal(out, torch.arange(1, world_size + 1, dtype=torch.float32)[:, None].expand(-1, 513))


@multirank(world_sizes=(4,))
def test_subgroups_and_user_messages_on_the_same_group(world_size):
    rank = comm.get_rank()
    pair = [rank - rank % 2, rank - rank % 2 + 1]
    groups = [comm.new_group([0, 1]), comm.new_group([2, 3])]
    group = groups[rank // 2]
    peer = pair[1] if rank == pair[0] else pair[0]
    # a user's point-to-point message with a small tag, in flight across the collectives
    user_in = torch.full((5,), float(rank))
    user_out = torch.empty(5)
    send = dist.isend(user_in, peer, group=group, tag=3)
    recv = dist.irecv(user_out, peer, group=group, tag=3)
    piece = torch.full((10,), float(rank))
    out = torch.empty(20)
    comm.all_gather_into_tensor(out, piece, group=group)
    assert torch.equal(out, torch.tensor(pair, dtype=torch.float32).repeat_interleave(10))
    red = torch.empty(10)
    comm.reduce_scatter_tensor(red, torch.full((20,), float(rank)), group=group)
    assert torch.equal(red, torch.full((10,), float(sum(pair))))
    send.wait()
    recv.wait()
    assert torch.equal(user_out, torch.full((5,), float(peer)))


@multirank(world_sizes=(2,))
def test_what_keeps_torchs_collective(world_size):
    rank = comm.get_rank()
    # integer reductions, MAX and partial overlaps are torch's gloo collective (still correct)
    ints = torch.arange(4, dtype=torch.int64) + rank
    assert not gloo_direct.applies(None, ints, reduce=True)
    out = torch.empty(2, dtype=torch.int64)
    comm.reduce_scatter_tensor(out, ints)
    assert out.tolist() == ([1, 3] if rank == 0 else [5, 7])
    full = torch.arange(8, dtype=torch.float32) + rank
    assert not apart_or_slot(full, full[1:5], rank)
    assert apart_or_slot(full, full[4 * rank : 4 * rank + 4], rank)
    assert apart_or_slot(full, torch.empty(4), rank)
    mx = torch.empty(4)
    comm.reduce_scatter_tensor(mx, full, op=ReduceOp.MAX)
    assert torch.equal(mx, (torch.arange(8, dtype=torch.float32) + 1).view(2, 4)[rank])
    # one-member groups: nothing to exchange
    solo = [comm.new_group([r]) for r in range(world_size)][rank]
    assert not gloo_direct.applies(solo, full, reduce=True)
    alone = torch.empty(8)
    comm.reduce_scatter_tensor(alone, full, group=solo)
    assert torch.equal(alone, full)
    # the switch
    os.environ[gloo_direct.ENV_SWITCH] = "0"
    try:
        assert not gloo_direct.applies(None, full, reduce=True)
    finally:
        del os.environ[gloo_direct.ENV_SWITCH]


def test_switch_values_are_checked(monkeypatch):
    for value in ("0", "off", "False"):
        monkeypatch.setenv(gloo_direct.ENV_SWITCH, value)
        assert gloo_direct.enabled() is False
    for value in ("1", "on", "yes", ""):
        monkeypatch.setenv(gloo_direct.ENV_SWITCH, value)
        assert gloo_direct.enabled() is True
    monkeypatch.setenv(gloo_direct.ENV_SWITCH, "sometimes")
    with pytest.raises(ValueError, match="ZERO_GLOO_DIRECT_COLLECTIVES must be 1 or 0.*'sometimes'"):
        gloo_direct.enabled()


def test_not_on_other_devices_or_backends(monkeypatch):
    t = torch.ones(4)
    monkeypatch.setattr(gloo_direct.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(gloo_direct.dist, "get_backend", lambda group=None: "nccl")
    assert not gloo_direct.applies(None, t, reduce=False)
    monkeypatch.setattr(gloo_direct.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert gloo_direct.applies(None, t, reduce=False)
    assert not gloo_direct.applies(None, torch.ones(4, device="meta"), reduce=False)
    monkeypatch.setattr(gloo_direct.dist, "get_world_size", lambda group=None: 1)
    assert not gloo_direct.applies(None, t, reduce=False)
    monkeypatch.setattr(gloo_direct.dist, "get_world_size", lambda group=None: gloo_direct.MAX_MEMBERS + 1)
    assert not gloo_direct.applies(None, t, reduce=False)
    monkeypatch.setattr(gloo_direct.dist, "get_world_size", lambda group=None: gloo_direct.MAX_MEMBERS)
    assert gloo_direct.applies(None, t, reduce=False)


TIMEOUT_S = 2.0


def _absent_peer() -> None:
    comm.watchdog.set_collective_timeout(TIMEOUT_S)
    if comm.get_rank() == 1:
        time.sleep(3 * TIMEOUT_S)  # alive, but never joins
        return
    start = time.perf_counter()
    try:
        comm.reduce_scatter_tensor(torch.empty(8), torch.ones(16))
    finally:
        assert time.perf_counter() - start < 3 * TIMEOUT_S


def test_absent_peer_times_out_naming_the_collective() -> None:
    with pytest.raises(RankFailedError) as info:
        run_multirank(_absent_peer, 2, timeout=60)
    text = str(info.value)
    assert "CollectiveTimeoutError" in text and "reduce_scatter_tensor" in text
    assert "did not complete" in text


@multirank(world_sizes=(2,))
def test_two_groups_of_the_same_ranks_in_different_orders(world_size):
    rank = comm.get_rank()
    groups = [comm.new_group([0, 1]), comm.new_group([0, 1])]
    order = groups if rank == 0 else groups[::-1]  # legal: the groups are separate communicators
    outs = {}
    works = []
    for g in order:
        k = groups.index(g)
        outs[k] = torch.empty(2 * 1000)
        works.append(
            comm.all_gather_into_tensor(
                outs[k], torch.full((1000,), float(10 * k + rank)), group=g, async_op=True
            )
        )
    for w in works:
        w.wait()
    for k in (0, 1):
        assert torch.equal(outs[k], torch.tensor([10.0 * k, 10.0 * k + 1]).repeat_interleave(1000))
