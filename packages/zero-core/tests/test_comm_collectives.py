"""zero_core.comm collectives on 1 and 2 gloo ranks, against values computed locally."""

from __future__ import annotations

import warnings

import pytest
import torch
from zero_core import comm
from zero_core.comm import ReduceOp
from zero_core.testing import multirank

WS = (1, 2)


def _rank_tensor(rank: int, n: int = 6, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) * (rank + 1) + rank).to(dtype)


def _all_rank_tensors(world: int, n: int = 6, dtype=torch.float32) -> list[torch.Tensor]:
    return [_rank_tensor(r, n, dtype) for r in range(world)]


@multirank(world_sizes=WS)
def test_queries(world_size):
    assert comm.is_initialized()
    assert comm.get_world_size() == world_size
    assert 0 <= comm.get_rank() < world_size
    assert comm.get_backend() == "gloo"
    assert comm.group_ranks(None) == tuple(range(world_size))
    group = comm.new_group([world_size - 1])
    if comm.get_rank() == world_size - 1:
        assert comm.get_global_rank(group, 0) == world_size - 1
        assert comm.get_world_size(group) == 1 and comm.get_rank(group) == 0
        assert comm.group_ranks(group) == (world_size - 1,)
    else:  # torch's convention for non-members
        assert comm.get_world_size(group) == -1 and comm.get_rank(group) == -1
        with pytest.raises(ValueError, match="group_rank must be an int"):
            comm.get_global_rank(group, 0)


@multirank(world_sizes=WS)
def test_all_reduce_ops_and_dtypes(world_size):
    rank = comm.get_rank()
    expect = _all_rank_tensors(world_size, dtype=torch.float64)
    for op, ref in [
        (ReduceOp.SUM, torch.stack(expect).sum(0)),
        (ReduceOp.MAX, torch.stack(expect).amax(0)),
        (ReduceOp.MIN, torch.stack(expect).amin(0)),
        (ReduceOp.PRODUCT, torch.stack(expect).prod(0)),
        (ReduceOp.AVG, torch.stack(expect).mean(0)),
    ]:
        for dtype in (torch.float32, torch.bfloat16):
            t = _rank_tensor(rank, dtype=dtype)
            comm.all_reduce(t, op=op)
            torch.testing.assert_close(
                t, ref.to(dtype), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=0
            )
    # integer AVG (a gloo error natively): SUM then truncating division
    t = torch.tensor([7, -7, 3], dtype=torch.int64) * (rank + 1)
    comm.all_reduce(t, op=ReduceOp.AVG)
    total = torch.tensor([7, -7, 3]) * sum(range(1, world_size + 1))
    assert t.tolist() == torch.div(total, world_size, rounding_mode="trunc").tolist()
    # non-contiguous input
    base = torch.ones(4, 4) * (rank + 1)
    view = base.t()
    comm.all_reduce(view)
    assert torch.equal(base, torch.full((4, 4), float(sum(range(1, world_size + 1)))))


@multirank(world_sizes=WS)
def test_all_reduce_bool(world_size):
    rank = comm.get_rank()
    # rank 0: [T, T, F, F]; rank 1: [T, F, T, F]
    mine = torch.tensor([True, True, False, False]) if rank == 0 else torch.tensor([True, False, True, False])
    everyone = [torch.tensor([True, True, False, False]), torch.tensor([True, False, True, False])][
        :world_size
    ]
    any_ = torch.stack(everyone).any(0)
    all_ = torch.stack(everyone).all(0)
    xor = torch.stack(everyone).sum(0) % 2 == 1
    for op, ref in [
        (ReduceOp.SUM, any_),
        (ReduceOp.MAX, any_),
        (ReduceOp.MIN, all_),
        (ReduceOp.BAND, all_),
        (ReduceOp.BXOR, xor),
    ]:
        t = mine.clone()
        comm.all_reduce(t, op=op)
        assert t.dtype == torch.bool and torch.equal(t, ref), (op, t, ref)
    with pytest.raises(ValueError, match="not defined for bool"):
        comm.all_reduce(mine.clone(), op=ReduceOp.AVG)


