"""ZeRO stages 1 and 2: the safe_get / safe_set owner protocol (full and local values of a parameter's
fp32 master, gradient and optimizer states), for :class:`~zero_core.zero.stage_1_and_2.PartitionedOptimizerStrategy`.

A part the strategy holds (``strategy.state_access``) and registers as its parameters' owner (see
[Note: parameter owners]); it reads the strategy's groups, masters, ranks and gradient
reducer through :class:`PartitionedState`. See ``zero_core/zero/debug_access.py`` for the public
functions that dispatch here.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from zero_core import comm
from zero_core.zero.grad_reduce import PartitionedGradReducer
from zero_core.zero.param_owners import ParamLocation


class PartitionedState(Protocol):
    """What :class:`PartitionedStateAccess` reads of the stage 1/2 strategy. The strategy
    satisfies it; naming it here, instead of importing the strategy, keeps this module below
    ``stage_1_and_2.py`` (no import cycle)."""

    groups: list[Any]  # the partition groups (layout, params, process group)
    masters: list[torch.nn.Parameter]  # one fp32 master shard per group
    reducer: PartitionedGradReducer  # reduced gradient shards
    _ranks: list[int]  # this rank within each group's process group
    _param_locations: dict[torch.nn.Parameter, ParamLocation]

    def _loss_scale(self) -> float: ...

    def _optimizer_state(self, g: int) -> dict[str, Any]: ...


class PartitionedStateAccess:
    """Per-parameter views of a partitioned optimizer's state: the owner object of
    [Note: safe_get owner protocol] for stage 1/2 parameters (held by the strategy).

    ``safe_set_full_grad`` / ``safe_set_local_grad`` take the gradient of the unscaled loss
    (what ``safe_get_*_grad`` returns): it is multiplied by the current fp16 loss scale before
    it replaces this rank's owned elements of the reduced gradient, so the next
    ``engine.step()`` applies it.
    """

    def __init__(self, strategy: PartitionedState) -> None:
        self.strategy = strategy

    # -- safe_get / safe_set owner protocol (see zero_core/zero/debug_access.py) ------
    def param_location(self, p: torch.nn.Parameter) -> ParamLocation:
        """Where ``p`` lives in this strategy (See [Note: parameter owners])."""
        loc = self.strategy._param_locations.get(p)
        if loc is None:
            raise ValueError(
                f"parameter of shape {tuple(p.shape)} is not partitioned by this ZeRO stage 1/2 strategy "
                "(frozen, or of another engine)"
            )
        return loc

    def own_segments(self, g: int, i: int) -> list[tuple[int, int, int]]:
        """(shard offset, param flat offset, length) of param ``i``'s elements this rank owns."""
        layout = self.strategy.groups[g].layout
        out = []
        for chunk, s in layout.chunks_of_param(i):
            a, b = chunk.piece_range(self.strategy._ranks[g])
            lo = max(a, chunk.start + s.chunk_lo)
            hi = min(b, chunk.start + s.chunk_lo + s.numel)
            if hi > lo:
                out.append(
                    (
                        layout.shard_offsets[chunk.index] + lo - a,
                        s.param_lo + lo - (chunk.start + s.chunk_lo),
                        hi - lo,
                    )
                )
        return out

    def _gather_param(self, p: torch.nn.Parameter, shard: torch.Tensor) -> torch.Tensor:
        g, i = self.param_location(p)
        layout = self.strategy.groups[g].layout
        out = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
        for chunk, s in layout.chunks_of_param(i):
            so = layout.shard_offsets[chunk.index]
            full = torch.empty(chunk.padded, dtype=torch.float32, device=p.device)
            comm.all_gather_into_tensor(
                full, shard[so : so + chunk.piece].float().contiguous(), group=self.strategy.groups[g].group
            )
            out[s.param_lo : s.param_hi].copy_(full[s.chunk_lo : s.chunk_lo + s.numel])
        return out.view(p.shape)

    def _state_shard(self, p: torch.nn.Parameter, key: str) -> torch.Tensor:
        g = self.param_location(p).group
        st = self.strategy._optimizer_state(g)
        if key not in st:
            raise KeyError(
                f"optimizer state '{key}' does not exist for this parameter (known: {sorted(st)}); "
                "states exist after the first optimizer step"
            )
        return st[key]

    def full_fp32_param(self, p: torch.nn.Parameter) -> torch.Tensor:
        return self._gather_param(p, self.strategy.masters[self.param_location(p).group].detach())

    def full_grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The reduced gradient, divided by the current loss scale (fp16; 1 otherwise)."""
        full = self._gather_param(p, self.strategy.reducer.shard_grad(self.param_location(p).group))
        scale = self.strategy._loss_scale()
        return full.div_(scale) if scale != 1.0 else full

    def full_optimizer_state(self, p: torch.nn.Parameter, key: str) -> torch.Tensor:
        st = self._state_shard(p, key)
        if st.shape != self.strategy.masters[self.param_location(p).group].shape:
            return st.clone()  # a scalar state such as Adam's "step"
        return self._gather_param(p, st)

    # Local views: the elements of a parameter this rank owns, in the parameter's flat order (a
    # 1-D tensor, possibly empty; with several chunks the owned elements need not be adjacent).
    # No communication.
    def _local(self, p: torch.nn.Parameter, shard: torch.Tensor) -> torch.Tensor:
        g, i = self.param_location(p)
        segs = self.own_segments(g, i)
        return torch.cat([shard[so : so + n] for so, _, n in segs]) if segs else shard[:0].clone()

    def _set_local(self, p: torch.nn.Parameter, shard: torch.Tensor, value: torch.Tensor, where: str) -> None:
        g, i = self.param_location(p)
        segs = self.own_segments(g, i)
        want = sum(n for _, _, n in segs)
        flat = value.detach().reshape(-1)
        if flat.numel() != want:
            raise ValueError(
                f"{where}: this rank owns {want} elements of the parameter (see safe_get_local_*), "
                f"the value has {flat.numel()}"
            )
        k = 0
        for so, _, n in segs:
            shard[so : so + n].copy_(flat[k : k + n])
            k += n

    def local_fp32_param(self, p: torch.nn.Parameter) -> torch.Tensor:
        return self._local(p, self.strategy.masters[self.param_location(p).group].detach())

    def local_grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        scale = self.strategy._loss_scale()
        local = self._local(p, self.strategy.reducer.shard_grad(self.param_location(p).group)).float()
        return local / scale if scale != 1.0 else local

    def local_optimizer_state(self, p: torch.nn.Parameter, key: str) -> torch.Tensor:
        st = self._state_shard(p, key)
        if st.shape != self.strategy.masters[self.param_location(p).group].shape:
            return st.clone()
        return self._local(p, st)

    @torch.no_grad()
    def set_local_fp32_param(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Write this rank's owned elements into the master and this rank's module copy of them.

        Other ranks' module copies see the new values after the next step's all-gather.
        """
        g, i = self.param_location(p)
        self._set_local(p, self.strategy.masters[g], value.to(torch.float32), "safe_set_local_fp32_param")
        # the module's own (possibly 16-bit) copy of those elements follows the master at once
        out = p.data.view(-1)
        for so, po, n in self.own_segments(g, i):
            out[po : po + n].copy_(self.strategy.masters[g][so : so + n])

    def _store_state(self, p: torch.nn.Parameter, key: str, st: torch.Tensor) -> None:
        """Write the group's changed state ``st`` back where it lives: an NVMe offload hands
        :meth:`_state_shard` a copy read from its swap file, so the change must go to the file
        (host-memory states are changed in place already)."""
        strategy = self.strategy
        master = strategy.masters[self.param_location(p).group]
        if strategy.offload.owns(master):
            strategy.offload.load_state(strategy.optimizer, master, {key: st})

    @torch.no_grad()
    def set_local_optimizer_state(self, p: torch.nn.Parameter, value: torch.Tensor, key: str) -> None:
        st = self._state_shard(p, key)
        if st.shape != self.strategy.masters[self.param_location(p).group].shape:
            st.copy_(value)
        else:
            self._set_local(p, st, value.to(st.dtype), "safe_set_local_optimizer_state")
        self._store_state(p, key, st)

    @torch.no_grad()
    def set_full_fp32_param(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        g, i = self.param_location(p)
        flat = value.detach().reshape(-1).to(torch.float32)
        for so, po, n in self.own_segments(g, i):
            self.strategy.masters[g][so : so + n].copy_(flat[po : po + n])
        p.data.copy_(value.detach().to(p.dtype).view_as(p))  # every rank holds the full value: no comm

    @torch.no_grad()
    def set_full_optimizer_state(self, p: torch.nn.Parameter, value: torch.Tensor, key: str) -> None:
        st = self._state_shard(p, key)
        g, i = self.param_location(p)
        if st.shape != self.strategy.masters[g].shape:
            st.copy_(value)
        else:
            flat = value.detach().reshape(-1).to(st.dtype)
            for so, po, n in self.own_segments(g, i):
                st[so : so + n].copy_(flat[po : po + n])
        self._store_state(p, key, st)

    # -- gradient writes ------------------------------------------------------------------

    def _grad_pieces(self, g: int) -> list[tuple[int, torch.Tensor]]:
        """(offset in this rank's gradient shard, writable view) of each piece of group ``g``."""
        red = self.strategy.reducer
        if red.partition_grads:
            shard = red.grad_shards[g]
            if shard is None:
                raise RuntimeError(
                    "safe_set_*_grad: there is no reduced gradient yet; call it after engine.backward"
                )
            return [(0, shard)]
        layout = red.groups[g].layout
        rank = red._group_rank[g]
        return [
            (layout.shard_offsets[c.index], red.flat_grads[g][slice(*c.piece_range(rank))])
            for c in layout.chunks
        ]

    @torch.no_grad()
    def _write_grad(
        self, p: torch.nn.Parameter, segs: list[tuple[int, int, int]], values: list[torch.Tensor]
    ) -> None:
        pieces = self._grad_pieces(self.param_location(p).group)
        scale = self.strategy._loss_scale()
        for (so, _, n), v in zip(segs, values):
            for start, view in pieces:
                if start <= so < start + view.numel():
                    view[so - start : so - start + n].copy_(v.mul(scale) if scale != 1.0 else v)
                    break

    def set_full_grad(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        g, i = self.param_location(p)
        flat = value.detach().reshape(-1).float()
        segs = self.own_segments(g, i)
        self._write_grad(p, segs, [flat[po : po + n] for _, po, n in segs])

    def set_local_grad(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        g, i = self.param_location(p)
        segs = self.own_segments(g, i)
        flat = value.detach().reshape(-1).float()
        want = sum(n for _, _, n in segs)
        if flat.numel() != want:
            raise ValueError(
                f"safe_set_local_grad: this rank owns {want} elements of the parameter (see safe_get_local_grad), "
                f"the value has {flat.numel()}"
            )
        out, k = [], 0
        for _, _, n in segs:
            out.append(flat[k : k + n])
            k += n
        self._write_grad(p, segs, out)
