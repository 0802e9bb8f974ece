"""Execute the instruction streams of all stages of a schedule without any tensors.

The simulator is an independent check of a schedule: it runs every stage's steps as separate
actors with *rendezvous* point-to-point semantics (a send completes only when the matching
receive is posted, the strictest blocking model), tracks which micro-batch each pipeline buffer
holds, and reports deadlocks, unmatched messages, buffer clobbering, and missing or repeated
computations. With per-op costs it also gives the makespan and the bubble (idle) fraction.

``eager_sends=True`` models the engine's asynchronous transport instead (see [Note: asynchronous
p2p] in ``p2p.py``): every stage runs the engine's execution stream, with each send right after
the computation producing it (see [Note: sends right after their compute] in ``stream.py``), a
send completes at once, and a receive waits until its message was sent (plus ``comm_cost``).
``op_costs`` replaces the uniform forward/backward costs by the measured duration of every
computation (per stage, in execution order), so a measured run can be *replayed*: the idle time
the schedule's dependencies alone imply given the compute the stages really did, which separates
the bubble from transport and runtime overheads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from zero_pipe.instructions import (
    BackwardPass,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
    SendGrad,
)
from zero_pipe.schedule import PipeSchedule
from zero_pipe.stream import compile_stream


class ScheduleError(AssertionError):
    """The schedule is wrong (deadlock, mismatched messages, clobbered buffers, ...)."""


@dataclass
class SimResult:
    """What a simulation found: time, busy time per stage and buffers used per stage."""

    makespan: float
    busy: list[float]
    buffers_used: list[int]
    messages: int
    trace: list[list[tuple[float, float, str]]] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all stages' time: ``1 - sum(busy) / (stages * makespan)``."""
        if self.makespan == 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


@dataclass
class _Slot:
    chunk: int
    mb: int
    has_input: bool = False
    has_output: bool = False
    has_grad: bool = False
    backward_done: bool = False


