"""Stage-3 side of the ``safe_get_*`` / ``safe_set_*`` debugging helpers.

The full-form helpers (``safe_get_full_fp32_param`` ...) live in ``zero/debug_access.py`` and
dispatch through the parameter's registered owner (see [Note: safe_get owner protocol]); the stage-3
strategy makes a :class:`Stage3StateAccess` the owner of each of its parameters. The
local-form helpers (``safe_get_local_*`` / ``safe_set_local_*``) exist only for stage 3,
where a parameter has a local partition: they are defined here and dispatch through the same
owner. Local values are this rank's partition as 1-D fp32 tensors of ``param.zero_shard``'s
length (the padded shard: the last rank's tail beyond the parameter's end is padding).

Semantics per DeepSpeed's debugging-API docs: getters of the full form are collective (every rank of the
data-parallel group calls them with the same parameter, in the same order); local getters
and all setters are not. Gradients are valid after ``engine.backward`` (reduced, averaged,
still multiplied by the fp16 loss scale) until ``engine.step``; fp32 values and optimizer
states change at ``engine.step``. A setter writes the fp32 master and the 16-bit shard; a
parameter gathered at that moment (a persistent one) shows the new value in forward after the
next optimizer step or ``engine.empty_partition_cache()``, except that ``safe_set_full_*``
also updates the gathered copy directly (every rank passes the whole value).
"""

from __future__ import annotations

import datetime
from typing import Any, Protocol

import torch

from zero_core import comm
from zero_core.protocols.optimizer_offload import OptimizerOffload
from zero_core.zero.stage3.param_records import partition_state
from zero_core.zero.stage3.partitioned_param import (
    ParamStatus,
    collective_timeout,
    param_name,
    read_shard,
    shares_shard,
    write_shard,
)


