"""ZeRO stage 0: plain data parallelism with optional fp32 master weights.

Every rank holds the whole model and optimizer. Gradients are averaged with the bucketed,
overlapped all-reduce of ``grad_buckets.py``. With fp16/bf16 the module's parameters are
low precision and the optimizer steps fp32 master copies (the client optimizer's
``param_groups`` are rebound to them), then the result is copied back. See
[Note: engine strategies] in ``strategy.py``. An optimizer that does its own data-parallel
communication (1-bit Adam and its kin in zero-ops, see [Note: communication-compressed
optimizers] in ``zero_ops/onebit/base.py``) is bound to the group, and the gradients are
all-reduced here only for the steps where its ``communicates_gradients()`` says False. Embedding gradients that are sparse (or, with
``sparse_gradients``, dense embedding gradients) are reduced as rows instead (see
[Note: sparse gradient reduction] in ``sparse_grads.py``); with a wider
``data_types.grad_accum_dtype`` the micro-step gradients are summed in it (see
[Note: gradient accumulation dtype] in ``grad_buckets.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from zero_core import comm
from zero_core.engine.grad_buckets import BucketedAllReduce
from zero_core.engine.sparse_grads import SparseGradReducer, sparse_gradient_params
from zero_core.utils.grad_norm import any_nonfinite, needs_scaling, sum_of_squares
from zero_core.utils.param_groups import reduction_groups
from zero_core.utils.storage_bytes import StorageLedger
from zero_core.zero.param_owners import register_owner, release_owner

if TYPE_CHECKING:
    from zero_core.checkpoint.fragments import CheckpointReader
    from zero_core.engine.loss_scaler import LossScaler
    from zero_core.engine.strategy_factory import DataParallelOptions


class DataParallelStrategy:
    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        options: DataParallelOptions,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.group = group
        self.params = [p for p in module.parameters() if p.requires_grad]
        dp_world = comm.get_world_size(group)
        self.accum_dtype = options.accum_dtype
        native = sparse_gradient_params(
            module, options.sparse_gradients
        )  # See [Note: sparse gradient reduction]
        self.reducers = [
            BucketedAllReduce(
                [p for p in params if id(p) not in native],
                options.bucket_numel,
                group=reduce_group,
                overlap=options.overlap_comm,
                comm_dtype=options.comm_dtype,
                predivide_factor=options.predivide_factor,
                divisor=dp_world,
                prescale=options.prescale,
                accum_dtype=options.accum_dtype,
            )
            for reduce_group, params in reduction_groups(self.params, group)
        ]
        self.sparse = [
            SparseGradReducer(
                sparse,
                native,
                group=reduce_group,
                divisor=dp_world,
                comm_dtype=options.comm_dtype,
                accum_dtype=options.accum_dtype,
            )
            for reduce_group, params in reduction_groups(self.params, group)
            if (sparse := [p for p in params if id(p) in native])
        ]
        self._reducer_of = {id(p): r for r in self.reducers for b in r.buckets for p in b.params}
        self._sparse_of = {id(p): r for r in self.sparse for p in r.params}
        # model param -> fp32 master param (only with mixed precision)
        self.master: dict[torch.nn.Parameter, torch.nn.Parameter] = {}
        if options.master_weights:
            self._rebind_to_masters()
        self._communicates = getattr(optimizer, "communicates_gradients", None)
        if self._communicates is not None and (options.accum_dtype is not None or self.sparse):
            raise ValueError(
                f"{type(optimizer).__name__} exchanges gradients itself: data_types.grad_accum_dtype wider than "
                "the training dtype and sparse embedding gradients are not supported with it"
            )
        if self._communicates is not None:
            if len(self.reducers) > 1:
                raise ValueError(
                    f"{type(optimizer).__name__} exchanges the whole model over the data-parallel group; "
                    "expert-parallel (MoE) parameters, reduced over other groups, are not supported with it"
                )
            optimizer.bind_data_parallel(group)
        self._dense_this_boundary = True
        self.loss_scaler: LossScaler | None = None  # see bind_loss_scaler
        from zero_core.engine.data_parallel_access import DataParallelStateAccess

        # See [Note: parameter owners] (zero/param_owners.py); released by close()
        self._state_access = DataParallelStateAccess(self)
        register_owner(self.params, self._state_access)

    def bind_loss_scaler(self, loss_scaler: LossScaler | None) -> None:
        """The engine's loss scaler: the safe_get gradient helpers report unscaled gradients."""
        self.loss_scaler = loss_scaler

    def close(self) -> None:
        """Forget the parameters' owner entries (See [Note: parameter owners]); the engine's
        ``destroy()`` calls it."""
        release_owner(self.params, self._state_access)

    def _rebind_to_masters(self) -> None:
        for group in self.optimizer.param_groups:
            masters = []
            for p in group["params"]:
                if p not in self.master:
                    m = torch.nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad)
                    self.master[p] = m
                masters.append(self.master[p])
            group["params"] = masters

    # -- TrainingStrategy --------------------------------------------------------------
    def before_backward(self, is_boundary: bool) -> None:
        if is_boundary:
            # the optimizer's next step may exchange (compressed) data itself: gradients stay local
            self._dense_this_boundary = self._communicates is None or not self._communicates()
            if self._dense_this_boundary:
                for r in self.reducers:
                    r.arm()

    def after_backward(self, is_boundary: bool) -> None:
        for s in self.sparse:
            s.accumulate()
        if is_boundary and self._dense_this_boundary:
            for r in self.reducers:
                r.finish()
            for s in self.sparse:
                s.reduce()

    def grad_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """``p``'s gradient as the step reads it: ``p.grad``, or the wide sum of
        [Note: gradient accumulation dtype] (reduced on a boundary)."""
        if id(p) in self._sparse_of:
            return self._sparse_of[id(p)].grad_of(p)
        if self.accum_dtype is not None and id(p) in self._reducer_of:
            return self._reducer_of[id(p)].accumulated_grad(p)
        return p.grad

    def set_grad(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Overwrite ``p``'s gradient as the step reads it (``safe_set_full_grad``)."""
        g = self.grad_of(p)
        if g is not None and not g.is_sparse and (self.accum_dtype is not None or id(p) in self._sparse_of):
            g.copy_(value.reshape(g.shape))
        else:
            p.grad = value.reshape(p.shape).to(p.dtype)

    def _grads(self) -> list[torch.Tensor]:
        """Every gradient, dense: a sparse one (coalesced after its reduction) as its row values."""
        grads = [self.grad_of(p) for p in self.params]
        return [g.coalesce().values() if g.is_sparse else g for g in grads if g is not None]

    def local_overflow(self) -> torch.Tensor:
        """A device flag (0-dim bool): does any gradient hold an inf or a NaN?"""
        return any_nonfinite(self._grads())

    def grad_norm_sq(self) -> torch.Tensor:
        # fused, in fp32, on the device: See [Note: scalars stay on the device in the step]
        return sum_of_squares(self._grads())

    def norm_group(self) -> dist.ProcessGroup | None:
        return None

    @torch.no_grad()
    def step(self, grad_scale: float | torch.Tensor) -> None:
        if self.master:
            for p, m in self.master.items():
                g = self.grad_of(p)
                m.grad = None if g is None else g.float().mul_(grad_scale)
            self.optimizer.step()
            for p, m in self.master.items():
                p.copy_(m)
        else:
            if needs_scaling(grad_scale):
                for g in self._grads():
                    g.mul_(grad_scale)
            self.optimizer.step()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.master.values():
            m.grad = None
        for r in self.reducers:
            r.zero_grad()
        for s in self.sparse:
            s.zero_grad()

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of distinct live storages by category. Reduced gradients are views into the
        bucket buffers: a buffer counts once, under gradients while gradients live in it, and
        under buffers otherwise. See [Note: memory breakdown counts storages]."""
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        ledger = StorageLedger()
        ledger.add("parameters", self.module.parameters())
        grads = [g for g in map(self.grad_of, self.params) if g is not None]
        ledger.add(
            "gradients", (t for g in grads for t in ((g._indices(), g._values()) if g.is_sparse else (g,)))
        )
        ledger.add("gradients", (m.grad for m in self.master.values()))  # fp32, during the step
        ledger.add("master_weights", self.master.values())
        ledger.add("optimizer_states", state)
        ledger.add("buffers", (b.buffer for r in self.reducers for b in r.buckets))
        return ledger.categories

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "master": [m.detach() for m in self.master.values()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for m, saved in zip(self.master.values(), state.get("master", [])):
                m.copy_(saved)

    # -- checkpointing (see [Note: checkpoint format] in zero_core/checkpoint/format.py) --
    def checkpoint_fragments(self, exclude_frozen_parameters: bool = False) -> list[Any]:
        from zero_core import comm
        from zero_core.checkpoint.rank_local import rank_local_fragments
        from zero_core.checkpoint.replicated import replicated_fragments

        rank = comm.get_rank(self.group) if comm.is_initialized() else 0
        return replicated_fragments(
            self.module,
            self.optimizer,
            self.master,
            rank=rank,
            exclude_frozen_parameters=exclude_frozen_parameters,
        ) + rank_local_fragments(self.optimizer, rank)

    def load_checkpoint_fragments(
        self,
        reader: CheckpointReader,
        *,
        load_optimizer_states: bool = True,
        load_module_only: bool = False,
        strict: bool = True,
    ) -> None:
        from zero_core.checkpoint.replicated import load_replicated

        load_replicated(
            reader,
            self.module,
            self.optimizer,
            self.master,
            load_optimizer_states=load_optimizer_states,
            load_module_only=load_module_only,
            strict=strict,
        )
        if (
            load_optimizer_states
            and not load_module_only
            and hasattr(self.optimizer, "load_rank_local_state")
        ):
            from zero_core.checkpoint.rank_local import read_rank_local

            on = comm.is_initialized()
            rank, world = (comm.get_rank(self.group), comm.get_world_size(self.group)) if on else (0, 1)
            self._pending_rank_local = read_rank_local(reader, rank, world)

    @torch.no_grad()
    def after_checkpoint_load(self) -> None:
        """Hand the optimizer its rank-local state; see [Note: rank-local optimizer state]."""
        pending, self._pending_rank_local = getattr(self, "_pending_rank_local", None), None
        if pending is None:
            return
        self.optimizer.load_rank_local_state(*pending)
        for p, m in self.master.items():  # 0/1 Adam's local parameters may have changed the masters
            p.copy_(m)
