"""Time-shared replay: stages sharing cores (see [Note: time-shared replay])."""

from __future__ import annotations

import random

import pytest
from zero_pipe.schedule import InterleavedTrainSchedule, TrainSchedule
from zero_pipe.simulator import simulate
from zero_pipe.timeshare import replay_timeshared


def _costs(timeline, seed):
    rng = random.Random(seed)
    return [[rng.uniform(0.5, 3.0) for _ in order] for order in timeline.orders]


@pytest.mark.parametrize("cls,kw", [(TrainSchedule, {}), (InterleavedTrainSchedule, {"chunks": 2})])
@pytest.mark.parametrize("stages,m", [(2, 4), (3, 5), (4, 8)])
def test_one_core_per_stage_is_the_plain_replay(cls, kw, stages, m):
    timeline = cls(m, stages, 0, **kw).timeline
    costs = _costs(timeline, seed=stages * 100 + m)
    shared = replay_timeshared(timeline, costs, cores=list(range(stages)))
    plain = simulate(cls, m, stages, eager_sends=True, op_costs=costs, **kw)
    assert shared.makespan == pytest.approx(plain.makespan)
    assert shared.idle_wall == pytest.approx(plain.bubble_fraction)
    assert shared.idle_cpu == pytest.approx(plain.bubble_fraction)


def test_one_core_for_all_stages_never_idles():
    timeline = TrainSchedule(6, 3, 0).timeline
    costs = _costs(timeline, seed=7)
    res = replay_timeshared(timeline, costs, cores=[0, 0, 0])
    assert res.makespan == pytest.approx(sum(map(sum, costs)))  # some stage can always run
    assert res.idle_cpu == pytest.approx(1 - 1 / 3)
    assert res.idle_wall < res.idle_cpu  # time a stage spends descheduled mid-compute counts as busy


def test_two_stages_on_one_core_by_hand():
    # 1F1B, p=2, m=2: stage 0 runs F0 F1 B0 B1, stage 1 runs F0 B0 F1 B1; costs F=1, B=2.
    timeline = TrainSchedule(2, 2, 0).timeline
    costs = [[1.0, 1.0, 2.0, 2.0], [1.0, 2.0, 1.0, 2.0]]
    res = replay_timeshared(timeline, costs, cores=[0, 0])
    # t=0-1 s0.F0 alone; t=1-3 s0.F1 and s1.F0 share the core (both end at 3); t=3-5 s1.B0 alone;
    # t=5-9 s0.B0 and s1.F1 share: s1.F1 ends at 7, then s0.B0 (1 left) shares with s1.B1 (2):
    # s0.B0 ends at 9, s1.B1 then has 1 left alone: ends 10; s0.B1 runs 10-12.
    assert res.makespan == pytest.approx(12.0)
    assert res.busy_wall == [pytest.approx(1 + 2 + 4 + 2), pytest.approx(2 + 2 + 2 + 3)]
    assert res.busy_cpu == [6.0, 6.0]


def test_four_stages_on_two_cores_is_bounded_by_both_limits():
    stages, m = 4, 8
    timeline = TrainSchedule(m, stages, 0).timeline
    costs = _costs(timeline, seed=3)
    res = replay_timeshared(timeline, costs, cores=[0, 1, 0, 1])
    dedicated = replay_timeshared(timeline, costs, cores=[0, 1, 2, 3])
    per_core = [sum(map(sum, costs[c::2])) for c in range(2)]
    assert res.makespan >= max(per_core) - 1e-9
    assert res.makespan >= dedicated.makespan - 1e-9
    assert res.idle_cpu >= 1 - 2 / 4 - 1e-9


def test_inputs_are_checked():
    timeline = TrainSchedule(2, 2, 0).timeline
    with pytest.raises(ValueError, match="one cost list and one core per stage"):
        replay_timeshared(timeline, [[1.0] * 4], cores=[0, 1])
    with pytest.raises(ValueError, match=r"costs\[1\] must hold 4"):
        replay_timeshared(timeline, [[1.0] * 4, [1.0] * 3], cores=[0, 1])
