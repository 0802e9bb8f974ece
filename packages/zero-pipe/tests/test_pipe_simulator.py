"""The simulator's asynchronous-transport mode and measured-cost replay (used by tools/bench)."""

from __future__ import annotations

import pytest
from zero_pipe.instructions import RecvActivation
from zero_pipe.schedule import InferenceSchedule, InterleavedTrainSchedule, TrainSchedule
from zero_pipe.simulator import ScheduleError, simulate


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_eager_mode_runs_every_schedule_with_the_same_messages(stages):
    for m in (1, 3, 4, 8):
        for cls, kw in (
            (TrainSchedule, {}),
            (InferenceSchedule, {}),
            (InterleavedTrainSchedule, {"chunks": 2}),
        ):
            rendezvous = simulate(cls, m, stages, **kw)
            eager = simulate(cls, m, stages, eager_sends=True, **kw)
            assert eager.messages == rendezvous.messages
            # Sends that never block can only make the run shorter.
            assert eager.makespan <= rendezvous.makespan + 1e-12


@pytest.mark.parametrize("stages,m", [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_eager_1f1b_bubble_is_the_textbook_formula(stages, m):
    result = simulate(TrainSchedule, m, stages, forward_cost=1.0, backward_cost=2.0, eager_sends=True)
    assert result.bubble_fraction == pytest.approx((stages - 1) / (m + stages - 1))


def test_replay_with_hand_computed_costs():
    # One micro-batch through 2 stages is a chain: F0, F1, B1, B0 (plus 2 messages).
    costs = [[1.0, 4.0], [2.0, 3.0]]  # stage 0: F, B; stage 1: F, B
    for eager in (False, True):
        res = simulate(TrainSchedule, 1, 2, op_costs=costs, eager_sends=eager)
        assert res.makespan == pytest.approx(10.0)
        assert res.busy == [pytest.approx(5.0), pytest.approx(5.0)]
        assert res.bubble_fraction == pytest.approx(0.5)
        assert simulate(TrainSchedule, 1, 2, comm_cost=0.5, op_costs=costs, eager_sends=eager).makespan == (
            pytest.approx(11.0)
        )


def test_replay_with_uniform_costs_equals_the_uniform_model():
    m, p = 6, 3
    # In 1F1B a stage's compute order is not strictly alternating: build costs from the stream.
    streams = [[i for step in TrainSchedule(m, p, s).steps() for i in step] for s in range(p)]
    ops = [
        [
            1.0 if type(i).__name__ == "ForwardPass" else 2.0
            for i in st
            if type(i).__name__ in ("ForwardPass", "BackwardPass")
        ]
        for st in streams
    ]
    replay = simulate(TrainSchedule, m, p, op_costs=ops, eager_sends=True)
    uniform = simulate(TrainSchedule, m, p, forward_cost=1.0, backward_cost=2.0, eager_sends=True)
    assert replay.makespan == pytest.approx(uniform.makespan)
    # A slow last stage stretches the pipeline: the replay sees it, the uniform model cannot.
    ops[-1] = [3 * c for c in ops[-1]]
    slow = simulate(TrainSchedule, m, p, op_costs=ops, eager_sends=True)
    assert slow.makespan > uniform.makespan
    assert slow.makespan >= sum(ops[-1])


def test_op_costs_are_validated():
    with pytest.raises(ValueError, match="one sequence per stage"):
        simulate(TrainSchedule, 2, 2, op_costs=[[1.0] * 4])
    with pytest.raises(ValueError, match=r"op_costs\[1\] must hold 4"):
        simulate(TrainSchedule, 2, 2, op_costs=[[1.0] * 4, [1.0] * 3])
    with pytest.raises(ValueError, match="non-negative"):
        simulate(TrainSchedule, 2, 2, op_costs=[[1.0] * 4, [1.0, -1.0, 1.0, 1.0]])


def test_eager_mode_catches_a_missing_receive():
    class NoRecv(TrainSchedule):
        def steps(self):
            for step in super().steps():
                yield [i for i in step if not isinstance(i, RecvActivation)]

    with pytest.raises(ScheduleError):
        simulate(NoRecv, 4, 2, eager_sends=True)
