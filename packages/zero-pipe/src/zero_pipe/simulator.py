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
    if eager_sends:  # the engine's order: See [Note: sends right after their compute]
        streams = [list(compile_stream(sch).instructions) for sch in scheds]
    else:
        streams = [[ins for step in sch.steps() for ins in step] for sch in scheds]
    if op_costs is not None:
        _check_op_costs(op_costs, streams)
    sim = _Simulation(
        f"{schedule_cls.__name__}(m={micro_batches}, p={stages})",
        streams,
        micro_batches,
        scheds[0].chunks,
        (forward_cost, backward_cost, comm_cost),
        op_costs,
    )
    sim.run(eager_sends)
    return sim.result()


class _Simulation:
    """The state of one simulation: each stage's position in its stream, clock, buffers and the
    messages in flight; :func:`simulate` builds it and runs it to the end."""

    def __init__(
        self,
        name: str,
        streams: list[list],
        micro_batches: int,
        chunks: int,
        costs: tuple[float, float, float],
        op_costs: Sequence[Sequence[float]] | None,
    ) -> None:
        stages = len(streams)
        self.name, self.streams = name, streams
        self.micro_batches, self.stages, self.chunks = micro_batches, stages, chunks
        self.num_virtual = stages * chunks
        self.forward_cost, self.backward_cost, self.comm_cost = costs
        self.op_costs = op_costs
        self.computed = [0] * stages
        self.inbox: dict[tuple[int, int, str], deque[tuple[float, int]]] = {}
        self.is_train = any(isinstance(i, BackwardPass) for st in streams for i in st)
        self.pc = [0] * stages
        self.clock = [0.0] * stages
        self.busy = [0.0] * stages
        self.slots: list[dict[int, _Slot]] = [dict() for _ in range(stages)]
        self.used: list[set[int]] = [set() for _ in range(stages)]
        self.loads = [[0] * chunks for _ in range(stages)]
        self.done_f: set[tuple[int, int]] = set()  # (virtual stage, mb)
        self.done_b: set[tuple[int, int]] = set()
        self.messages = 0
        self.trace: list[list[tuple[float, float, str]]] = [[] for _ in range(stages)]

    # -- helpers ------------------------------------------------------------------------------
    def fail(self, s: int, msg: str) -> None:
        raise ScheduleError(f"{self.name} stage {s}: {msg}")

    def vstage(self, s: int, chunk: int) -> int:
        return chunk * self.stages + s

    def peer(self, s: int, ins) -> tuple[int, int]:
        """(peer stage, peer chunk) of a message instruction."""
        v = self.vstage(s, ins.chunk_id)
        w = v + 1 if isinstance(ins, (SendActivation, RecvGrad)) else v - 1
        if not 0 <= w < self.num_virtual:
            self.fail(s, f"{ins} has no peer stage (virtual stage {w})")
        return w % self.stages, w // self.stages

    def slot_for_write(self, s: int, ins, mb: int) -> None:
        old = self.slots[s].get(ins.buffer_id)
        if old is not None:
            self.fail(
                s,
                f"{ins} overwrites buffer {ins.buffer_id} still holding micro-batch {old.mb} of chunk {old.chunk}",
            )
        self.slots[s][ins.buffer_id] = _Slot(ins.chunk_id, mb, has_input=True)
        self.used[s].add(ins.buffer_id)

    def slot_of(self, s: int, ins) -> _Slot:
        slot = self.slots[s].get(ins.buffer_id)
        if slot is None or slot.chunk != ins.chunk_id:
            self.fail(s, f"{ins} on an empty buffer or a buffer of another chunk")
        return slot

    def release_if_done(self, s: int, buf: int, slot: _Slot, sent_grad: bool = False) -> None:
        v = self.vstage(s, slot.chunk)
        if not self.is_train:
            done = v == self.num_virtual - 1 or (slot.has_output and sent_grad)
        else:
            done = slot.backward_done and (v == 0 or sent_grad)
        if done:
            del self.slots[s][buf]

    # -- local instructions -------------------------------------------------------------------
    def local_step(self, s: int, ins) -> None:
        """Run a non-message instruction of stage ``s``."""
        v = self.vstage(s, getattr(ins, "chunk_id", 0))
        cost = 0.0
        if isinstance(ins, LoadMicroBatch):
            self._load(s, ins, v)
        elif isinstance(ins, ForwardPass):
            cost = self._forward(s, ins, v)
        elif isinstance(ins, BackwardPass):
            cost = self._backward(s, ins, v)
        elif isinstance(ins, (ReduceGrads, OptimizerStep)):
            mine = {(self.vstage(s, c), i) for c in range(self.chunks) for i in range(self.micro_batches)}
            if self.is_train and not mine <= self.done_b:
                self.fail(s, f"{ins} before every backward of this stage finished")
        if cost:
            self.trace[s].append((self.clock[s], self.clock[s] + cost, type(ins).__name__))
        self.clock[s] += cost
        self.busy[s] += cost

    def _load(self, s: int, ins, v: int) -> None:
        mb = self.loads[s][ins.chunk_id]
        self.loads[s][ins.chunk_id] += 1
        if v == 0:
            self.slot_for_write(s, ins, mb)
            return
        # labels on the last stage land in the buffer of the received inputs
        if v != self.num_virtual - 1:
            self.fail(s, f"{ins} on a middle virtual stage {v}")
        slot = self.slots[s].get(ins.buffer_id)
        if slot is None:
            self.slot_for_write(s, ins, mb)
        elif slot.mb != mb:
            self.fail(s, f"labels of micro-batch {mb} loaded next to inputs of micro-batch {slot.mb}")

    def _compute_cost(self, s: int, default: float) -> float:
        cost = default if self.op_costs is None else self.op_costs[s][self.computed[s]]
        self.computed[s] += 1
        return cost

    def _forward(self, s: int, ins, v: int) -> float:
        slot = self.slot_of(s, ins)
        if slot.has_output:
            self.fail(s, f"{ins}: forward of micro-batch {slot.mb} run twice")
        slot.has_output = True
        self.done_f.add((v, slot.mb))
        cost = self._compute_cost(s, self.forward_cost)
        if not self.is_train and v == self.num_virtual - 1:
            self.release_if_done(s, ins.buffer_id, slot)
        return cost

    def _backward(self, s: int, ins, v: int) -> float:
        slot = self.slot_of(s, ins)
        if not slot.has_output or (v < self.num_virtual - 1 and not slot.has_grad) or slot.backward_done:
            self.fail(s, f"{ins}: backward of micro-batch {slot.mb} without output/gradient or run twice")
        slot.backward_done = True
        self.done_b.add((v, slot.mb))
        cost = self._compute_cost(s, self.backward_cost)
        self.release_if_done(s, ins.buffer_id, slot)
        return cost

    # -- messages -----------------------------------------------------------------------------
    def _check_sendable(self, s: int, ins, src: _Slot) -> None:
        if isinstance(ins, SendActivation) and not src.has_output:
            self.fail(s, f"{ins} before the forward of micro-batch {src.mb}")
        if isinstance(ins, SendGrad) and not src.backward_done:
            self.fail(s, f"{ins} before the backward of micro-batch {src.mb}")

    def _take_grad(self, t: int, recv, mb: int) -> None:
        """Stage ``t`` receives the gradient of micro-batch ``mb`` into ``recv``'s buffer."""
        dst = self.slot_of(t, recv)
        if dst.mb != mb or not dst.has_output or dst.has_grad:
            self.fail(t, f"{recv} receives the gradient of micro-batch {mb} into micro-batch {dst.mb}")
        dst.has_grad = True

    def _eager_send(self, s: int, ins) -> None:
        t, t_chunk = self.peer(s, ins)
        src = self.slot_of(s, ins)
        self._check_sendable(s, ins, src)
        kind = "A" if isinstance(ins, SendActivation) else "G"
        self.inbox.setdefault((t, t_chunk, kind), deque()).append((self.clock[s] + self.comm_cost, src.mb))
        if kind == "G" or not self.is_train:
            self.release_if_done(s, ins.buffer_id, src, sent_grad=True)
        self.messages += 1

    def _eager_recv(self, s: int, ins) -> bool:
        """Take the next delivered message for ``ins``; False when none has arrived yet."""
        kind = "A" if isinstance(ins, RecvActivation) else "G"
        queue = self.inbox.get((s, ins.chunk_id, kind))
        if not queue:
            return False
        arrival, mb = queue.popleft()
        if kind == "A":
            self.slot_for_write(s, ins, mb)
        else:
            self._take_grad(s, ins, mb)
        self.clock[s] = max(self.clock[s], arrival)
        return True

    def eager_step(self) -> bool:
        """Sends complete at once into the receiver's inbox; receives take delivered messages."""
        moved = False
        for s in range(self.stages):
            while self.pc[s] < len(self.streams[s]):
                ins = self.streams[s][self.pc[s]]
                if isinstance(ins, (SendActivation, SendGrad)):
                    self._eager_send(s, ins)
                elif not isinstance(ins, (RecvActivation, RecvGrad)) or not self._eager_recv(s, ins):
                    break
                self.pc[s] += 1
                moved = True
        return moved

    def _matching_recv(self, s: int, ins):
        """The receive at the head of the peer's stream that matches send ``ins``, or None."""
        t, t_chunk = self.peer(s, ins)
        if self.pc[t] >= len(self.streams[t]):
            return None
        other = self.streams[t][self.pc[t]]
        want = RecvActivation if isinstance(ins, SendActivation) else RecvGrad
        if (
            not isinstance(other, want)
            or other.chunk_id != t_chunk
            or self.peer(t, other) != (s, ins.chunk_id)
        ):
            return None
        return other

    def _rendezvous(self, s: int, ins, t: int, other) -> None:
        src = self.slot_of(s, ins)
        self._check_sendable(s, ins, src)
        if isinstance(ins, SendActivation):
            self.slot_for_write(t, other, src.mb)
            if not self.is_train:
                self.release_if_done(s, ins.buffer_id, src, sent_grad=True)
        else:
            self._take_grad(t, other, src.mb)
            self.release_if_done(s, ins.buffer_id, src, sent_grad=True)
        start = max(self.clock[s], self.clock[t])
        self.clock[s] = self.clock[t] = start + self.comm_cost
        self.pc[s] += 1
        self.pc[t] += 1
        self.messages += 1

    def rendezvous_step(self) -> bool:
        """Match messages whose both ends are at the head of their streams."""
        moved = False
        for s in range(self.stages):
            if self.pc[s] >= len(self.streams[s]):
                continue
            ins = self.streams[s][self.pc[s]]
            if not isinstance(ins, (SendActivation, SendGrad)):
                continue
            other = self._matching_recv(s, ins)
            if other is None:
                continue
            self._rendezvous(s, ins, self.peer(s, ins)[0], other)
            moved = True
        return moved

    # -- the run ------------------------------------------------------------------------------
    def run(self, eager_sends: bool) -> None:
        streams, pc = self.streams, self.pc
        messages = (SendActivation, RecvActivation, SendGrad, RecvGrad)
        while True:
            progressed = False
            for s in range(self.stages):
                while pc[s] < len(streams[s]) and not isinstance(streams[s][pc[s]], messages):
                    self.local_step(s, streams[s][pc[s]])
                    pc[s] += 1
                    progressed = True
            progressed |= self.eager_step() if eager_sends else self.rendezvous_step()
            if all(pc[s] == len(streams[s]) for s in range(self.stages)):
                break
            if not progressed:
                heads = {s: streams[s][pc[s]] for s in range(self.stages) if pc[s] < len(streams[s])}
                raise ScheduleError(f"{self.name} deadlocks at {heads}")
        self._check_complete()

    def _check_complete(self) -> None:
        if any(self.inbox.values()):
            raise ScheduleError(
                f"messages sent but never received: {[k for k, q in self.inbox.items() if q]}"
            )
        want_f = {(v, i) for v in range(self.num_virtual) for i in range(self.micro_batches)}
        if self.done_f != want_f:
            raise ScheduleError(f"missing forwards: {sorted(want_f - self.done_f)}")
        if self.is_train and self.done_b != want_f:
            raise ScheduleError(f"missing backwards: {sorted(want_f - self.done_b)}")
        for s in range(self.stages):
            if self.slots[s]:
                raise ScheduleError(f"stage {s} ends with buffers still held: {sorted(self.slots[s])}")

    def result(self) -> SimResult:
        return SimResult(
            makespan=max(self.clock),
            busy=self.busy,
            buffers_used=[len(u) for u in self.used],
            messages=self.messages,
            trace=self.trace,
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