@multirank(world_sizes=WS)
def test_all_reduce_async(world_size):
    rank = comm.get_rank()
    works, tensors = [], []
    for i in range(4):
        t = torch.full((3,), float(rank + i))
        tensors.append(t)
        works.append(comm.all_reduce(t, op=ReduceOp.AVG, async_op=True))
    assert all(isinstance(w, comm.Work) for w in works)
    for i, (w, t) in enumerate(zip(works, tensors)):
        assert w.wait() is True
        assert w.is_completed()
        expected = sum(r + i for r in range(world_size)) / world_size
        torch.testing.assert_close(t, torch.full((3,), expected))
    # the future resolves after the AVG division too
    t = torch.full((2,), float(rank + 1))
    fut = comm.all_reduce(t, op=ReduceOp.AVG, async_op=True).get_future()
    fut.wait()
    torch.testing.assert_close(t, torch.full((2,), (world_size + 1) / 2))


@multirank(world_sizes=WS)
def test_reduce(world_size):
    rank = comm.get_rank()
    dst = world_size - 1
    for op, ref in [
        (ReduceOp.SUM, torch.stack(_all_rank_tensors(world_size)).sum(0)),
        (ReduceOp.AVG, torch.stack(_all_rank_tensors(world_size)).mean(0)),
    ]:
        t = _rank_tensor(rank)
        comm.reduce(t, dst, op=op)
        if rank == dst:
            torch.testing.assert_close(t, ref, rtol=1e-5, atol=0)


