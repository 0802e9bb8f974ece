"""``StageExecutor``: runs one stage's instruction stream of one batch (compute and p2p).

The engine (``engine.py``) owns the batch/step API; this module owns what happens inside a
batch: the execution stream (see [Note: sends right after their compute] in ``stream.py``),
the forward and backward passes of each buffer, the asynchronous transfers, and the trace.

Activations move between *virtual* stages ``v -> v + 1`` (``v = chunk * stages + stage``, see
[Note: model chunks] in ``module.py``); each boundary has its own :class:`P2PChannel` (and
tags), so every boundary keeps its own cached shapes.

[Note: receive prefetch]
Sends are asynchronous and receives are posted ahead of the instruction that consumes them (see
[Note: asynchronous p2p] in ``p2p.py``): when a batch starts, the first receive of every stream
(activations of a chunk, gradients of a chunk) whose shapes are known is posted, and whenever a
receive completes the next one of the same stream is posted. The data of micro-batch ``i + 1``
thus flows while micro-batch ``i`` computes. No send blocks, so a stage blocks only in a receive
wait, for a message its peer sends right after computing it: every wait ends (see the Note in
``stream.py``). All sends of a batch are waited on before the batch returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from zero_core.engine.loss_scaler import LossScaler

from zero_pipe.instructions import (
    BackwardPass,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from zero_pipe.module import PipelineModule
from zero_pipe.optimizer_step import StageOptimizer
from zero_pipe.p2p import (
    P2PChannel,
    Payload,
    PendingRecv,
    PendingSend,
    TensorMeta,
    activation_tag,
    as_tensors,
    grad_tag,
    post_recv,
    post_send,
)
from zero_pipe.schedule import PipeSchedule
from zero_pipe.stream import ExecutionStream, compile_stream

__all__ = ["BatchResult", "ComputeSpan", "StageExecutor"]


class ComputeSpan(NamedTuple):
    """One traced interval of a stage: ``kind`` is ``"F"``/``"B"`` (forward/backward compute of
    ``chunk``) or ``"W"`` (blocked waiting for a received activation or gradient). ``start`` and
    ``end`` are ``time.perf_counter()`` values (CLOCK_MONOTONIC, comparable across processes on
    one host); ``cpu`` is the calling thread's CPU time over the span, so ``end - start - cpu``
    of a compute span is time taken from it by other processes."""

    kind: str
    chunk: int
    start: float
    end: float
    cpu: float


class BatchResult(NamedTuple):
    """What one batch produced on this stage: the detached loss of every micro-batch (last
    stage) and, when not training, the last stage's outputs."""

    losses: list[torch.Tensor]
    outputs: list[Any]


