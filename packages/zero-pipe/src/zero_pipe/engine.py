"""``PipelineEngine``: executes pipeline schedules on a :class:`PipelineModule`.

One ``train_batch`` runs ``gradient_accumulation_steps`` micro-batches through the 1F1B
schedule (the interleaved one when the module holds several chunks, see [Note: model chunks]),
averages the loss over them (each backward uses ``loss / micro_batches``), then reduces,
clips and applies the gradients (see [Note: pipeline gradient reduction]). The result matches
one process training the whole ``nn.Sequential`` on the whole batch with a mean loss.

Activations move between *virtual* stages ``v -> v + 1`` (``v = chunk * stages + stage``); each
boundary has its own :class:`P2PChannel` (and tags), so every boundary keeps its own cached shapes.

[Note: receive prefetch]
Sends are asynchronous and receives are posted ahead of the instruction that consumes them (see
[Note: asynchronous p2p] in ``p2p.py``): when a batch starts, the first receive of every stream
(activations of a chunk, gradients of a chunk) whose shapes are known is posted, and whenever a
receive completes the next one of the same stream is posted. The data of micro-batch ``i + 1``
thus flows while micro-batch ``i`` computes. This keeps the deadlock-freedom of the compiled
order (see [Note: deadlock-free pipeline communication]): a posted receive or a send never
blocks, and every blocking wait is for a message its peer sends no later than in the
rendezvous order, so the waits-for graph stays a subgraph of an acyclic one. All sends of a
batch are waited on before ``train_batch``/``eval_batch`` return.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from zero_core.config import ZeroConfig, load_config
from zero_core.engine.loss_scaler import LossScaler, build_loss_scaler

from zero_pipe import _dist
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
from zero_pipe.optimizer_step import PipelineConfigError, StageOptimizer, build_strategy, check_zero_stage
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
from zero_pipe.schedule import (
    InferenceSchedule,
    InterleavedInferenceSchedule,
    InterleavedTrainSchedule,
    PipeSchedule,
    TrainSchedule,
)

__all__ = ["ComputeSpan", "PipelineConfigError", "PipelineEngine"]


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


_Compiled = tuple[list[Any], dict[int, int], list[int]]


def _dtype_of(cfg: ZeroConfig) -> torch.dtype:
    if cfg.fp16.enabled:
        return torch.float16
    return torch.bfloat16 if cfg.bf16.enabled else torch.float32


class PipelineEngine:
    """Hybrid pipeline + data-parallel training of a :class:`PipelineModule`.

    ``config`` is a DeepSpeed-format mapping or a parsed ``ZeroConfig``: the batch triple
    (``gradient_accumulation_steps`` is the number of micro-batches per batch),
    ``zero_optimization.stage`` (0 or 1), ``fp16``/``bf16``, ``gradient_clipping``. Each
    ``data_iter`` item is one micro-batch ``(inputs, labels)``; the first stage uses the inputs,
    the last stage the labels, so both should be given the same data. ``has_bool_tensors`` is
    accepted for DeepSpeed compatibility: bool activations are always supported.
    """

    def __init__(
        self,
        module: PipelineModule,
        optimizer: torch.optim.Optimizer,
        config: Mapping[str, Any] | ZeroConfig,
        lr_scheduler: Any = None,
        *,
        has_bool_tensors: bool = False,
        loss_scaler: LossScaler | None = None,
    ) -> None:
        if not isinstance(module, PipelineModule):
            raise TypeError(f"PipelineEngine: module must be a PipelineModule, got {type(module)}")
        if module.grid() is None:
            raise ValueError(
                "PipelineEngine: the PipelineModule was built without a process group; init one first"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"PipelineEngine: optimizer must be a torch.optim.Optimizer, got {type(optimizer)}"
            )
        if not isinstance(has_bool_tensors, bool):
            raise TypeError(f"PipelineEngine: has_bool_tensors must be a bool, got {has_bool_tensors!r}")
        if module.loss_fn is None:
            raise ValueError("PipelineEngine: the PipelineModule needs a loss_fn to train")
        self.module = module
        self.grid = module.grid()
        self.stage_id = self.grid.stage_id
        self.num_stages = self.grid.pipe_parallel_size
        self.num_chunks = module.num_chunks
        self.dp_size = self.grid.data_parallel_size
        self.has_bool_tensors = has_bool_tensors
        self.config = self._load_config(config)
        check_zero_stage(self.config.zero_optimization.stage)
        self.micro_batch_size = int(self.config.train_micro_batch_size_per_gpu)
        self.micro_batches = int(self.config.gradient_accumulation_steps)
        self._train_batch_size = self.micro_batch_size * self.micro_batches * self.dp_size
        self.compute_dtype = _dtype_of(self.config)
        self.strategy = build_strategy(
            module,
            optimizer,
            zero_stage=int(self.config.zero_optimization.stage),
            dtype=self.compute_dtype,
            dp_group=self.grid.dp_group,
            zero_section=self.config.zero_optimization,
        )
        self.loss_scaler = loss_scaler or build_loss_scaler(self.config.fp16.enabled, self.config.fp16)
        self.stage_optimizer = StageOptimizer(
            self.strategy,
            module,
            self.grid,
            loss_scaler=self.loss_scaler,
            gradient_clipping=float(self.config.gradient_clipping or 0.0),
            lr_scheduler=lr_scheduler,
        )
        self.data_iterator: Iterator[Any] | None = None
        self.batch_fn: Callable[[Any], Any] | None = None
        self.global_steps = 0
        self.global_samples = 0
        self._at_boundary = False
        self._channels: dict[int, P2PChannel] = {}
        self._compiled: dict[tuple, _Compiled] = {}
        self._posted: dict[int, PendingRecv] = {}
        self._sends: list[PendingSend] = []
        #: when a list, ``train_batch``/``eval_batch`` append one :class:`ComputeSpan` per forward,
        #: backward and receive wait
        self.trace: list[ComputeSpan] | None = None

    def _load_config(self, config: Mapping[str, Any] | ZeroConfig) -> ZeroConfig:
        source = f"pipeline data-parallel size (world / {self.num_stages} stages)"
        if isinstance(config, ZeroConfig):
            sizes = config.batch_sizes
            if sizes is not None and sizes.world_size != self.dp_size:
                # Resolved for another world size: keep the micro batch and the number of micro-batches.
                config = config.model_copy(update={"train_batch_size": None})
            return config.with_batch_sizes(self.dp_size, source)
        if not isinstance(config, Mapping):
            raise TypeError(f"PipelineEngine: config must be a mapping or a ZeroConfig, got {type(config)}")
        stage = (config.get("zero_optimization") or {}).get("stage", 0)
        check_zero_stage(stage)  # before load_config, for the pipeline-specific message
        raw = dict(config)
        raw.setdefault("gradient_clipping", 0.0)  # a plain dict means no clipping unless asked
        return load_config(raw, world_size=self.dp_size, world_size_source=source)

    # -- public API ----------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.strategy.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self.stage_optimizer.lr_scheduler

    def train_batch_size(self) -> int:
        return self._train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.micro_batches

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def is_gradient_accumulation_boundary(self) -> bool:
        return self._at_boundary

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (all stages) of the last step, before clipping."""
        return self.stage_optimizer.global_grad_norm

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held on this rank by category, measured from live tensors."""
        return self.strategy.memory_breakdown()

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        if not hasattr(iterator, "__next__"):
            raise TypeError(f"set_dataiterator: expected an iterator, got {type(iterator)}")
        self.data_iterator = iterator

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"set_batch_fn: fn must be callable, got {fn!r}")
        self.batch_fn = fn

    def set_train_batch_size(self, train_batch_size: int) -> None:
        per_step = self.micro_batch_size * self.dp_size
        if (
            not isinstance(train_batch_size, int)
            or isinstance(train_batch_size, bool)
            or train_batch_size < 1
            or train_batch_size % per_step
        ):
            raise ValueError(
                f"set_train_batch_size: {train_batch_size!r} must be a positive multiple of micro batch "
                f"{self.micro_batch_size} * data-parallel size {self.dp_size}"
            )
        self.micro_batches = train_batch_size // per_step
        self._train_batch_size = train_batch_size

    def reset_activation_shape(self) -> None:
        """Forget cached activation shapes (call on every rank when they change)."""
        for ch in self._channels.values():
            ch.reset()

    def forward(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "PipelineEngine: forward() is disabled for pipeline parallelism; use train_batch()"
        )

    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "PipelineEngine: backward() is disabled for pipeline parallelism; use train_batch()"
        )

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("PipelineEngine: step() is disabled for pipeline parallelism; use train_batch()")

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on one batch; returns the mean loss over micro-batches (and data-parallel replicas)."""
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        if self.data_iterator is None and (self.is_first_stage() or self.is_last_stage()):
            raise ValueError("train_batch: no data iterator; pass data_iter or call set_dataiterator()")
        self.module.train()
        self._losses: list[torch.Tensor] = []
        if self.num_chunks > 1:
            schedule: PipeSchedule = InterleavedTrainSchedule(
                self.micro_batches, self.num_stages, self.stage_id, chunks=self.num_chunks
            )
        else:
            schedule = TrainSchedule(self.micro_batches, self.num_stages, self.stage_id)
        self._run(schedule, training=True)
        self.global_steps += 1
        self.global_samples += self._train_batch_size
        return self._aggregate_loss(self._losses, reduce_output="avg", bcast=True)

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward ``num_micro_batches`` (default: gradient accumulation steps) micro-batches
        without gradients; returns the loss (and the last stage's outputs with return_logits)."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch: reduce_output must be 'avg' or None, got {reduce_output!r}")
        if not hasattr(data_iter, "__next__"):
            raise TypeError(f"eval_batch: data_iter must be an iterator, got {type(data_iter)}")
        mbs = self.micro_batches if num_micro_batches is None else num_micro_batches
        if not isinstance(mbs, int) or isinstance(mbs, bool) or mbs < 1:
            raise ValueError(f"eval_batch: num_micro_batches must be an int >= 1, got {mbs!r}")
        saved = self.data_iterator
        self.data_iterator = data_iter
        self.module.eval()
        self._losses, self._outputs, self._compute_loss = [], [], compute_loss
        if self.num_chunks > 1:
            schedule: PipeSchedule = InterleavedInferenceSchedule(
                mbs, self.num_stages, self.stage_id, chunks=self.num_chunks
            )
        else:
            schedule = InferenceSchedule(mbs, self.num_stages, self.stage_id)
        try:
            with torch.no_grad():
                self._run(schedule, training=False)
        finally:
            self.data_iterator = saved
        result: Any
        if compute_loss:
            result = self._aggregate_loss(self._losses, reduce_output, bcast_loss)
        else:
            result = self._outputs if self.is_last_stage() else None
        if return_logits:
            return result, (self._outputs if self.is_last_stage() else None)
        return result

    def save_checkpoint(
        self, save_dir: str, tag: Any = None, client_state: dict | None = None, save_latest: bool = True
    ) -> str:
        """Save layers, optimizer, scheduler, loss scaler and counters (call on every rank).
        See [Note: per-layer pipeline checkpoints]."""
        from zero_pipe.checkpoint import save_engine_checkpoint

        return save_engine_checkpoint(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict]:
        """Load a checkpoint of :meth:`save_checkpoint`; returns ``(path, client_state)``."""
        from zero_pipe.checkpoint import load_engine_checkpoint

        return load_engine_checkpoint(
            self,
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
        )

    # -- execution -----------------------------------------------------------------------
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
            ch = self._channels[boundary] = P2PChannel(self._stage_rank(peer), activation_tag(boundary))
        return ch

    def _compile(self, schedule: PipeSchedule) -> _Compiled:
        """The flat instruction stream of ``schedule``, and for prefetching: the index of the next
        receive of the same stream after each receive, and the first receive of every stream.
        Cached: a schedule depends only on its class, sizes and stage."""
        key = (type(schedule), schedule.micro_batches, schedule.stages, schedule.stage_id, schedule.chunks)
        hit = self._compiled.get(key)
        if hit is not None:
            return hit
        stream = [ins for step in schedule.steps() for ins in step]
        next_same: dict[int, int] = {}
        last: dict[tuple[type, int], int] = {}
        first: list[int] = []
        for i, ins in enumerate(stream):
            if isinstance(ins, (RecvActivation, RecvGrad)):
                k = (type(ins), ins.chunk_id)
                if k in last:
                    next_same[last[k]] = i
                else:
                    first.append(i)
                last[k] = i
        self._compiled[key] = (stream, next_same, first)
        return self._compiled[key]

    def _run(self, schedule: PipeSchedule, training: bool) -> None:
        self._training = training
        self._inputs: dict[int, Any] = {}
        self._labels: dict[int, Any] = {}
        self._outputs_buf: dict[int, Any] = {}
        self._grads: dict[int, list[torch.Tensor]] = {}
        self._at_boundary = False
        stream, self._next_same, first = self._compile(schedule)
        self._stream = stream
        self._posted = {}
        self._sends = []
        for i in first:  # See [Note: receive prefetch]
            self._prefetch(i)
        for i, ins in enumerate(stream):
            self._pc = i
            self._INSTRUCTIONS[type(ins)](self, ins)
        for pending in self._sends:
            pending.wait()
        self._sends = []

    def _recv_source(self, ins: Any) -> tuple[Payload | None, int, int]:
        """(payload if known, peer rank, tag) of a RecvActivation/RecvGrad instruction."""
        v = self._virtual(ins.chunk_id)
        if isinstance(ins, RecvActivation):
            ch = self._channel(v - 1)
            return ch.payload, ch.peer, ch.tag
        sent = self._channel(v).payload  # gradients have the shapes of the activations we sent
        payload = None if sent is None else Payload(sent.floating(), True)
        return payload, self._stage_rank(v + 1), grad_tag(v)

    def _prefetch(self, index: int | None) -> None:
        """Post the receive of instruction ``index`` now, if its shapes are known."""
        if index is None or index in self._posted:
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
            self.trace.append(
                ComputeSpan(
                    "W", self._stream[self._pc].chunk_id, start, time.perf_counter(), time.thread_time() - cpu
                )
            )
        self._prefetch(self._next_same.get(self._pc))
        return value

    def _sent(self, pending: PendingSend) -> None:
        """Keep an in-flight send alive; retire the oldest ones that are done."""
        self._sends.append(pending)
        while self._sends and self._sends[0].is_completed():
            self._sends.pop(0).wait()

    def _next_batch(self) -> Any:
        batch = next(self.data_iterator)
        return self.batch_fn(batch) if self.batch_fn is not None else batch

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

    def _timed(self, kind: str, chunk: int, fn: Callable[[], None]) -> None:
        if self.trace is None:
            fn()
            return
        start, cpu = time.perf_counter(), time.thread_time()
        fn()
        self.trace.append(ComputeSpan(kind, chunk, start, time.perf_counter(), time.thread_time() - cpu))

    def _exec_forward(self, ins: ForwardPass) -> None:
        self._timed("F", ins.chunk_id, lambda: self._forward(ins.buffer_id, ins.chunk_id))

    def _forward(self, b: int, chunk: int) -> None:
        outputs = self.module(self._inputs[b], chunk_id=chunk)
        if not self._is_last_virtual(chunk):
            self._outputs_buf[b] = outputs
            return
        if self._training or self._compute_loss:
            loss = self.module.loss_fn(outputs, self._labels[b])
            self._losses.append(loss.detach())
            self._outputs_buf[b] = loss
        if not self._training:
            self._outputs.append(outputs)
            self._inputs.pop(b, None)
            self._labels.pop(b, None)

    def _exec_backward(self, ins: BackwardPass) -> None:
        self._timed("B", ins.chunk_id, lambda: self._backward(ins.buffer_id, ins.chunk_id))

    def _backward(self, b: int, chunk: int) -> None:
        self.stage_optimizer.before_backward()
        if self._is_last_virtual(chunk):
            loss = self._outputs_buf.pop(b).float() / self.micro_batches
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
        self._at_boundary = True
        self.stage_optimizer.reduce_tied()

    def _exec_reduce_grads(self, ins: ReduceGrads) -> None:
        self.stage_optimizer.reduce_data_parallel()

    def _exec_optimizer_step(self, ins: OptimizerStep) -> None:
        self.stage_optimizer.step()
        self._at_boundary = False

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

    def _aggregate_loss(self, losses: list[torch.Tensor], reduce_output: str | None, bcast: bool) -> Any:
        """Mean over micro-batches and data-parallel replicas on the last stage, then
        broadcast to every stage of the pipeline (when ``bcast``)."""
        if reduce_output is None:
            return losses if self.is_last_stage() else None
        loss = torch.zeros((), dtype=torch.float32)
        if self.is_last_stage():
            loss = torch.stack([x.float() for x in losses]).mean()
            if self.dp_size > 1:
                _dist.all_reduce(loss, group=self.grid.dp_group)
                loss /= self.dp_size
        if bcast and self.num_stages > 1:
            _dist.broadcast(loss, self.grid.stage_to_global(self.num_stages - 1), group=self.grid.pp_group)
        return loss