def simulate(
    schedule_cls: type[PipeSchedule],
    micro_batches: int,
    stages: int,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    comm_cost: float = 0.0,
    *,
    eager_sends: bool = False,
    op_costs: Sequence[Sequence[float]] | None = None,
    **schedule_kwargs,
) -> SimResult:
    """Run ``schedule_cls(micro_batches, stages, s, **schedule_kwargs)`` for every stage.

    ``op_costs[s][k]`` is the cost of stage ``s``'s ``k``-th ForwardPass/BackwardPass (in stream
    order); when given it overrides ``forward_cost``/``backward_cost``.
    """
    scheds = [schedule_cls(micro_batches, stages, s, **schedule_kwargs) for s in range(stages)]
    chunks = scheds[0].chunks
    num_virtual = stages * chunks
    if eager_sends:  # the engine's order: See [Note: sends right after their compute]
        streams = [list(compile_stream(sch).instructions) for sch in scheds]
    else:
        streams = [[ins for step in sch.steps() for ins in step] for sch in scheds]
    if op_costs is not None:
        _check_op_costs(op_costs, streams)
    computed = [0] * stages
    inbox: dict[tuple[int, int, str], deque[tuple[float, int]]] = {}
    is_train = any(isinstance(i, BackwardPass) for st in streams for i in st)
    pc = [0] * stages
    clock = [0.0] * stages
    busy = [0.0] * stages
    slots: list[dict[int, _Slot]] = [dict() for _ in range(stages)]
    used: list[set[int]] = [set() for _ in range(stages)]
    loads = [[0] * chunks for _ in range(stages)]
    done_f: set[tuple[int, int]] = set()  # (virtual stage, mb)
    done_b: set[tuple[int, int]] = set()
    messages = 0
    trace: list[list[tuple[float, float, str]]] = [[] for _ in range(stages)]

    def fail(s: int, msg: str) -> None:
        raise ScheduleError(f"{schedule_cls.__name__}(m={micro_batches}, p={stages}) stage {s}: {msg}")

    def vstage(s: int, chunk: int) -> int:
        return chunk * stages + s

    def peer(s: int, ins) -> tuple[int, int]:
        """(peer stage, peer chunk) of a message instruction."""
        v = vstage(s, ins.chunk_id)
        w = v + 1 if isinstance(ins, (SendActivation, RecvGrad)) else v - 1
        if not 0 <= w < num_virtual:
            fail(s, f"{ins} has no peer stage (virtual stage {w})")
        return w % stages, w // stages

    def slot_for_write(s: int, ins, mb: int) -> None:
        old = slots[s].get(ins.buffer_id)
        if old is not None:
            fail(
                s,
                f"{ins} overwrites buffer {ins.buffer_id} still holding micro-batch {old.mb} of chunk {old.chunk}",
            )
        slots[s][ins.buffer_id] = _Slot(ins.chunk_id, mb, has_input=True)
        used[s].add(ins.buffer_id)

    def slot_of(s: int, ins) -> _Slot:
        slot = slots[s].get(ins.buffer_id)
        if slot is None or slot.chunk != ins.chunk_id:
            fail(s, f"{ins} on an empty buffer or a buffer of another chunk")
        return slot

    def release_if_done(s: int, buf: int, slot: _Slot, sent_grad: bool = False) -> None:
        v = vstage(s, slot.chunk)
        if not is_train:
            done = v == num_virtual - 1 or (slot.has_output and sent_grad)
        else:
            done = slot.backward_done and (v == 0 or sent_grad)
        if done:
            del slots[s][buf]

    def local_step(s: int, ins) -> bool:
        """Run a non-message instruction; returns False if it cannot run."""
        v = vstage(s, getattr(ins, "chunk_id", 0))
        cost = 0.0
        if isinstance(ins, LoadMicroBatch):
            mb = loads[s][ins.chunk_id]
            loads[s][ins.chunk_id] += 1
            if v == 0:
                slot_for_write(s, ins, mb)
            else:  # labels on the last stage land in the buffer of the received inputs
                if v != num_virtual - 1:
                    fail(s, f"{ins} on a middle virtual stage {v}")
                slot = slots[s].get(ins.buffer_id)
                if slot is None:
                    slot_for_write(s, ins, mb)
                elif slot.mb != mb:
                    fail(s, f"labels of micro-batch {mb} loaded next to inputs of micro-batch {slot.mb}")
        elif isinstance(ins, ForwardPass):
            slot = slot_of(s, ins)
            if slot.has_output:
                fail(s, f"{ins}: forward of micro-batch {slot.mb} run twice")
            slot.has_output = True
            done_f.add((v, slot.mb))
            cost = forward_cost if op_costs is None else op_costs[s][computed[s]]
            computed[s] += 1
            if not is_train and v == num_virtual - 1:
                release_if_done(s, ins.buffer_id, slot)
        elif isinstance(ins, BackwardPass):
            slot = slot_of(s, ins)
            if not slot.has_output or (v < num_virtual - 1 and not slot.has_grad) or slot.backward_done:
                fail(s, f"{ins}: backward of micro-batch {slot.mb} without output/gradient or run twice")
            slot.backward_done = True
            done_b.add((v, slot.mb))
            cost = backward_cost if op_costs is None else op_costs[s][computed[s]]
            computed[s] += 1
            release_if_done(s, ins.buffer_id, slot)
        elif isinstance(ins, (ReduceGrads, OptimizerStep)):
            mine = {(vstage(s, c), i) for c in range(chunks) for i in range(micro_batches)}
            if is_train and not mine <= done_b:
                fail(s, f"{ins} before every backward of this stage finished")
        if cost:
            trace[s].append((clock[s], clock[s] + cost, type(ins).__name__))
        clock[s] += cost
        busy[s] += cost
        return True

    def eager_step() -> bool:
        """Sends complete at once into the receiver's inbox; receives take delivered messages."""
        nonlocal messages
        moved = False
        for s in range(stages):
            while pc[s] < len(streams[s]):
                ins = streams[s][pc[s]]
                if isinstance(ins, (SendActivation, SendGrad)):
                    t, t_chunk = peer(s, ins)
                    src = slot_of(s, ins)
                    kind = "A" if isinstance(ins, SendActivation) else "G"
                    if kind == "A" and not src.has_output:
                        fail(s, f"{ins} before the forward of micro-batch {src.mb}")
                    if kind == "G" and not src.backward_done:
                        fail(s, f"{ins} before the backward of micro-batch {src.mb}")
                    inbox.setdefault((t, t_chunk, kind), deque()).append((clock[s] + comm_cost, src.mb))
                    if kind == "G" or not is_train:
                        release_if_done(s, ins.buffer_id, src, sent_grad=True)
                    messages += 1
                elif isinstance(ins, (RecvActivation, RecvGrad)):
                    kind = "A" if isinstance(ins, RecvActivation) else "G"
                    queue = inbox.get((s, ins.chunk_id, kind))
                    if not queue:
                        break
                    arrival, mb = queue.popleft()
                    if kind == "A":
                        slot_for_write(s, ins, mb)
                    else:
                        dst = slot_of(s, ins)
                        if dst.mb != mb or not dst.has_output or dst.has_grad:
                            fail(
                                s,
                                f"{ins} receives the gradient of micro-batch {mb} into micro-batch {dst.mb}",
                            )
                        dst.has_grad = True
                    clock[s] = max(clock[s], arrival)
                else:
                    break
                pc[s] += 1
                moved = True
        return moved

    def rendezvous_step() -> bool:
        """Match messages whose both ends are at the head of their streams."""
        nonlocal messages
        moved = False
        for s in range(stages):
            if pc[s] >= len(streams[s]):
                continue
            ins = streams[s][pc[s]]
            if not isinstance(ins, (SendActivation, SendGrad)):
                continue
            t, t_chunk = peer(s, ins)
            if pc[t] >= len(streams[t]):
                continue
            other = streams[t][pc[t]]
            want = RecvActivation if isinstance(ins, SendActivation) else RecvGrad
            if (
                not isinstance(other, want)
                or other.chunk_id != t_chunk
                or peer(t, other) != (s, ins.chunk_id)
            ):
                continue
            src = slot_of(s, ins)
            if isinstance(ins, SendActivation):
                if not src.has_output:
                    fail(s, f"{ins} before the forward of micro-batch {src.mb}")
                slot_for_write(t, other, src.mb)
                if not is_train:
                    release_if_done(s, ins.buffer_id, src, sent_grad=True)
            else:
                if not src.backward_done:
                    fail(s, f"{ins} before the backward of micro-batch {src.mb}")
                dst = slot_of(t, other)
                if dst.mb != src.mb or not dst.has_output or dst.has_grad:
                    fail(
                        t, f"{other} receives the gradient of micro-batch {src.mb} into micro-batch {dst.mb}"
                    )
                dst.has_grad = True
                release_if_done(s, ins.buffer_id, src, sent_grad=True)
            start = max(clock[s], clock[t])
            clock[s] = clock[t] = start + comm_cost
            pc[s] += 1
            pc[t] += 1
            messages += 1
            moved = True
        return moved

    while True:
        progressed = False
        for s in range(stages):
            while pc[s] < len(streams[s]) and not isinstance(
                streams[s][pc[s]], (SendActivation, RecvActivation, SendGrad, RecvGrad)
            ):
                local_step(s, streams[s][pc[s]])
                pc[s] += 1
                progressed = True
        progressed |= eager_step() if eager_sends else rendezvous_step()
        if all(pc[s] == len(streams[s]) for s in range(stages)):
            break
        if not progressed:
            heads = {s: streams[s][pc[s]] for s in range(stages) if pc[s] < len(streams[s])}
            raise ScheduleError(
                f"{schedule_cls.__name__}(m={micro_batches}, p={stages}) deadlocks at {heads}"
            )

    if any(inbox.values()):
        raise ScheduleError(f"messages sent but never received: {[k for k, q in inbox.items() if q]}")
    want_f = {(v, i) for v in range(num_virtual) for i in range(micro_batches)}
    if done_f != want_f:
        raise ScheduleError(f"missing forwards: {sorted(want_f - done_f)}")
    if is_train and done_b != want_f:
        raise ScheduleError(f"missing backwards: {sorted(want_f - done_b)}")
    for s in range(stages):
        if slots[s]:
            raise ScheduleError(f"stage {s} ends with buffers still held: {sorted(slots[s])}")
    return SimResult(
        makespan=max(clock),
        busy=busy,
        buffers_used=[len(u) for u in used],
        messages=messages,
        trace=trace,
    )


def _check_op_costs(op_costs: Sequence[Sequence[float]], streams: list[list]) -> None:
    if len(op_costs) != len(streams):
        raise ValueError(
            f"simulate: op_costs needs one sequence per stage ({len(streams)}), got {len(op_costs)}"
        )
    for s, (costs, stream) in enumerate(zip(op_costs, streams)):
        n = sum(isinstance(i, (ForwardPass, BackwardPass)) for i in stream)
        if len(costs) != n or any(not isinstance(c, (int, float)) or c < 0 for c in costs):
            raise ValueError(
                f"simulate: op_costs[{s}] must hold {n} non-negative numbers (one per forward/backward "
                f"of stage {s}, in order), got {len(costs)}"
            )
