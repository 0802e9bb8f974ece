"""``PipelineEngine``: executes pipeline schedules on a :class:`PipelineModule`.

One ``train_batch`` runs ``gradient_accumulation_steps`` micro-batches through the 1F1B
schedule, averages the loss over them (each backward uses ``loss / micro_batches``), all-reduces
tied-weight gradients among the stages sharing them, averages gradients over the data-parallel
replicas of the stage, and steps the optimizer. The result matches one process training the
whole ``nn.Sequential`` on the whole batch with a mean loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

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
from zero_pipe.p2p import P2PChannel, TensorMeta, as_tensors, recv_grads, send_grads
from zero_pipe.schedule import InferenceSchedule, PipeSchedule, TrainSchedule


class PipelineConfigError(ValueError):
    """The configuration cannot drive a pipeline."""


def _batch_sizes(config: Mapping[str, Any], dp: int) -> tuple[int, int, int]:
    """Resolve (train_batch_size, micro batch, gradient accumulation) like DeepSpeed."""
    tb = config.get("train_batch_size")
    mb = config.get("train_micro_batch_size_per_gpu")
    gas = config.get("gradient_accumulation_steps")
    for name, val in (
        ("train_batch_size", tb),
        ("train_micro_batch_size_per_gpu", mb),
        ("gradient_accumulation_steps", gas),
    ):
        if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val < 1):
            raise PipelineConfigError(f"config: {name} must be an int >= 1, got {val!r}")
    if tb is not None and mb is not None and gas is not None:
        if tb != mb * gas * dp:
            raise PipelineConfigError(
                f"config: train_batch_size ({tb}) must equal train_micro_batch_size_per_gpu ({mb}) * "
                f"gradient_accumulation_steps ({gas}) * data-parallel size ({dp})"
            )
    elif tb is not None and mb is not None:
        if tb % (mb * dp):
            raise PipelineConfigError(
                f"config: train_batch_size ({tb}) is not divisible by micro batch {mb} * dp {dp}"
            )
        gas = tb // (mb * dp)
    elif tb is not None and gas is not None:
        if tb % (gas * dp):
            raise PipelineConfigError(
                f"config: train_batch_size ({tb}) is not divisible by gas {gas} * dp {dp}"
            )
        mb = tb // (gas * dp)
    elif mb is not None:
        gas = gas or 1
        tb = mb * gas * dp
    else:
        raise PipelineConfigError("config: give train_batch_size or train_micro_batch_size_per_gpu")
    return mb * gas * dp, mb, gas


class PipelineEngine:
    """Hybrid pipeline + data-parallel training of a :class:`PipelineModule`.

    ``config`` is a mapping with ``train_batch_size`` / ``train_micro_batch_size_per_gpu`` /
    ``gradient_accumulation_steps`` (the number of micro-batches per batch). Each ``data_iter``
    item is one micro-batch ``(inputs, labels)``; the first stage uses the inputs, the last
    stage the labels, so both should be given the same data.
    """

    def __init__(
        self,
        module: PipelineModule,
        optimizer: torch.optim.Optimizer,
        config: Mapping[str, Any],
        lr_scheduler: Any = None,
    ) -> None:
        if not isinstance(module, PipelineModule):
            raise TypeError(f"PipelineEngine: module must be a PipelineModule, got {type(module)}")
        if module.grid() is None:
            raise ValueError(
                "PipelineEngine: the PipelineModule was built without a process group; init one first"
            )
        if not isinstance(config, Mapping):
            raise TypeError(f"PipelineEngine: config must be a mapping, got {type(config)}")
        stage = (config.get("zero_optimization") or {}).get("stage", 0)
        if stage not in (0, 1):
            raise PipelineConfigError(
                f"config: zero_optimization.stage={stage} is not compatible with pipeline parallelism; use 0 or 1"
            )
        if module.loss_fn is None:
            raise ValueError("PipelineEngine: the PipelineModule needs a loss_fn to train")
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.grid = module.grid()
        self.stage_id = self.grid.stage_id
        self.num_stages = self.grid.pipe_parallel_size
        self.dp_size = self.grid.data_parallel_size
        self._config = dict(config)
        self._train_batch_size, self.micro_batch_size, self.micro_batches = _batch_sizes(config, self.dp_size)
        self.data_iterator: Iterator[Any] | None = None
        self.batch_fn: Callable[[Any], Any] | None = None
        self.global_steps = 0
        prev, nxt = self.grid.prev_stage_rank, self.grid.next_stage_rank
        self._act_in = P2PChannel(prev) if prev is not None else None
        self._act_out = P2PChannel(nxt) if nxt is not None else None
        self._at_boundary = False

    # -- public API ----------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self._train_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.micro_batches

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def is_gradient_accumulation_boundary(self) -> bool:
        return self._at_boundary

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
        if not isinstance(train_batch_size, int) or train_batch_size < 1 or train_batch_size % per_step:
            raise ValueError(
                f"set_train_batch_size: {train_batch_size!r} must be a positive multiple of micro batch "
                f"{self.micro_batch_size} * data-parallel size {self.dp_size}"
            )
        self.micro_batches = train_batch_size // per_step
        self._train_batch_size = train_batch_size

    def reset_activation_shape(self) -> None:
        """Forget cached activation shapes (call on every rank when they change)."""
        for ch in (self._act_in, self._act_out):
            if ch is not None:
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
        self._run(TrainSchedule(self.micro_batches, self.num_stages, self.stage_id), training=True)
        self.global_steps += 1
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
        mbs = self.micro_batches if num_micro_batches is None else num_micro_batches
        if not isinstance(mbs, int) or mbs < 1:
            raise ValueError(f"eval_batch: num_micro_batches must be an int >= 1, got {mbs!r}")
        saved = self.data_iterator
        self.data_iterator = data_iter
        self.module.eval()
        self._losses, self._outputs, self._compute_loss = [], [], compute_loss
        try:
            with torch.no_grad():
                self._run(InferenceSchedule(mbs, self.num_stages, self.stage_id), training=False)
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

    # -- execution -----------------------------------------------------------------------
    def _run(self, schedule: PipeSchedule, training: bool) -> None:
        self._training = training
        self._inputs: dict[int, Any] = {}
        self._labels: dict[int, Any] = {}
        self._outputs_buf: dict[int, Any] = {}
        self._grads: dict[int, list[torch.Tensor]] = {}
        self._at_boundary = False
        for step in schedule.steps():
            for ins in step:
                self._INSTRUCTIONS[type(ins)](self, ins)

    def _next_batch(self) -> Any:
        batch = next(self.data_iterator)
        return self.batch_fn(batch) if self.batch_fn is not None else batch

    def _exec_load(self, ins: LoadMicroBatch) -> None:
        batch = self._next_batch()
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(f"LoadMicroBatch: each micro-batch must be (inputs, labels), got {type(batch)}")
        inputs, labels = batch
        if self.is_first_stage():
            self._inputs[ins.buffer_id] = inputs
        if self.is_last_stage():
            self._labels[ins.buffer_id] = labels

    def _exec_forward(self, ins: ForwardPass) -> None:
        b = ins.buffer_id
        outputs = self.module(self._inputs[b])
        if not self.is_last_stage():
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
        b = ins.buffer_id
        if self.is_last_stage():
            (self._outputs_buf.pop(b) / self.micro_batches).backward()
        else:
            outs, _ = as_tensors(self._outputs_buf.pop(b), "BackwardPass")
            grads = self._grads.pop(b)
            pairs = [
                (o, g) for o, g in zip([o for o in outs if o.is_floating_point()], grads) if o.requires_grad
            ]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], grad_tensors=[g for _, g in pairs])
        if self.is_first_stage():
            self._inputs.pop(b, None)
        self._labels.pop(b, None)

    def _exec_send_act(self, ins: SendActivation) -> None:
        out = self._outputs_buf[ins.buffer_id]
        self._act_out.send(out)
        if not self._training:
            self._outputs_buf.pop(ins.buffer_id)

    def _exec_recv_act(self, ins: RecvActivation) -> None:
        value = self._act_in.recv()
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
        send_grads(grads, self.grid.prev_stage_rank)

    def _exec_recv_grad(self, ins: RecvGrad) -> None:
        outs, _ = as_tensors(self._outputs_buf[ins.buffer_id], "RecvGrad")
        metas = [TensorMeta(tuple(o.shape), o.dtype) for o in outs if o.is_floating_point()]
        self._grads[ins.buffer_id] = recv_grads(metas, self.grid.next_stage_rank)

    def _exec_reduce_tied(self, ins: ReduceTiedGrads) -> None:
        self._at_boundary = True
        self.module.allreduce_tied_weight_gradients()

    def _exec_reduce_grads(self, ins: ReduceGrads) -> None:
        """Average gradients over the stage's data-parallel replicas in one flat all-reduce."""
        if self.dp_size == 1:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        _dist.all_reduce(flat, group=self.grid.dp_group)
        flat.div_(self.dp_size)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def _exec_optimizer_step(self, ins: OptimizerStep) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
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
        loss = torch.zeros(())
        if self.is_last_stage():
            loss = torch.stack([x.float() for x in losses]).mean()
            if self.dp_size > 1:
                _dist.all_reduce(loss, group=self.grid.dp_group)
                loss /= self.dp_size
        if bcast and self.num_stages > 1:
            _dist.broadcast(loss, self.grid.stage_to_global(self.num_stages - 1), group=self.grid.pp_group)
        return loss