class StageExecutor:
    """Executes the instructions of one pipeline stage, one batch at a time.

    ``compute_dtype`` is what floating inputs of the first stage are cast to (fp16/bf16 runs).
    Set :attr:`trace` to a list to record a :class:`ComputeSpan` per forward, backward and
    receive wait.
    """

    def __init__(
        self,
        module: PipelineModule,
        stage_optimizer: StageOptimizer,
        loss_scaler: LossScaler,
        compute_dtype: torch.dtype,
    ) -> None:
        grid = module.grid()
        if grid is None:
            raise ValueError("StageExecutor: the PipelineModule was built without a process group")
        self.module = module
        self.grid = grid
        self.stage_optimizer = stage_optimizer
        self.loss_scaler = loss_scaler
        self.compute_dtype = compute_dtype
        self.stage_id = grid.stage_id
        self.num_stages = grid.pipe_parallel_size
        self.num_chunks = module.num_chunks
        #: True between ReduceTiedGrads and OptimizerStep of a training batch
        self.at_boundary = False
        self.trace: list[ComputeSpan] | None = None
        self._channels: dict[int, P2PChannel] = {}
        self._compiled: dict[tuple, ExecutionStream] = {}
        self._posted: dict[int, PendingRecv] = {}
        self._sends: list[PendingSend] = []

    # -- public ----------------------------------------------------------------------------
    def reset_activation_shape(self) -> None:
        """Forget cached activation shapes (call on every rank when they change)."""
        for ch in self._channels.values():
            ch.reset()

    def in_flight(self) -> tuple[int, int]:
        """(sends not yet retired, receives posted but not consumed); both 0 between batches."""
        return len(self._sends), len(self._posted)

    def run(
        self,
        schedule: PipeSchedule,
        next_batch: Callable[[], Any],
        *,
        training: bool,
        compute_loss: bool = True,
    ) -> BatchResult:
        """Run ``schedule``'s stream for this stage; ``next_batch()`` yields each micro-batch
        ``(inputs, labels)`` (called by the first and last stages only)."""
        if not isinstance(schedule, PipeSchedule) or schedule.stage_id != self.stage_id:
            raise ValueError(
                f"StageExecutor.run: expected a PipeSchedule of stage {self.stage_id}, got {schedule!r}"
            )
        self._training, self._compute_loss, self._next_batch = training, compute_loss, next_batch
        self._micro_batches = schedule.micro_batches
        self._inputs: dict[int, Any] = {}
        self._labels: dict[int, Any] = {}
        self._outputs_buf: dict[int, Any] = {}
        self._grads: dict[int, list[torch.Tensor]] = {}
        self._losses: list[torch.Tensor] = []
        self._outputs: list[Any] = []
        self.at_boundary = False
        compiled = self._compile(schedule)
        self._stream, self._next_same = compiled.instructions, compiled.next_same
        self._posted, self._sends = {}, []
        for i in compiled.first_receives:  # See [Note: receive prefetch]
            self._prefetch(i)
        for i, ins in enumerate(self._stream):
            self._pc = i
            self._INSTRUCTIONS[type(ins)](self, ins)
        while self._sends:
            self._sends.pop(0).wait()
        return BatchResult(self._losses, self._outputs)

    # -- stream ----------------------------------------------------------------------------
    def _compile(self, schedule: PipeSchedule) -> ExecutionStream:
        """Cached by the schedule's ``cache_key()`` (class, sizes, stage, options)."""
        key = schedule.cache_key()
        hit = self._compiled.get(key)
        if hit is None:
            hit = self._compiled[key] = compile_stream(schedule)
        return hit

    def _virtual(self, chunk_id: int) -> int:
        return chunk_id * self.num_stages + self.stage_id

    def _is_first_virtual(self, chunk_id: int) -> bool:
        return self._virtual(chunk_id) == 0

    def _is_last_virtual(self, chunk_id: int) -> bool:
        return self._virtual(chunk_id) == self.num_stages * self.num_chunks - 1

    def _stage_rank(self, virtual: int) -> int:
        return self.grid.stage_to_global(virtual % self.num_stages)

    def _channel(self, boundary: int) -> P2PChannel:
        """The channel carrying activations from virtual stage ``boundary`` to ``boundary + 1``."""
        ch = self._channels.get(boundary)
        if ch is None:
            v_here = [self._virtual(c) for c in range(self.num_chunks)]
            peer = boundary + 1 if boundary in v_here else boundary
            ch = self._channels[boundary] = P2PChannel(
                self._stage_rank(peer), activation_tag(boundary), dynamic=self.module.dynamic_shape
            )
        return ch

    # -- transfers -------------------------------------------------------------------------
    def _recv_source(self, ins: RecvActivation | RecvGrad) -> tuple[Payload | None, int, int]:
        """(payload if known, peer rank, tag) of a RecvActivation/RecvGrad instruction."""
        v = self._virtual(ins.chunk_id)
        if isinstance(ins, RecvActivation):
            ch = self._channel(v - 1)
            return ch.payload, ch.peer, ch.tag
        sent = self._channel(v).payload  # gradients have the shapes of the activations we sent
        payload = None if sent is None else Payload(sent.floating(), True)
        return payload, self._stage_rank(v + 1), grad_tag(v)

    def _prefetch(self, index: int | None) -> None:
        """Post the receive of instruction ``index`` now, if its shapes are known (never with
        dynamic shapes: See [Note: dynamic activation shapes] in ``p2p.py``)."""
        if index is None or index in self._posted or self.module.dynamic_shape:
            return
        payload, peer, tag = self._recv_source(self._stream[index])
        if payload is not None:
            self._posted[index] = post_recv(payload, peer, tag)

    def _received(self, post: Callable[[], PendingRecv]) -> Any:
        """Wait for the receive of the current instruction (posted ahead or by ``post``), then
        post the next receive of the same stream."""
        pending = self._posted.pop(self._pc, None)
        if pending is None:
            pending = post()
        if self.trace is None:
            value = pending.wait()
        else:
            start, cpu = time.perf_counter(), time.thread_time()
            value = pending.wait()
            end, cpu = time.perf_counter(), time.thread_time() - cpu
            self.trace.append(ComputeSpan("W", self._stream[self._pc].chunk_id, start, end, cpu))
        self._prefetch(self._next_same.get(self._pc))
        return value

    def _sent(self, pending: PendingSend) -> None:
        """Keep an in-flight send alive; retire the oldest ones that are done."""
        self._sends.append(pending)
        while self._sends and self._sends[0].is_completed():
            self._sends.pop(0).wait()

    # -- instructions ----------------------------------------------------------------------
    def _cast_input(self, value: Any) -> Any:
        """Floating inputs of the first stage take the training dtype (fp16/bf16 runs)."""
        if self.compute_dtype == torch.float32:
            return value
        if isinstance(value, torch.Tensor):
            return value.to(self.compute_dtype) if value.is_floating_point() else value
        if isinstance(value, (tuple, list)):
            return type(value)(self._cast_input(v) for v in value)
        return value

    def _exec_load(self, ins: LoadMicroBatch) -> None:
        batch = self._next_batch()
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(f"LoadMicroBatch: each micro-batch must be (inputs, labels), got {type(batch)}")
        inputs, labels = batch
        if self._is_first_virtual(ins.chunk_id):
            self._inputs[ins.buffer_id] = self._cast_input(inputs)
        if self._is_last_virtual(ins.chunk_id):
            self._labels[ins.buffer_id] = labels

    def _timed(self, kind: str, chunk: int, fn: Callable[[int, int], None], b: int) -> None:
        if self.trace is None:
            fn(b, chunk)
            return
        start, cpu = time.perf_counter(), time.thread_time()
        fn(b, chunk)
        end, cpu = time.perf_counter(), time.thread_time() - cpu
        self.trace.append(ComputeSpan(kind, chunk, start, end, cpu))

    def _exec_forward(self, ins: ForwardPass) -> None:
        self._timed("F", ins.chunk_id, self._forward, ins.buffer_id)

    def _forward(self, b: int, chunk: int) -> None:
        inputs = self._inputs[b]
        if self._training and not self._is_first_virtual(chunk):
            # A received activation is a leaf that requires grad, which an in-place op (x.add_(..),
            # ReLU(inplace=True)) refuses; as DeepSpeed, the layers get a clone and the gradient
            # still reaches the leaf, which SendGrad reads.
            tensors, was_tuple = as_tensors(inputs, "ForwardPass")
            clones = tuple(t.clone() for t in tensors)
            inputs = clones if was_tuple else clones[0]
        outputs = self.module(inputs, chunk_id=chunk)
        if not self._is_last_virtual(chunk):
            self._outputs_buf[b] = outputs
            return
        if self._training or self._compute_loss:
            loss = self._loss(outputs, self._labels[b])
            self._losses.append(loss.detach())
            self._outputs_buf[b] = loss
        if not self._training:
            self._outputs.append(outputs)
            self._inputs.pop(b, None)
            self._labels.pop(b, None)

    def _loss(self, outputs: Any, labels: Any) -> torch.Tensor:
        """``loss_fn(outputs, labels)``; without a loss_fn the last layer's output is the loss
        (DeepSpeed's "models that return their loss from forward", e.g. labels carried along
        with the activations)."""
        fn = self.module.loss_fn
        loss = outputs if fn is None else fn(outputs, labels)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
            what = (
                f"tensor of shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
            source = (
                "the last layer's output (the PipelineModule has no loss_fn)" if fn is None else "loss_fn"
            )
            raise ValueError(
                f"PipelineEngine: {source} must be a one-element floating-point loss, got a {what}"
            )
        return loss

    def _exec_backward(self, ins: BackwardPass) -> None:
        self._timed("B", ins.chunk_id, self._backward, ins.buffer_id)

    def _backward(self, b: int, chunk: int) -> None:
        self.stage_optimizer.before_backward()
        if self._is_last_virtual(chunk):
            loss = self._outputs_buf.pop(b).float() / self._micro_batches
            self.loss_scaler.scale_loss(loss).backward()
        else:
            outs, _ = as_tensors(self._outputs_buf.pop(b), "BackwardPass")
            grads = self._grads.pop(b)
            floating = [o for o in outs if o.is_floating_point()]
            pairs = [(o, g) for o, g in zip(floating, grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], grad_tensors=[g for _, g in pairs])
        if self._is_first_virtual(chunk):
            self._inputs.pop(b, None)
        self._labels.pop(b, None)

    def _exec_send_act(self, ins: SendActivation) -> None:
        self._sent(self._channel(self._virtual(ins.chunk_id)).isend(self._outputs_buf[ins.buffer_id]))
        if not self._training:
            self._outputs_buf.pop(ins.buffer_id)

    def _exec_recv_act(self, ins: RecvActivation) -> None:
        value = self._received(lambda: self._channel(self._virtual(ins.chunk_id) - 1).irecv())
        if self._training:
            tensors, _ = as_tensors(value, "RecvActivation")
            for t in tensors:
                if t.is_floating_point():
                    t.requires_grad_(True)
        self._inputs[ins.buffer_id] = value

    def _exec_send_grad(self, ins: SendGrad) -> None:
        tensors, _ = as_tensors(self._inputs.pop(ins.buffer_id), "SendGrad")
        grads = [
            t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors if t.is_floating_point()
        ]
        boundary = self._virtual(ins.chunk_id) - 1
        self._sent(post_send(grads, self._stage_rank(boundary), grad_tag(boundary)))

    def _exec_recv_grad(self, ins: RecvGrad) -> None:
        def post() -> PendingRecv:
            outs, _ = as_tensors(self._outputs_buf[ins.buffer_id], "RecvGrad")
            metas = tuple(TensorMeta(tuple(o.shape), o.dtype) for o in outs if o.is_floating_point())
            v = self._virtual(ins.chunk_id)
            return post_recv(Payload(metas, True), self._stage_rank(v + 1), grad_tag(v))

        self._grads[ins.buffer_id] = list(self._received(post))

    def _exec_reduce_tied(self, ins: ReduceTiedGrads) -> None:
        self.at_boundary = True
        self.stage_optimizer.reduce_tied()

    def _exec_reduce_grads(self, ins: ReduceGrads) -> None:
        self.stage_optimizer.reduce_data_parallel()

    def _exec_optimizer_step(self, ins: OptimizerStep) -> None:
        self.stage_optimizer.step()
        self.at_boundary = False

    _INSTRUCTIONS = {
        LoadMicroBatch: _exec_load,
        ForwardPass: _exec_forward,
        BackwardPass: _exec_backward,
        SendActivation: _exec_send_act,
        RecvActivation: _exec_recv_act,
        SendGrad: _exec_send_grad,
        RecvGrad: _exec_recv_grad,
        ReduceTiedGrads: _exec_reduce_tied,
        ReduceGrads: _exec_reduce_grads,
        OptimizerStep: _exec_optimizer_step,
    }
