"""The engine's execution stream: every send right after the computation producing it, receive
prefetch links, and the bubble this order gives (see [Note: sends right after their compute])."""

from __future__ import annotations

from collections import Counter

import pytest
from zero_pipe.instructions import (
    BackwardPass,
    ForwardPass,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)
from zero_pipe.schedule import InferenceSchedule, InterleavedTrainSchedule, TrainSchedule
from zero_pipe.simulator import simulate
from zero_pipe.stream import compile_stream, sends_after_compute

SCHEDULES = [
    (TrainSchedule, {}),
    (InferenceSchedule, {}),
    (InterleavedTrainSchedule, {"chunks": 2}),
    (InterleavedTrainSchedule, {"chunks": 3}),
]


@pytest.mark.parametrize("cls,kw", SCHEDULES)
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_every_send_follows_its_compute_and_nothing_else_moves(cls, kw, stages):
    for m in (1, 3, 4, 8):
        for s in range(stages):
            sched = cls(m, stages, s, **kw)
            steps = [ins for step in sched.steps() for ins in step]
            stream = list(compile_stream(sched).instructions)
            assert Counter(map(repr, stream)) == Counter(map(repr, steps))
            sends = (SendActivation, SendGrad)
            assert [i for i in stream if not isinstance(i, sends)] == [
                i for i in steps if not isinstance(i, sends)
            ]
            for k, ins in enumerate(stream):
                if isinstance(ins, sends):
                    producer = ForwardPass if isinstance(ins, SendActivation) else BackwardPass
                    prev = stream[k - 1]
                    assert isinstance(prev, producer), (m, s, k, ins, prev)
                    assert (prev.buffer_id, prev.chunk_id) == (ins.buffer_id, ins.chunk_id)


def test_prefetch_links_chain_the_receives_of_each_stream():
    compiled = compile_stream(InterleavedTrainSchedule(4, 2, 1, chunks=2))
    stream = compiled.instructions
    recvs = [i for i, ins in enumerate(stream) if isinstance(ins, (RecvActivation, RecvGrad))]
    by_stream: dict[tuple, list[int]] = {}
    for i in recvs:
        by_stream.setdefault((type(stream[i]), stream[i].chunk_id), []).append(i)
    # Stage 1 of 2 stages x 2 chunks holds virtual stages 1 and 3: activations into both, gradients into 1.
    assert set(by_stream) == {(RecvActivation, 0), (RecvActivation, 1), (RecvGrad, 0)}
    assert sorted(compiled.first_receives) == sorted(v[0] for v in by_stream.values())
    expected = {a: b for idx in by_stream.values() for a, b in zip(idx, idx[1:])}
    assert compiled.next_same == expected


def test_a_send_without_its_compute_is_an_error():
    with pytest.raises(ValueError, match="no BackwardPass before it"):
        sends_after_compute([ForwardPass(0), SendGrad(0)])
    with pytest.raises(TypeError, match="PipeSchedule"):
        compile_stream([ForwardPass(0)])


@pytest.mark.parametrize("stages,m", [(2, 4), (2, 8), (3, 6), (4, 4), (4, 8), (4, 16)])
@pytest.mark.parametrize("b_over_f", [1.0, 2.0, 3.0])
def test_interleaved_bubble_is_the_formula_whatever_backward_costs(stages, m, b_over_f):
    # Megatron's bound (p-1)/(c m + p-1) for c chunks; with sends placed at the consumer's tick
    # the simulated bubble was 0.158 instead of 0.059 at p=2, m=8, B=2F.
    chunks = 2
    res = simulate(
        InterleavedTrainSchedule,
        m,
        stages,
        forward_cost=1.0 / chunks,
        backward_cost=b_over_f / chunks,
        eager_sends=True,
        chunks=chunks,
    )
    assert res.bubble_fraction == pytest.approx((stages - 1) / (chunks * m + stages - 1))
    plain = simulate(TrainSchedule, m, stages, forward_cost=1.0, backward_cost=b_over_f, eager_sends=True)
    assert res.makespan < plain.makespan
