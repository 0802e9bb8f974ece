"""Compile per-stage compute orders into deadlock-free instruction streams.

[Note: deadlock-free pipeline communication]
The order is derived for *blocking* (rendezvous) point-to-point ops, the strictest model; the
engine's asynchronous transport runs a relaxed form of it, each send moved up to right after its
computation (see [Note: sends right after their compute] in ``stream.py``) and receives posted
ahead (see [Note: receive prefetch] in ``executor.py``). A schedule is described by
the order in which each stage runs its forward (F) and backward (B) computations. We place
every computation on a global clock of ticks "as soon as possible" (one computation per stage
per tick, after its dependencies finished in an earlier tick) and transmit each message in the
tick its consumer needs it. Within a tick, all messages are sorted by one global key, and every
stage runs its sends/receives in that order. Every stage's communication sequence is then a
subsequence of one global total order, so the smallest outstanding message always has both
ends ready: no deadlock, whatever the relative speeds of the stages. The tick grid is only
used to derive the order; execution is not lock-stepped. Gradients are ordered before
activations within a tick so a buffer freed by ``SendGrad`` can be reused by a receive in the
same tick, and sends to later stages go before receives from earlier ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from zero_pipe.instructions import (
    BackwardPass,
    ForwardPass,
    LoadMicroBatch,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)


@dataclass(frozen=True)
class Compute:
    """One computation: ``kind`` 'F' or 'B' of micro-batch ``mb`` on model chunk ``chunk``."""

    kind: str
    chunk: int
    mb: int


class PlanDeadlock(ValueError):
    """The compute orders wait on each other: no stage can make progress."""

    def __init__(self, tick: int, waiting: dict[int, Compute]) -> None:
        super().__init__(f"pipeline compute orders deadlock at tick {tick}: stages wait on {waiting}")
        self.tick, self.waiting = tick, waiting


# Positions inside one tick (see the Note): gradient messages, activation messages, loads, compute.
_POS_GRAD, _POS_ACT, _POS_LOAD, _POS_COMPUTE = 0, 1, 2, 3


class Timeline:
    """The compiled plan of all stages: per stage, the list of instruction steps.

    ``orders[s]`` is stage ``s``'s compute order. Virtual stage ``v = chunk * stages + s``;
    a micro-batch flows through virtual stages ``0 .. chunks * stages - 1``. ``backward``
    says whether the plan trains (F and B) or only infers (F).
    """

    def __init__(self, orders: list[list[Compute]], stages: int, chunks: int, micro_batches: int) -> None:
        if chunks > 1 and stages < 2:
            raise ValueError(
                "Timeline: several chunks need at least two stages (chunk hand-offs are messages)"
            )
        self.stages, self.chunks, self.micro_batches = stages, chunks, micro_batches
        self.num_virtual = stages * chunks
        #: the compute order of every stage, as given
        self.orders = [list(o) for o in orders]
        self.ticks = self._assign_ticks(orders)
        self.num_ticks = 1 + max((t for t in self.ticks.values()), default=-1)
        self.steps, self.num_buffers = self._emit()

    # -- placement on the tick grid -------------------------------------------------------
    def dependencies(self, stage: int, op: Compute) -> list[tuple[int, Compute]]:
        """The ``(stage, computation)`` pairs whose results ``op`` of ``stage`` needs."""
        v = op.chunk * self.stages + stage
        deps = []
        if op.kind == "F":
            if v > 0:
                deps.append(((v - 1) % self.stages, Compute("F", (v - 1) // self.stages, op.mb)))
        else:
            deps.append((stage, Compute("F", op.chunk, op.mb)))
            if v < self.num_virtual - 1:
                deps.append(((v + 1) % self.stages, Compute("B", (v + 1) // self.stages, op.mb)))
        return deps

    def _assign_ticks(self, orders: list[list[Compute]]) -> dict[tuple[int, Compute], int]:
        ticks: dict[tuple[int, Compute], int] = {}
        cursor = [0] * self.stages
        remaining = sum(len(o) for o in orders)
        tick = 0
        while remaining:
            progressed = False
            for s in range(self.stages):
                if cursor[s] == len(orders[s]):
                    continue
                op = orders[s][cursor[s]]
                if all(ticks.get(d, tick) < tick for d in self.dependencies(s, op)):
                    ticks[(s, op)] = tick
                    cursor[s] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                stuck = {s: orders[s][cursor[s]] for s in range(self.stages) if cursor[s] < len(orders[s])}
                raise PlanDeadlock(tick, stuck)
            tick += 1
        return ticks

    # -- emission of instruction steps ----------------------------------------------------
    def _emit(self) -> tuple[list[list[list[PipeInstruction]]], list[int]]:
        p = self.stages
        last_v = self.num_virtual - 1
        # events[s][tick] -> list of (pos, key, builder(buffer_of) -> instruction)
        events: list[dict[int, list]] = [dict() for _ in range(p)]
        # live[s][(chunk, mb)] -> [(start tick, pos), (end tick, pos)] of the buffer it needs
        live: list[dict[tuple[int, int], list]] = [dict() for _ in range(p)]

        def touch(s: int, chunk: int, mb: int, tick: int, pos: int, key: tuple) -> None:
            # The exact place in the stream: tick, then position, then message order.
            at = (tick, pos, key)
            span = live[s].setdefault((chunk, mb), [at, at])
            span[0] = min(span[0], at)
            span[1] = max(span[1], at)

        def add(s: int, tick: int, pos: int, key: tuple, cls: type, chunk: int, mb: int) -> None:
            events[s].setdefault(tick, []).append((pos, key, cls, chunk, mb))
            touch(s, chunk, mb, tick, pos, key)

        for (s, op), tick in self.ticks.items():
            v = op.chunk * p + s
            if op.kind == "F":
                if v == 0 or v == last_v:
                    add(s, tick, _POS_LOAD, (), LoadMicroBatch, op.chunk, op.mb)
                if v > 0:
                    # Later consumers first (descending v): sends go before receives.
                    key = (-v, op.mb)
                    add((v - 1) % p, tick, _POS_ACT, key, SendActivation, (v - 1) // p, op.mb)
                    add(s, tick, _POS_ACT, key, RecvActivation, op.chunk, op.mb)
                add(s, tick, _POS_COMPUTE, (), ForwardPass, op.chunk, op.mb)
            else:
                if v < last_v:
                    key = (v, op.mb)
                    add((v + 1) % p, tick, _POS_GRAD, key, SendGrad, (v + 1) // p, op.mb)
                    add(s, tick, _POS_GRAD, key, RecvGrad, op.chunk, op.mb)
                add(s, tick, _POS_COMPUTE, (), BackwardPass, op.chunk, op.mb)

        steps: list[list[list[PipeInstruction]]] = []
        num_buffers: list[int] = []
        for s in range(p):
            buffer_of = _allocate_buffers(live[s])
            num_buffers.append(1 + max(buffer_of.values(), default=0))
            stage_steps = []
            for tick in range(self.num_ticks):
                evs = sorted(events[s].get(tick, []), key=lambda e: (e[0], e[1]))
                stage_steps.append([cls(buffer_of[(c, mb)], chunk_id=c) for _, _, cls, c, mb in evs])
            steps.append(stage_steps)
        return steps, num_buffers


def _allocate_buffers(live: dict[tuple[int, int], list]) -> dict[tuple[int, int], int]:
    """Greedy interval colouring: a buffer is reused once its previous user's last use is past.

    Spans are ``(tick, position, message key)`` places; a span ending strictly before another starts can
    share its buffer (e.g. ``SendGrad`` then ``RecvActivation`` in the same tick).
    """
    free: list[int] = []
    busy: list[tuple[tuple, int]] = []  # (last use, buffer)
    assignment: dict[tuple[int, int], int] = {}
    for item, (start, end) in sorted(live.items(), key=lambda kv: (kv[1][0], kv[0])):
        free.extend(buf for last, buf in busy if last < start)
        busy = [(last, buf) for last, buf in busy if last >= start]
        if free:
            free.sort()
            buf = free.pop(0)
        else:
            buf = len(busy) + len(free)
        assignment[item] = buf
        busy.append((end, buf))
    return assignment
