"""ZeRO stages 1 and 2: checkpoint fragments out and in, for
:class:`~zero_core.zero.stage_1_and_2.PartitionedOptimizerStrategy`.

A part the strategy holds (``strategy.checkpointing``) and delegates to: it reads the strategy's
groups, masters, optimizer and offload store; the format and the reader are
``zero_core.checkpoint``'s (see [Note: checkpoint format] in checkpoint/format.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zero_core.checkpoint.fragments import CheckpointReader
    from zero_core.zero.stage_1_and_2 import PartitionedOptimizerStrategy


class PartitionedCheckpointing:
    """Saving and loading a partitioned optimizer's shards (held by the stage 1/2 strategy)."""

    def __init__(self, strategy: PartitionedOptimizerStrategy) -> None:
        self.strategy = strategy  # imported for typing only: stage_1_and_2.py imports this module

    # -- checkpointing (zero_core.checkpoint; see [Note: checkpoint format] in checkpoint/format.py) --
    def checkpoint_fragments(self, exclude_frozen_parameters: bool = False) -> list[Any]:
        """The fp32 master and optimizer-state segments this rank's shard holds, named per parameter.

        Rank 0 adds the whole module weights that the masters do not already give exactly (16-bit
        weights, frozen parameters) and the per-group scalar states (Adam's ``step``).
        """
        s = self.strategy
        from zero_core.checkpoint.fragments import FP32, Fragment, optimizer_state_fragments
        from zero_core.checkpoint.replicated import module_fragments

        out = []
        if s.rank == 0:
            partitioned = {n for gg in s.groups for n in gg.names}
            out = [
                f
                for f in module_fragments(s.module, exclude_frozen_parameters=exclude_frozen_parameters)
                if s.dtype != torch.float32 or f.name not in partitioned
            ]
        for g, gg in enumerate(s.groups):
            master = s.masters[g].detach()
            state = s._optimizer_state(g)
            for i, (p, name) in enumerate(zip(gg.params, gg.names)):
                segments = s.state_access.own_segments(g, i)
                for so, po, n in segments:
                    out.append(Fragment(name, FP32, tuple(p.shape), po, po + n, master[so : so + n]))
                out += optimizer_state_fragments(
                    name,
                    tuple(p.shape),
                    state,
                    segments,
                    elementwise_numel=master.numel(),
                    emit_scalars=s._ranks[g] == 0,  # once per (expert) group
                )
        return out

    @torch.no_grad()
    def load_checkpoint_fragments(
        self,
        reader: CheckpointReader,
        *,
        load_optimizer_states: bool = True,
        load_module_only: bool = False,
        strict: bool = True,
    ) -> None:
        """Whole module weights, then this rank's master segments and optimizer states, from any layout.

        Every range is read in place, into the live masters and optimizer states (see [Note:
        loading into the live state] in checkpoint/inplace.py); under an engine load those reads
        complete in the reader's single pass (see [Note: single-pass load]), which an offload
        store, taking the values at once, must wait for.
        """
        s = self.strategy
        from zero_core.checkpoint.fragments import FP32, OPTIM_PREFIX, PARAM
        from zero_core.checkpoint.inplace import state_buffer, zero_uncovered
        from zero_core.checkpoint.replicated import load_module_params

        load_module_params(reader, s.module, strict=strict)
        handoff: list[tuple[torch.Tensor, dict[str, Any]]] = []  # (master, state) for the offload store
        for g, gg in enumerate(s.groups):
            master = s.masters[g].detach()
            owned = [
                (name, s.state_access.own_segments(g, i))
                for i, name in enumerate(gg.names)
                if reader.has(name, FP32) or reader.has(name, PARAM)
            ]
            for name, segments in owned:
                # See [Note: fp32 master aliasing]: the module weights loaded above are the master
                if s.master_aliases_params and reader.fp32_module_value_is_master(name):
                    continue
                for so, po, n in segments:
                    reader.read_fp32_into(master[so : so + n], name, po)
            if not load_optimizer_states or load_module_only or not owned:
                continue
            first = owned[0][0]
            offloaded = s.offload.owns(s.masters[g])
            live = {} if offloaded else s.optimizer.state.get(s.masters[g], {})
            state: dict[str, Any] = {}
            for key in reader.optimizer_keys(first):
                kind = OPTIM_PREFIX + key
                if not reader.is_elementwise(first, kind):
                    # per group: the same for all its params
                    state[key] = reader.read_optimizer_state(first, key)
                    continue
                buf = state_buffer(live.get(key), master.numel(), reader.dtype(first, kind), master.device)
                covered = []
                for name, segments in owned:
                    for so, po, n in segments:
                        reader.read_into(buf[so : so + n], name, kind, po)
                        covered.append((so, so + n))
                zero_uncovered(buf, covered)  # padding and parameters absent from the checkpoint
                state[key] = buf.view(master.shape)
            if state:
                if offloaded:
                    handoff.append((s.masters[g], state))
                else:
                    s.optimizer.state[s.masters[g]] = state
        # with optimizer offload every master is owned (on every rank): the same branch everywhere
        if any(s.offload.owns(m) for m in s.masters):
            reader.finish_single_pass()  # the store copies the values: they must be read (collective)
            for m, state in handoff:
                s.offload.load_state(s.optimizer, m, state)
            s.offload.refresh_low_precision()
