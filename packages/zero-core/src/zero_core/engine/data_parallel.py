"""ZeRO stage 0: plain data parallelism with optional fp32 master weights.

Every rank holds the whole model and optimizer. Gradients are averaged with the bucketed,
overlapped all-reduce of ``grad_buckets.py``. With fp16/bf16 the module's parameters are
low precision and the optimizer steps fp32 master copies (the client optimizer's
``param_groups`` are rebound to them), then the result is copied back. See
[Note: engine strategies] in ``strategy.py``. An optimizer that does its own data-parallel
communication (1-bit Adam and its kin, see [Note: communication-compressed optimizers]) is
bound to the group, and the gradients are all-reduced here only for the steps where its
``communicates_gradients()`` says False.
"""

from __future__ import annotations

from typing import Any

import torch

from zero_core import comm
from zero_core.engine.grad_buckets import BucketedAllReduce
from zero_core.utils.grad_norm import any_nonfinite, needs_scaling, sum_of_squares
from zero_core.utils.param_groups import reduction_groups
from zero_core.utils.storage_bytes import StorageLedger
from zero_core.zero.param_owners import PARAM_OWNERS


class DataParallelStrategy:
    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        group: Any = None,
        bucket_numel: int = 500_000_000,
        overlap_comm: bool = True,
        comm_dtype: torch.dtype | None = None,
        predivide_factor: float = 1.0,
        master_weights: bool = False,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.group = group
        self.params = [p for p in module.parameters() if p.requires_grad]
        dp_world = comm.get_world_size(group)
        self.reducers = [
            BucketedAllReduce(
                params,
                bucket_numel,
                group=reduce_group,
                overlap=overlap_comm,
                comm_dtype=comm_dtype,
                predivide_factor=predivide_factor,
                divisor=dp_world,
            )
            for reduce_group, params in reduction_groups(self.params, group)
        ]
        # model param -> fp32 master param (only with mixed precision)
        self.master: dict[torch.nn.Parameter, torch.nn.Parameter] = {}
        if master_weights:
            self._rebind_to_masters()
        self._communicates = getattr(optimizer, "communicates_gradients", None)
        if self._communicates is not None:
            if len(self.reducers) > 1:
                raise ValueError(
                    f"{type(optimizer).__name__} exchanges the whole model over the data-parallel group; "
                    "expert-parallel (MoE) parameters, reduced over other groups, are not supported with it"
                )
            optimizer.bind_data_parallel(group)
        self._dense_this_boundary = True
        self.loss_scaler: Any = None  # see bind_loss_scaler
        from zero_core.engine.data_parallel_access import DataParallelStateAccess

        # See [Note: parameter owner registry] (zero/param_owners.py); released by close()
        self._state_access = DataParallelStateAccess(self)
        PARAM_OWNERS.register(self.params, self._state_access)

    def bind_loss_scaler(self, loss_scaler: Any) -> None:
        """The engine's loss scaler: the safe_get gradient helpers report unscaled gradients."""
        self.loss_scaler = loss_scaler

    def close(self) -> None:
        """Forget the parameters' owner entries (See [Note: parameter owner registry]); the engine's
        ``destroy()`` calls it."""
        PARAM_OWNERS.release(self.params, self._state_access)

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
        if is_boundary and self._dense_this_boundary:
            for r in self.reducers:
                r.finish()

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def local_overflow(self) -> torch.Tensor:
        """A device flag (0-dim bool): does any gradient hold an inf or a NaN?"""
        return any_nonfinite(self._grads())

    def grad_norm_sq(self) -> torch.Tensor:
        # fused, in fp32, on the device: See [Note: scalars stay on the device in the step]
        return sum_of_squares(self._grads())

    def norm_group(self) -> Any:
        return None

    @torch.no_grad()
    def step(self, grad_scale: float | torch.Tensor) -> None:
        if self.master:
            for p, m in self.master.items():
                m.grad = None if p.grad is None else p.grad.float().mul_(grad_scale)
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

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of distinct live storages by category. Reduced gradients are views into the
        bucket buffers: a buffer counts once, under gradients while gradients live in it, and
        under buffers otherwise. See [Note: memory breakdown counts storages]."""
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        ledger = StorageLedger()
        ledger.add("parameters", self.module.parameters())
        ledger.add("gradients", (p.grad for p in self.params))
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
        reader: Any,
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