@multirank(world_sizes=WS)
def test_reduce_scatter_tensor(world_size):
    rank = comm.get_rank()
    chunk = 3
    full = [_rank_tensor(r, chunk * world_size) for r in range(world_size)]
    ref_sum = torch.stack(full).sum(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the deprecated torch entry point is not used
        out = torch.empty(chunk)
        comm.reduce_scatter_tensor(out, _rank_tensor(rank, chunk * world_size))
    torch.testing.assert_close(out, ref_sum[rank * chunk : (rank + 1) * chunk], rtol=1e-5, atol=0)

    out = torch.empty(chunk)
    w = comm.reduce_scatter_tensor(
        out, _rank_tensor(rank, chunk * world_size), op=ReduceOp.AVG, async_op=True
    )
    w.wait()
    torch.testing.assert_close(
        out, (ref_sum / world_size)[rank * chunk : (rank + 1) * chunk], rtol=1e-5, atol=0
    )

    # 2-D input (world, chunk), bf16, and a non-contiguous output
    inp = _rank_tensor(rank, chunk * world_size, torch.bfloat16).view(world_size, chunk)
    holder = torch.zeros(chunk, 2, dtype=torch.bfloat16)
    comm.reduce_scatter_tensor(holder[:, 0], inp)
    ref_bf = torch.stack([t.to(torch.bfloat16) for t in full]).float().sum(0)
    torch.testing.assert_close(
        holder[:, 0].float(), ref_bf[rank * chunk : (rank + 1) * chunk], rtol=1e-2, atol=0
    )
    assert torch.equal(holder[:, 1], torch.zeros(chunk, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="input must have world_size"):
        comm.reduce_scatter_tensor(torch.empty(chunk), torch.empty(chunk * world_size + 1))


@multirank(world_sizes=WS)
def test_all_gather_into_tensor(world_size):
    rank = comm.get_rank()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = torch.empty(4 * world_size)
        comm.all_gather_into_tensor(out, _rank_tensor(rank, 4))
    assert torch.equal(out, torch.cat(_all_rank_tensors(world_size, 4)))
    # stacked (world, n) output, int64, async
    out2 = torch.empty(world_size, 4, dtype=torch.int64)
    comm.all_gather_into_tensor(out2, _rank_tensor(rank, 4, torch.int64), async_op=True).wait()
    assert torch.equal(out2, torch.stack(_all_rank_tensors(world_size, 4, torch.int64)))
    # bool (gathered as uint8 and copied back)
    out3 = torch.zeros(2 * world_size, dtype=torch.bool)
    comm.all_gather_into_tensor(out3, torch.tensor([rank % 2 == 0, True]))
    assert out3.tolist() == [v for r in range(world_size) for v in (r % 2 == 0, True)]
    with pytest.raises(ValueError, match="share dtype"):
        comm.all_gather_into_tensor(torch.empty(4 * world_size), torch.empty(4, dtype=torch.float64))


@multirank(world_sizes=WS)
def test_all_gather_list_even_and_uneven(world_size):
    rank = comm.get_rank()
    outs = [torch.empty(5) for _ in range(world_size)]
    comm.all_gather(outs, _rank_tensor(rank, 5))
    for r in range(world_size):
        assert torch.equal(outs[r], _rank_tensor(r, 5))
    # uneven sizes and shapes: rank r contributes (r + 1) x 2
    outs = [torch.empty(r + 1, 2) for r in range(world_size)]
    w = comm.all_gather(outs, torch.full((rank + 1, 2), float(rank)), async_op=True)
    w.wait()
    for r in range(world_size):
        assert torch.equal(outs[r], torch.full((r + 1, 2), float(r)))
    with pytest.raises(ValueError, match="this rank"):
        comm.all_gather([torch.empty(9) for _ in range(world_size)], torch.empty(3))


@multirank(world_sizes=WS)
def test_broadcast_and_objects(world_size):
    rank = comm.get_rank()
    src = world_size - 1
    t = _rank_tensor(rank, 4, torch.bfloat16)
    comm.broadcast(t, src)
    assert torch.equal(t, _rank_tensor(src, 4, torch.bfloat16))
    t = torch.full((2,), float(rank))
    comm.broadcast(t, 0, async_op=True).wait()
    assert t.tolist() == [0.0, 0.0]
    objs = [{"rank": rank}, "x"] if rank == 0 else [None, None]
    comm.broadcast_object_list(objs, src=0)
    assert objs == [{"rank": 0}, "x"]
    gathered = [None] * world_size
    comm.all_gather_object(gathered, ("r", rank))
    assert gathered == [("r", r) for r in range(world_size)]
    with pytest.raises(ValueError, match="src must be the global rank"):
        comm.broadcast(t, world_size)


@multirank(world_sizes=(1, 2, 3))
def test_all_to_all_single(world_size):
    rank = comm.get_rank()
    # equal splits: rank r sends value 10*r + j to rank j
    inp = torch.tensor([10.0 * rank + j for j in range(world_size) for _ in range(2)])
    out = torch.empty(2 * world_size)
    comm.all_to_all_single(out, inp)
    assert out.tolist() == [10.0 * src + rank for src in range(world_size) for _ in range(2)]
    # uneven splits (MoE dispatch): rank r sends (j + 1) rows of width 3 to rank j
    in_splits = [j + 1 for j in range(world_size)]
    out_splits = [rank + 1] * world_size
    inp = torch.cat([torch.full((j + 1, 3), 100.0 * rank + j) for j in range(world_size)])
    out = torch.empty(sum(out_splits), 3)
    comm.all_to_all_single(out, inp, out_splits, in_splits, async_op=True).wait()
    expected = torch.cat([torch.full((rank + 1, 3), 100.0 * src + rank) for src in range(world_size)])
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="input_split_sizes sums to"):
        comm.all_to_all_single(out, inp, out_splits, [s + 1 for s in in_splits])


@multirank(world_sizes=(2,))
def test_subgroup_collectives(world_size):
    rank = comm.get_rank()
    solo = [comm.new_group([r]) for r in range(world_size)]
    mine = solo[rank]
    t = torch.full((2,), float(rank + 1))
    comm.all_reduce(t, group=mine)
    assert t.tolist() == [rank + 1.0] * 2
    with pytest.raises(ValueError, match="not a member"):
        comm.all_reduce(t, group=solo[1 - rank])


@multirank(world_sizes=WS)
def test_barriers(world_size):
    comm.barrier()
    comm.monitored_barrier(timeout=30)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        comm.monitored_barrier(timeout=-1)
