"""The execution stream of one stage: a schedule's steps, flattened, in the order the engine runs them.

[Note: sends right after their compute]
A schedule's steps (see [Note: deadlock-free pipeline communication] in ``timeline.py``) put
every message in the tick where its *consumer* needs it, an order that is safe even when a send
blocks until its receive is posted. The engine's sends never block (``isend``, see
[Note: asynchronous p2p] in ``p2p.py``), so it issues every ``SendActivation``/``SendGrad``
right after the ``ForwardPass``/``BackwardPass`` that produced its data, instead of where the
tick grid put it.

Why: the tick grid assumes every computation costs one tick. When a backward costs more than a
forward, a send placed at its consumer's tick can sit behind one or more of the producer's
other computations, and the consumer idles for them. 1F1B is not affected (its ticks already put
each send right after its compute), but the interleaved schedule is: simulated with F = 1,
B = 2 per chunk, p = 2, m = 8, 2 chunks and no transport cost, the idle fraction is 0.158 with
tick-placed sends and 0.059 = (p-1)/(c m + p-1) with sends right after their compute
(``tests/test_pipe_stream.py`` checks the formula for several p and m).

Why it cannot deadlock: a stage now blocks only while waiting for a receive. The message it
waits for is sent by its peer right after the computation producing it, and that computation
waits only for computations earlier in the compute orders, which are acyclic (``Timeline``
placed them all on a tick grid, or raised ``PlanDeadlock``). So every wait ends. Each stream of
messages (one tag: activations or gradients of one chunk) carries micro-batches in the
producer's compute order for that chunk, which is also the consumer's (every schedule here runs
the micro-batches of a chunk in increasing order), so receives still match their sends.

Receives keep their place (right before the computation that consumes them); the engine posts
them ahead of time (see [Note: receive prefetch] in ``executor.py``), which is what ``next_same``
and ``first_receives`` of :class:`ExecutionStream` are for.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from zero_pipe.instructions import (
    BackwardPass,
    ForwardPass,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)
from zero_pipe.schedule import PipeSchedule

__all__ = ["ExecutionStream", "compile_stream", "sends_after_compute"]

_PRODUCER = {SendActivation: ForwardPass, SendGrad: BackwardPass}


def sends_after_compute(instructions: Iterable[PipeInstruction]) -> list[PipeInstruction]:
    """``instructions`` with every send moved to right after the computation producing its data.

    See [Note: sends right after their compute]. The producer of ``SendActivation(b, c)`` is the
    last ``ForwardPass(b, c)`` before it, of ``SendGrad(b, c)`` the last ``BackwardPass(b, c)``;
    a send without one is a broken schedule and raises ``ValueError``. Every other instruction
    keeps its relative order.
    """
    items = list(instructions)
    last_compute: dict[tuple[type, int, int], int] = {}
    hoisted: dict[int, list[PipeInstruction]] = {}
    kept: list[tuple[int, PipeInstruction]] = []
    for i, ins in enumerate(items):
        if isinstance(ins, (ForwardPass, BackwardPass)):
            last_compute[(type(ins), ins.buffer_id, ins.chunk_id)] = i
        producer = _PRODUCER.get(type(ins))
        if producer is None:
            kept.append((i, ins))
            continue
        at = last_compute.get((producer, ins.buffer_id, ins.chunk_id))
        if at is None:
            raise ValueError(
                f"sends_after_compute: {ins} at position {i} has no {producer.__name__} before it"
            )
        hoisted.setdefault(at, []).append(ins)
    out: list[PipeInstruction] = []
    for i, ins in kept:
        out.append(ins)
        out.extend(hoisted.get(i, ()))
    return out


@dataclass(frozen=True)
class ExecutionStream:
    """One stage's instructions in execution order, with what receive prefetching needs.

    ``next_same[i]`` is the index of the next receive of the same stream (type and chunk) after
    the receive at ``i``; ``first_receives`` holds the index of the first receive of every stream.
    """

    instructions: tuple[PipeInstruction, ...]
    next_same: dict[int, int]
    first_receives: tuple[int, ...]


def compile_stream(schedule: PipeSchedule) -> ExecutionStream:
    """The execution stream of ``schedule``'s stage (see [Note: sends right after their compute])."""
    if not isinstance(schedule, PipeSchedule):
        raise TypeError(f"compile_stream: expected a PipeSchedule, got {type(schedule)}")
    stream = sends_after_compute(ins for step in schedule.steps() for ins in step)
    next_same: dict[int, int] = {}
    last: dict[tuple[type, int], int] = {}
    first: list[int] = []
    for i, ins in enumerate(stream):
        if isinstance(ins, (RecvActivation, RecvGrad)):
            key = (type(ins), ins.chunk_id)
            if key in last:
                next_same[last[key]] = i
            else:
                first.append(i)
            last[key] = i
    return ExecutionStream(tuple(stream), next_same, tuple(first))
