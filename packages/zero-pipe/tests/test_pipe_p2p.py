"""Asynchronous p2p: tagged streams between one rank pair, posted receives, and the engine's
trace of compute and receive waits."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zero_core.testing import run_multirank

M = 3


def _tags_rank():
    from zero_pipe.p2p import P2PChannel, Payload, TensorMeta, post_recv, post_send

    rank = torch.distributed.get_rank()
    acts, grads = P2PChannel(1 - rank, tag=0), P2PChannel(1 - rank, tag=1)
    a = torch.arange(6.0).reshape(2, 3)
    b = (torch.arange(6.0).reshape(2, 3) + 100, torch.tensor([True, False]))
    if rank == 0:
        acts.send(a)  # handshakes, then payloads, on each tag
        grads.send(b)
        # Same shapes on two tags: posted in the opposite order by the receiver.
        pending = [post_send([a * 2], 1, tag=0), post_send([a * 3], 1, tag=1)]
        for p in pending:
            p.wait()
        return None
    got_a, got_b = acts.recv(), grads.recv()
    meta = Payload((TensorMeta((2, 3), torch.float32),), True)
    second = post_recv(meta, 0, tag=1)
    first = post_recv(meta, 0, tag=0)
    return got_a, got_b, first.wait()[0], second.wait()[0]


def _handshake_rank():
    """Rank 0 starts the first send of a channel (handshake included), then waits for rank 1,
    which sends on another tag before it receives: a blocking handshake (gloo's send waits for
    the matching receive) would deadlock here."""
    from zero_pipe.p2p import P2PChannel, Payload, TensorMeta, post_recv, post_send

    rank = torch.distributed.get_rank()
    channel = P2PChannel(1 - rank, tag=10)
    if rank == 0:
        pending = channel.isend((torch.full((3, 2), 7.0), torch.tensor([True, False, True])))
        other = post_recv(Payload((TensorMeta((4,), torch.float32),), False), 1, tag=11).wait()
        pending.wait()
        return other
    post_send([torch.arange(4.0)], 0, tag=11).wait()
    return channel.recv()


def _all_rank():
    return _tags_rank(), [_trace_rank(chunks, M) for chunks in (1, 2)], _handshake_rank()


@pytest.fixture(scope="module")
def ranks():
    """One launch of 2 ranks for every test of this file (process start-up dominates)."""
    return run_multirank(_all_rank, 2, timeout=60)


def test_the_first_send_of_a_channel_does_not_block(ranks):
    assert torch.equal(ranks[0][2], torch.arange(4.0))
    values, mask = ranks[1][2]
    assert torch.equal(values, torch.full((3, 2), 7.0))
    assert mask.dtype == torch.bool and mask.tolist() == [True, False, True]


def test_tags_keep_streams_apart_whatever_the_posting_order(ranks):
    got_a, got_b, first, second = ranks[1][0]
    assert ranks[0][0] is None
    a = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(got_a, a)
    assert isinstance(got_b, tuple) and torch.equal(got_b[0], a + 100)
    assert got_b[1].dtype == torch.bool and got_b[1].tolist() == [True, False]
    assert torch.equal(first, a * 2) and torch.equal(second, a * 3)


def _trace_rank(chunks, m):
    from zero_pipe import LayerSpec, PipelineEngine, PipelineModule

    torch.manual_seed(0)
    model = PipelineModule(
        [LayerSpec(nn.Linear, 8, 8) for _ in range(4)],
        num_stages=2,
        loss_fn=nn.functional.mse_loss,
        num_chunks=chunks,
    )
    engine = PipelineEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": m},
    )
    data = [(torch.randn(2, 8), torch.randn(2, 8)) for _ in range(m)]
    engine.train_batch(iter(data))
    engine.trace = []
    engine.train_batch(iter(data))
    return list(engine.trace), engine.executor.in_flight()


def test_trace_has_every_compute_and_wait_and_no_transfer_outlives_the_batch(ranks):
    m = M
    for chunks, k in ((1, 0), (2, 1)):
        for stage, (trace, in_flight) in enumerate(r[1][k] for r in ranks):
            kinds = [s.kind for s in trace]
            assert kinds.count("F") == kinds.count("B") == m * chunks
            # Receives per stage: activations into every virtual stage but the first, gradients
            # into every one but the last.
            virtual = [c * 2 + stage for c in range(chunks)]
            recvs = sum(m * ((v > 0) + (v < 2 * chunks - 1)) for v in virtual)
            assert kinds.count("W") == recvs
            for span, nxt in zip(trace, trace[1:]):
                assert span.start <= span.end <= nxt.start  # sequential, in execution order
            assert all(0.0 <= s.cpu <= (s.end - s.start) + 1e-3 for s in trace)
            assert in_flight == (0, 0)