class Stage3Masters(Protocol):
    """What :class:`Stage3StateAccess` needs of the stage-3 strategy: its fp32 masters (wherever
    they live, offloaded ones included), its optimizer states, and the end of its gradient
    reductions. The strategy satisfies it; naming it here, instead of importing the strategy,
    keeps this module below ``strategy.py`` (no import cycle)."""

    master: dict[int, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    offload: OptimizerOffload

    def wait_reductions(self) -> None: ...

    def _master_value(self, m: torch.Tensor) -> torch.Tensor: ...

    def _set_master_value(self, m: torch.Tensor, values: torch.Tensor) -> None: ...

    def _optimizer_state(self, m: torch.Tensor) -> dict[str, Any]: ...


class Stage3StateAccess:
    """The owner object of [Note: safe_get owner protocol] for stage-3 parameters."""

    def __init__(self, strategy: Stage3Masters) -> None:
        self.strategy = strategy

    # -- helpers --------------------------------------------------------------------------
    def _gather(self, p: torch.nn.Parameter, shard: torch.Tensor) -> torch.Tensor:
        """All-gather a per-rank 1-D tensor of shard length into the parameter's full shape."""
        st = partition_state(p)
        shard = shard.detach().float().contiguous()
        if st.world == 1:
            full = shard.clone()
        else:
            full = torch.empty(st.padded_numel, dtype=torch.float32, device=shard.device)
            work = comm.all_gather_into_tensor(full, shard, group=st.group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=collective_timeout()))
        return full[: st.numel].view(st.shape).clone()

    def _master(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        return self.strategy.master.get(partition_state(p).id)

    def _state(self, p: torch.nn.Parameter, key: str, where: str) -> torch.Tensor:
        m = self._master(p)
        if m is None:
            raise ValueError(
                f"{where}: {param_name(p)} is frozen (requires_grad=False): it has no optimizer state"
            )
        state = self.strategy._optimizer_state(m)  # offloaded states: read from their home
        if key not in state:
            have = sorted(state) or "none yet: states appear after the first optimizer step"
            raise KeyError(f"{where}: {param_name(p)} has no optimizer state {key!r} (available: {have})")
        return state[key]

    def _local_slice(self, p: torch.nn.Parameter, value: torch.Tensor) -> torch.Tensor:
        st = partition_state(p)
        flat = value.detach().reshape(-1)
        lo = min(st.rank * st.shard_numel, st.numel)
        hi = min(lo + st.shard_numel, st.numel)
        out = torch.zeros(st.shard_numel, dtype=torch.float32, device=st.shard.device)
        out[: hi - lo].copy_(flat[lo:hi])
        return out

    @torch.no_grad()
    def _write_param_shard(self, p: torch.nn.Parameter, local: torch.Tensor) -> None:
        st = partition_state(p)
        m = self._master(p)
        if m is not None:
            self.strategy._set_master_value(m, local)
        if m is None or not shares_shard(m, st):
            write_shard(p, local)

    @staticmethod
    def _check_local(p: torch.nn.Parameter, value: Any, where: str) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}: value must be a torch.Tensor, got {type(value).__name__}")
        n = partition_state(p).shard_numel
        if value.numel() != n:
            raise ValueError(
                f"{where}: value has {value.numel()} elements but the local partition of {param_name(p)} "
                f"has {n} (param.zero_shard.numel())"
            )

    # -- full form (collective getters) -------------------------------------------------
    def full_fp32_param(self, p: torch.nn.Parameter) -> torch.Tensor:
        m = self._master(p)
        return self._gather(p, self.strategy._master_value(m) if m is not None else read_shard(p))

    def full_grad(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        self.strategy.wait_reductions()
        g = self.strategy.grad_shard_of(p)
        # Every rank reduced the same buckets, so ``g is None`` agrees across ranks.
        return None if g is None else self._gather(p, g)

    def full_optimizer_state(self, p: torch.nn.Parameter, key: str) -> torch.Tensor:
        value = self._state(p, key, "safe_get_full_optimizer_state")
        if value.dim() == 0 or value.numel() != partition_state(p).shard_numel:
            return value.detach().clone()  # a scalar such as Adam's step: the same on every rank
        return self._gather(p, value)

    @torch.no_grad()
    def set_full_fp32_param(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        self._write_param_shard(p, self._local_slice(p, value))
        st = partition_state(p)
        if st.status is ParamStatus.AVAILABLE:
            st.full[: st.numel].copy_(value.detach().reshape(-1))

    @torch.no_grad()
    def set_full_optimizer_state(self, p: torch.nn.Parameter, value: torch.Tensor, key: str) -> None:
        target = self._state(p, key, "safe_set_full_optimizer_state")
        self._write_state(p, key, target, self._local_slice(p, value))

    # -- local form (no communication) ----------------------------------------------------
    def local_fp32_param(self, p: torch.nn.Parameter) -> torch.Tensor:
        m = self._master(p)
        return (self.strategy._master_value(m) if m is not None else read_shard(p)).detach().float().clone()

    def local_grad(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        self.strategy.wait_reductions()
        g = self.strategy.grad_shard_of(p)
        return None if g is None else g.detach().float().clone()

    def local_optimizer_state(self, p: torch.nn.Parameter, key: str) -> torch.Tensor:
        return self._state(p, key, "safe_get_local_optimizer_state").detach().clone()

    def set_local_fp32_param(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        self._check_local(p, value, "safe_set_local_fp32_param")
        self._write_param_shard(p, value.detach().reshape(-1).float())

    @torch.no_grad()
    def set_local_optimizer_state(self, p: torch.nn.Parameter, value: torch.Tensor, key: str) -> None:
        target = self._state(p, key, "safe_set_local_optimizer_state")
        self._check_local(p, value, "safe_set_local_optimizer_state")
        self._write_state(p, key, target, value.detach().reshape(target.shape))

    # -- gradients (safe_set_full_grad / safe_set_local_grad) -----------------------------
    @torch.no_grad()
    def _write_grad_shard(self, p: torch.nn.Parameter, local: torch.Tensor) -> None:
        self.strategy.wait_reductions()
        st = partition_state(p)
        if st.grad_shard is None:
            dtype = self.strategy.reducer.accum_dtype or st.shard.dtype
            st.grad_shard = torch.zeros(st.shard_numel, dtype=dtype, device=st.shard.device)
        st.grad_shard.copy_(local.reshape(-1))
        self.strategy.restage_grad(p)  # an offload that staged the old value gets the new one

    def set_full_grad(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        self._write_grad_shard(p, self._local_slice(p, value))

    def set_local_grad(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        self._check_local(p, value, "safe_set_local_grad")
        self._write_grad_shard(p, value.detach().float())

    def _write_state(
        self, p: torch.nn.Parameter, key: str, target: torch.Tensor, value: torch.Tensor
    ) -> None:
        # into the live state (copied into ``target``), or into the offload's store (it may live
        # on NVMe): See [Note: optimizer offload seam]
        m = self._master(p)
        self.strategy.offload.load_state(self.strategy.optimizer, m, {key: value.reshape(target.shape)})


__all__ = ["Stage3StateAccess"]
