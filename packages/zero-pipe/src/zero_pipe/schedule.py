"""Pipeline schedules: generators of instruction steps for one stage.

A schedule is built for ``(micro_batches, stages, stage_id)``; ``steps()`` yields one list of
instructions per step. Steps are atomic: a barrier between successive steps cannot deadlock.
The pipelined schedules derive their communication order from a global plan of all stages.
See [Note: deadlock-free pipeline communication] in ``timeline.py``.

[Note: 1F1B lookahead]
In the steady state of textbook 1F1B with equal stages nothing waits, but nothing can wait
either: with p = 2, stage 1 runs F(i), B(i), F(i+1) back to back, while the activation of
micro-batch i+1 comes from stage 0's F(i+1), which follows stage 0's B(i-1), which needs the
gradient stage 1's B(i-1) sent. That chain holds two messages and the same compute as stage 1's
own (B(i-1) on stage 0, then F(i+1), against F(i) and B(i) on stage 1), so every message's
latency L lands on the critical path, twice per micro-batch: the idle fraction grows by about
2 m L / span. With ``lookahead = 1`` stage 0 runs F(i+2) before B(i): the same chain now has a
whole forward and backward of slack, so a latency below about F + B is hidden; the bubble with
no latency is unchanged ((p-1)/(m+p-1)) and the price is one more micro-batch of activations on
every stage but the last. Simulated (F = 1, B = 2, latency 0.1 per message, p = 2, m = 8): idle
0.137 with lookahead 0, 0.118 with lookahead 1, formula 0.111 (``tests/test_pipe_schedule.py``).
It pays where latency, not the CPU time of moving a message, is what a stage loses: on the
project's 2-core CPU machine (``tools/bench/results/bench_pipe.md``, ``bench_pipe_linear.md``)
it lowered the idle fraction with 4 stages time-sharing 2 cores, where every wake-up waits for a
core, and made at most a point of difference with 2 stages, where a gloo message costs its
stage's thread a few hundred microseconds of CPU. Hence the default 0 (the memory of DeepSpeed's
and Megatron's 1F1B).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

from zero_pipe.instructions import (
    BackwardPass,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    ReduceGrads,
    ReduceTiedGrads,
)
from zero_pipe.timeline import Compute, PlanDeadlock, Timeline


def _check_int(name: str, value: object, minimum: int, owner: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")
    return value


class PipeSchedule(abc.ABC):
    """Directs a pipeline engine by yielding sequences of :class:`PipeInstruction`."""

    #: model chunks (virtual stages) held by each stage; >1 only for interleaved schedules
    chunks: int = 1

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        owner = type(self).__name__
        self.micro_batches = _check_int("micro_batches", micro_batches, 1, owner)
        self.stages = _check_int("stages", stages, 1, owner)
        self.stage_id = _check_int("stage_id", stage_id, 0, owner)
        if stage_id >= stages:
            raise ValueError(f"{owner}: stage_id must be in [0, {stages}), got {stage_id}")
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    @abc.abstractmethod
    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield the list of instructions of each step."""

    @abc.abstractmethod
    def num_pipe_buffers(self) -> int:
        """The number of pipeline buffers this stage needs."""

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()

    def cache_key(self) -> tuple:
        """Everything the instruction stream depends on (engines cache compiled streams by it)."""
        return (type(self), self.micro_batches, self.stages, self.stage_id, self.chunks)

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1


class _PlannedSchedule(PipeSchedule):
    """A schedule whose steps come from a :class:`Timeline` of per-stage compute orders."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        super().__init__(micro_batches, stages, stage_id)
        self.timeline = self._plan()

    def _plan(self) -> Timeline:
        orders = [self._compute_order(s) for s in range(self.stages)]
        return Timeline(orders, self.stages, self.chunks, self.micro_batches)

    @abc.abstractmethod
    def _compute_order(self, stage: int) -> list[Compute]:
        """The order in which ``stage`` runs its forward and backward computations."""

    def _final_step(self) -> list[PipeInstruction]:
        return []

    def steps(self) -> Iterator[list[PipeInstruction]]:
        yield from (list(step) for step in self.timeline.steps[self.stage_id])
        final = self._final_step()
        if final:
            yield final

    def allocated_buffers(self) -> int:
        """Buffers the compiled plan actually uses on this stage."""
        return self.timeline.num_buffers[self.stage_id]


class TrainSchedule(_PlannedSchedule):
    """Synchronous 1F1B training: warm up with forwards, alternate one forward and one
    backward, drain the backwards, then reduce gradients and step.

    Stage ``s`` keeps at most ``stages - s`` micro-batches in flight, so it needs
    ``min(stages - s, micro_batches)`` buffers. The idle fraction (bubble) is
    ``(p - 1) / (m + p - 1)`` with equal-cost stages.

    ``lookahead`` (keyword, zero-specific, default 0 = the textbook order) makes every stage but
    the last warm up with that many more forwards, so that message latency does not stall the
    steady state; each of those stages then holds ``lookahead`` more micro-batches in flight (the
    buffers of the compiled plan, ``num_pipe_buffers``, can be more). See [Note: 1F1B lookahead].
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int, *, lookahead: int = 0) -> None:
        self.lookahead = _check_int("lookahead", lookahead, 0, type(self).__name__)
        super().__init__(micro_batches, stages, stage_id)

    def cache_key(self) -> tuple:
        return (*super().cache_key(), self.lookahead)

    def _compute_order(self, stage: int) -> list[Compute]:
        m = self.micro_batches
        extra = self.lookahead if stage < self.stages - 1 else 0
        warmup = min(self.stages - stage - 1 + extra, m)
        order = [Compute("F", 0, i) for i in range(warmup)]
        for i in range(warmup, m):
            order.append(Compute("F", 0, i))
            order.append(Compute("B", 0, i - warmup))
        order.extend(Compute("B", 0, i) for i in range(m - warmup, m))
        return order

    def _final_step(self) -> list[PipeInstruction]:
        return [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]

    def num_pipe_buffers(self) -> int:
        """``min(stages - stage_id, micro_batches)`` without lookahead; what the plan uses."""
        return self.allocated_buffers()


