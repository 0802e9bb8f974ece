"""Every schedule, run by the rendezvous simulator: matched messages, no deadlock, buffers as claimed."""

from __future__ import annotations

import pytest
from zero_pipe.instructions import OptimizerStep, RecvActivation
from zero_pipe.schedule import (
    DataParallelSchedule,
    InferenceSchedule,
    InterleavedTrainSchedule,
    TrainSchedule,
)
from zero_pipe.simulator import ScheduleError, simulate

STAGES = range(1, 9)
MICRO = range(1, 17)


@pytest.mark.parametrize("cls", [TrainSchedule, InferenceSchedule])
@pytest.mark.parametrize("stages", STAGES)
def test_pipelined_schedules_complete_with_claimed_buffers(cls, stages):
    for m in MICRO:
        result = simulate(cls, m, stages)
        claims = [cls(m, stages, s).num_pipe_buffers() for s in range(stages)]
        assert result.buffers_used == claims, (m, stages)
        expected_msgs = (2 if cls is TrainSchedule else 1) * m * (stages - 1)
        assert result.messages == expected_msgs


@pytest.mark.parametrize("stages", range(2, 9))
def test_interleaved_schedule_completes_with_claimed_buffers(stages):
    for m in MICRO:
        result = simulate(InterleavedTrainSchedule, m, stages, chunks=2)
        claims = [InterleavedTrainSchedule(m, stages, s, chunks=2).num_pipe_buffers() for s in range(stages)]
        assert result.buffers_used == claims
        assert result.messages == 2 * m * (2 * stages - 1)


def test_data_parallel_schedule():
    for m in MICRO:
        result = simulate(DataParallelSchedule, m, 1)
        assert result.buffers_used == [1]
    with pytest.raises(ValueError, match="single stage"):
        DataParallelSchedule(4, 2, 0)


def test_train_schedule_buffers_closed_form():
    assert [TrainSchedule(8, 4, s).num_pipe_buffers() for s in range(4)] == [4, 3, 2, 1]
    assert [TrainSchedule(2, 4, s).num_pipe_buffers() for s in range(4)] == [2, 2, 2, 1]
    # One more micro-batch in flight on every stage but the last (See [Note: 1F1B lookahead]).
    assert [TrainSchedule(8, 4, s, lookahead=1).num_pipe_buffers() for s in range(4)] == [5, 4, 3, 1]


@pytest.mark.parametrize("lookahead", [1, 2])
@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_lookahead_schedules_complete_with_claimed_buffers_and_the_same_bubble(lookahead, stages):
    for m in MICRO:
        result = simulate(TrainSchedule, m, stages, lookahead=lookahead)
        claims = [TrainSchedule(m, stages, s, lookahead=lookahead).num_pipe_buffers() for s in range(stages)]
        assert result.buffers_used == claims, (m, stages)
        assert result.messages == 2 * m * (stages - 1)
        eager = simulate(TrainSchedule, m, stages, 1.0, 2.0, eager_sends=True, lookahead=lookahead)
        assert eager.bubble_fraction == pytest.approx((stages - 1) / (m + stages - 1))


@pytest.mark.parametrize("stages,m", [(2, 8), (2, 16), (4, 8), (4, 16)])
def test_lookahead_hides_message_latency(stages, m):
    formula = (stages - 1) / (m + stages - 1)
    plain, ahead = (
        simulate(
            TrainSchedule, m, stages, 1.0, 2.0, comm_cost=0.1, eager_sends=True, lookahead=k
        ).bubble_fraction
        for k in (0, 1)
    )
    assert ahead < plain
    # Latency is left only in warm-up and drain: less than half of textbook 1F1B's excess.
    assert ahead - formula < (plain - formula) / 2
    with pytest.raises(ValueError, match="lookahead"):
        TrainSchedule(4, 2, 0, lookahead=-1)


@pytest.mark.parametrize("stages,m", [(2, 8), (4, 8), (4, 16)])
def test_1f1b_bubble_matches_theory(stages, m):
    result = simulate(TrainSchedule, m, stages, forward_cost=1.0, backward_cost=2.0)
    assert result.bubble_fraction == pytest.approx((stages - 1) / (m + stages - 1))


@pytest.mark.parametrize("stages,m", [(2, 8), (4, 8), (4, 16), (8, 16)])
def test_interleaving_cuts_the_bubble_with_equal_costs(stages, m):
    plain = simulate(TrainSchedule, m, stages, forward_cost=1.0, backward_cost=1.0)
    inter = simulate(InterleavedTrainSchedule, m, stages, forward_cost=0.5, backward_cost=0.5, chunks=2)
    assert inter.makespan < plain.makespan
    assert inter.bubble_fraction < plain.bubble_fraction


def test_simulator_catches_a_broken_schedule():
    class NoRecv(TrainSchedule):
        def steps(self):
            for step in super().steps():
                yield [i for i in step if not isinstance(i, RecvActivation)]

    with pytest.raises(ScheduleError):
        simulate(NoRecv, 4, 2)

    class SwapOrder(TrainSchedule):  # receive before the peer sends, both sides: deadlock
        def steps(self):
            for step in super().steps():
                yield sorted(step, key=lambda i: not type(i).__name__.startswith("Recv"))

    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(SwapOrder, 4, 3)


def test_train_schedule_ends_with_step_and_validates():
    steps = list(TrainSchedule(4, 2, 0).steps())
    assert isinstance(steps[-1][-1], OptimizerStep)
    with pytest.raises(ValueError, match="stage_id"):
        TrainSchedule(4, 2, 2)
    with pytest.raises(ValueError, match="micro_batches"):
        TrainSchedule(0, 2, 0)
    with pytest.raises(ValueError, match="stages >= 2"):
        InterleavedTrainSchedule(4, 1, 0)
