"""Replaying a schedule's computations when stages share cores (processor sharing).

[Note: time-shared replay]
The bubble formula (p-1)/(m+p-1) and ``simulate`` assume one processor per stage. When p stage
processes share n < p cores (the project's benchmark machine runs 4 stages on 2 cores), a
stage's computation takes longer in wall time than its CPU time whenever its core-mate computes
too, and the wall-clock idle ``1 - busy / span`` then counts a stage busy while it is descheduled:
the pipeline's bubble and the sharing of cores mix in one number. ``replay_timeshared`` gives
the reference that separates them: it runs the schedule's computations as a dataflow (each
starts once its stage finished the previous one and the computations it depends on finished,
with no message cost), each taking its measured CPU time of work, on the given cores, every core
split equally among the stages computing on it at that instant (processor sharing, which Linux's
scheduler approximates at the millisecond scale of these computations). It reports the idle
fraction by wall time inside computations (what the benchmark measures) and by CPU time. With
one core per stage it is the plain replay of ``simulate(..., eager_sends=True, op_costs=...)``;
with n cores the CPU-time idle cannot go below ``1 - n / p``.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from zero_pipe.timeline import Compute, Timeline

__all__ = ["TimeshareResult", "replay_timeshared"]


@dataclass(frozen=True)
class TimeshareResult:
    """Span of the replay and, per stage, wall time inside computations and CPU work."""

    makespan: float
    busy_wall: list[float]
    busy_cpu: list[float]

    @property
    def idle_wall(self) -> float:
        """Mean over stages of ``1 - busy_wall / makespan`` (the benchmark's idle measure)."""
        return statistics.fmean(1 - b / self.makespan for b in self.busy_wall) if self.makespan else 0.0

    @property
    def idle_cpu(self) -> float:
        """Mean over stages of ``1 - busy_cpu / makespan`` (a stage is busy only while it runs)."""
        return statistics.fmean(1 - b / self.makespan for b in self.busy_cpu) if self.makespan else 0.0


def replay_timeshared(
    timeline: Timeline, costs: Sequence[Sequence[float]], cores: Sequence[int]
) -> TimeshareResult:
    """Replay ``timeline``'s compute orders, ``costs[s][k]`` being the CPU time of stage ``s``'s
    ``k``-th computation, with stage ``s`` on core ``cores[s]``. See [Note: time-shared replay]."""
    orders = timeline.orders
    p = len(orders)
    if len(costs) != p or len(cores) != p:
        raise ValueError(f"replay_timeshared: need one cost list and one core per stage ({p})")
    for s, (c, order) in enumerate(zip(costs, orders)):
        if len(c) != len(order) or any(not isinstance(x, (int, float)) or x < 0 for x in c):
            raise ValueError(
                f"replay_timeshared: costs[{s}] must hold {len(order)} non-negative numbers, got {len(c)}"
            )
    done: set[tuple[int, Compute]] = set()
    pos = [0] * p
    left: list[float | None] = [None] * p  # CPU work left in the running computation
    started = [0.0] * p
    busy_wall = [0.0] * p
    now = 0.0
    while True:
        for s in range(p):
            if left[s] is None and pos[s] < len(orders[s]):
                op = orders[s][pos[s]]
                if all(d in done for d in timeline.dependencies(s, op)):
                    left[s], started[s] = float(costs[s][pos[s]]), now
        running = [s for s in range(p) if left[s] is not None]
        if not running:
            if all(pos[s] == len(orders[s]) for s in range(p)):
                break
            raise ValueError(f"replay_timeshared: the compute orders wait on each other at {pos}")
        share = Counter(cores[s] for s in running)
        step = min(left[s] * share[cores[s]] for s in running)  # type: ignore[operator]
        now += step
        for s in running:
            rate = 1.0 / share[cores[s]]
            if left[s] * share[cores[s]] <= step * (1 + 1e-12):  # type: ignore[operator]
                done.add((s, orders[s][pos[s]]))
                busy_wall[s] += now - started[s]
                pos[s] += 1
                left[s] = None
            else:
                left[s] -= step * rate  # type: ignore[operator]
    return TimeshareResult(now, busy_wall, [float(sum(c)) for c in costs])