class InferenceSchedule(_PlannedSchedule):
    """Forward passes only, pipelined; one buffer per stage suffices because each stage sends
    its output before it receives the next input (see the Note in ``timeline.py``)."""

    def _compute_order(self, stage: int) -> list[Compute]:
        return [Compute("F", 0, i) for i in range(self.micro_batches)]

    def num_pipe_buffers(self) -> int:
        return 1


class InterleavedTrainSchedule(_PlannedSchedule):
    """Interleaved 1F1B over virtual stages: stage ``s`` holds model chunks ``s, s + p, ...``.

    With ``chunks`` chunks per stage every computation is ``chunks`` times shorter, so the
    warm-up/drain bubble shrinks by about that factor, at the cost of ``chunks`` times more
    messages. Forwards go in rounds of ``stages`` micro-batches through chunk 0, then chunk 1,
    ...; backwards mirror that with the chunks reversed. Stage ``s`` warms up with
    ``2 (p - s - 1) + (chunks - 1) p`` forwards, then alternates one forward and one backward.
    Buffers are shared by all chunks of a stage; ``num_pipe_buffers`` is what the plan uses.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 2) -> None:
        self.chunks = _check_int("chunks", chunks, 1, type(self).__name__)
        if isinstance(stages, int) and stages < 2:
            raise ValueError(
                f"InterleavedTrainSchedule needs stages >= 2 (got {stages}); with one stage there is "
                "no bubble to cut: use TrainSchedule or DataParallelSchedule"
            )
        super().__init__(micro_batches, stages, stage_id)

    def _units(self, reverse_chunks: bool) -> list[tuple[int, int]]:
        p, m = self.stages, self.micro_batches
        chunk_seq = range(self.chunks - 1, -1, -1) if reverse_chunks else range(self.chunks)
        units = []
        for first in range(0, m, p):
            group = range(first, min(first + p, m))
            units.extend((c, i) for c in chunk_seq for i in group)
        return units

    def _order_with_warmup(self, warmup: int) -> list[Compute]:
        fwd = [Compute("F", c, i) for c, i in self._units(reverse_chunks=False)]
        bwd = [Compute("B", c, i) for c, i in self._units(reverse_chunks=True)]
        warmup = min(len(fwd), warmup)
        order = fwd[:warmup]
        for k, op in enumerate(fwd[warmup:]):
            order.append(op)
            order.append(bwd[k])
        order.extend(bwd[len(fwd) - warmup :])
        return order

    def _compute_order(self, stage: int) -> list[Compute]:
        return self._order_with_warmup(self._warmups[stage])

    def _plan(self) -> Timeline:
        """Build the timeline, trimming warm-ups where a partial last round of micro-batches
        (``micro_batches % stages != 0``) would make the textbook warm-up wait on itself."""
        p = self.stages
        self._warmups = [2 * (p - s - 1) + (self.chunks - 1) * p for s in range(p)]
        for _ in range(self.micro_batches * self.chunks * p + 1):
            orders = [self._compute_order(s) for s in range(p)]
            try:
                return Timeline(orders, p, self.chunks, self.micro_batches)
            except PlanDeadlock as err:
                # A stage stuck on a forward ran ahead too far: move one backward earlier.
                stuck = [s for s, op in err.waiting.items() if op.kind == "F" and self._warmups[s] > 0]
                if not stuck:
                    raise
                for s in stuck:
                    self._warmups[s] -= 1
        raise AssertionError("unreachable: warm-ups cannot shrink forever")

    def _final_step(self) -> list[PipeInstruction]:
        return [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]

    def num_pipe_buffers(self) -> int:
        return self.allocated_buffers()


class InterleavedInferenceSchedule(_PlannedSchedule):
    """Forward passes only over ``chunks`` model chunks per stage (the forward half of
    :class:`InterleavedTrainSchedule`: rounds of ``stages`` micro-batches through chunk 0, 1, ...)."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 2) -> None:
        self.chunks = _check_int("chunks", chunks, 1, type(self).__name__)
        if isinstance(stages, int) and stages < 2 and self.chunks > 1:
            raise ValueError(
                f"InterleavedInferenceSchedule needs stages >= 2 with several chunks (got {stages})"
            )
        super().__init__(micro_batches, stages, stage_id)

    def _compute_order(self, stage: int) -> list[Compute]:
        p, m = self.stages, self.micro_batches
        order = []
        for first in range(0, m, p):
            order.extend(
                Compute("F", c, i) for c in range(self.chunks) for i in range(first, min(first + p, m))
            )
        return order

    def num_pipe_buffers(self) -> int:
        return self.allocated_buffers()


class DataParallelSchedule(PipeSchedule):
    """Plain data parallelism with gradient accumulation (a single stage): load, forward,
    backward per micro-batch, then reduce and step after the last one."""

    def __init__(self, micro_batches: int, stages: int = 1, stage_id: int = 0) -> None:
        super().__init__(micro_batches, stages, stage_id)
        if stages != 1:
            raise ValueError(
                f"DataParallelSchedule runs a single stage; got stages={stages} (use TrainSchedule)"
            )

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step_id in range(self.micro_batches):
            cmds: list[PipeInstruction] = [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0)]
            if step_id == self.micro_batches - 1:
                cmds.extend([ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1
