"""ZeRO stage 3: engine state dict, 16-bit model save and checkpoint fragments out and in, for
:class:`~zero_core.zero.stage3.strategy.Stage3Strategy`.

A part the strategy holds (``strategy.checkpointing``) and delegates to: it reads the strategy's
module, parameters, masters, optimizer and offload store; the format and the reader are
``zero_core.checkpoint``'s (see [Note: checkpoint format] in checkpoint/format.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from zero_core import comm
from zero_core.zero.stage3.gathered_parameters import GatheredParameters
from zero_core.zero.stage3.param_records import partition_state
from zero_core.zero.stage3.partitioned_param import is_partitioned, read_shard, shares_shard, write_shard


class Stage3Checkpointing:
    """Saving and loading the partitioned parameters, masters and optimizer states.

    Held by the stage 3 strategy, which delegates its checkpoint methods here.
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy  # a Stage3Strategy (not imported: it imports this module)

    def state_dict(self) -> dict[str, Any]:
        s = self.strategy
        return {
            "optimizer": s.offload.state_dict_with_states(s.optimizer),  # the optimizer's own without offload
            "master": [s._master_value(s.master[st.id]) for st in s.records if st.id in s.master],
            "shards": [read_shard(p).detach() for p in s.params],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.strategy
        s.optimizer.load_state_dict(state["optimizer"])
        s.offload.sync_from_optimizer(s.optimizer)
        for p, saved in zip(s.params, state.get("shards", [])):
            write_shard(p, saved)
        masters = [s.master[st.id] for st in s.records if st.id in s.master]
        for m, saved in zip(masters, state.get("master", [])):
            s._set_master_value(m, saved)
        s.refresh_persistent()

    # -- 16-bit model save ----------------------------------------------------------------
    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "model.safetensors",
        exclude_frozen_parameters: bool = False,
        max_shard_size: int | str = "5GB",
    ) -> bool:
        """Gather the 16-bit weights and write them on rank 0 (collective: every rank calls it).
        See [Note: 16-bit model files for from_pretrained]."""
        s = self.strategy
        if not s.gather_16bit_weights_on_model_save:
            if comm.get_rank() == 0:
                print(
                    "[zero] save_16bit_model: not saving, zero_optimization.gather_16bit_weights_on_model_save "
                    "is false (the weights are partitioned)",
                    flush=True,
                )
            return False
        from zero_core.zero.stage3.model_save import write_hf_weights

        # See [Note: stage 3 expert parameters]: rank 0 gathers only the experts of its own
        # expert-parallel rank, under local names; refuse rather than write an incomplete file.
        for name, layer in s.module.named_modules():
            ep = getattr(layer, "ep_size", 1)
            if isinstance(ep, int) and ep > 1 and isinstance(getattr(layer, "num_local_experts", None), int):
                raise ValueError(
                    f"save_16bit_model: MoE layer {name!r} has ep_size={ep}: rank 0 holds only its own experts, "
                    "so a single 16-bit file would miss the others. Use save_checkpoint (experts are stored "
                    "per global expert) and zero_to_fp32 to get every expert's weights."
                )
        state: dict[str, torch.Tensor] = {}
        for key, value in s.module.state_dict(keep_vars=True).items():
            if is_partitioned(value):
                if exclude_frozen_parameters and not value.requires_grad:
                    continue
                with GatheredParameters([value]):
                    state[key] = value.detach().clone()
            elif value is not None:
                state[key] = value.detach().clone()
        if comm.get_rank() == 0:
            write_hf_weights(state, save_dir, save_filename, max_shard_size)
        return True

    # -- checkpointing (zero_core.checkpoint; see [Note: checkpoint format] in checkpoint/format.py) --
    def _owned_range(self, p: torch.nn.Parameter) -> tuple[int, int]:
        st = partition_state(p)
        lo = min(st.rank * st.shard_numel, st.numel)
        return lo, min(lo + st.shard_numel, st.numel)

    def checkpoint_fragments(self, exclude_frozen_parameters: bool = False) -> list[Any]:
        """Each parameter's shard range: fp32 master, optimizer states, and the 16-bit (or frozen) weight.

        Values that live off memory (offloaded shards, masters and states) are deferred: read
        one at a time while the saver writes them (See [Note: deferred fragments])."""
        s = self.strategy
        from zero_core.checkpoint.fragments import FP32, PARAM, Fragment, optimizer_state_fragments

        out: list[Any] = []
        route = getattr(s, "route", None)
        if route is not None and route.mics and comm.get_rank() >= route.shard_size:
            return out  # MiCS: the first shard group writes; the others hold copies of its shards
        for name, p in s.module.named_parameters():
            st = partition_state(p)
            if exclude_frozen_parameters and not p.requires_grad:
                continue
            lo, hi = self._owned_range(p)
            shape = tuple(st.shape)
            m = s.master.get(st.id)
            if m is None or not shares_shard(m, st):  # 16-bit or frozen: the weight is not the master
                if not st.store.transient:  # the shard itself (See [Note: shard store seam])
                    out.append(Fragment(name, PARAM, shape, lo, hi, st.shard[: hi - lo]))
                else:
                    read = functools.partial(_head, read_shard, p, hi - lo)
                    out.append(Fragment.deferred(name, PARAM, shape, lo, hi, st.shard.dtype, read))
            if m is None:
                continue
            owned = s.offload.owns(m)
            if owned:
                read = functools.partial(_head, s._master_value, m, hi - lo)
                out.append(Fragment.deferred(name, FP32, shape, lo, hi, torch.float32, read))
            else:
                out.append(Fragment(name, FP32, shape, lo, hi, m.detach().reshape(-1)[: hi - lo]))
            state = s.offload.deferred_state_of(s.optimizer, m)  # the optimizer's own when not owned
            out += optimizer_state_fragments(
                name,
                shape,
                state,
                [(0, lo, hi - lo)],
                elementwise_numel=st.shard_numel,
                emit_scalars=st.rank == 0,
            )
        return out

    @torch.no_grad()
    def load_checkpoint_fragments(
        self,
        reader: Any,
        *,
        load_optimizer_states: bool = True,
        load_module_only: bool = False,
        strict: bool = True,
    ) -> None:
        """This rank's shard range of every parameter, master and optimizer state, from any layout (collective).

        Ranges are read in place, into the live shards, masters and optimizer states (see [Note:
        loading into the live state] in checkpoint/inplace.py); under an engine load those reads
        complete in the reader's single pass (see [Note: single-pass load]), so the persistent
        parameters are gathered after it. Values that go to an offload store (offloaded shards,
        masters, optimizer states) are read at once and stored parameter by parameter instead,
        so a load never holds a rank's partition of them (See [Note: deferred fragments]); the
        pass still verifies the files they came from.
        """
        s = self.strategy
        from zero_core.checkpoint.replicated import check_names

        check_names(reader, s.module, strict=strict)
        s.empty_partition_cache()
        load_states = load_optimizer_states and not load_module_only
        for name, p in s.module.named_parameters():
            self._load_param(reader, name, p, load_states)
        reader.finish_single_pass()  # collective, as this whole load
        s.refresh_persistent()

    def _load_param(self, reader: Any, name: str, p: torch.nn.Parameter, load_states: bool) -> None:
        s = self.strategy
        from zero_core.checkpoint.format import CheckpointError
        from zero_core.checkpoint.fragments import FP32, PARAM

        st = partition_state(p)
        if not (reader.has(name, PARAM) or reader.has(name, FP32)):
            return
        saved = reader.shape(name, FP32 if reader.has(name, FP32) else PARAM)
        if saved != tuple(st.shape):
            raise CheckpointError(
                f"parameter {name!r}: checkpoint shape {saved} != model shape {tuple(st.shape)}"
            )
        lo, hi = self._owned_range(p)
        m = s.master.get(st.id)
        offloaded = m is not None and s.offload.owns(m)
        if offloaded:  # read now and stored: the offload keeps the master
            value = torch.zeros(m.numel(), dtype=torch.float32)
            value[: hi - lo].copy_(reader.read_fp32(name, lo, hi))
            s._set_master_value(m, value)
        elif m is not None:
            reader.read_fp32_into(m.detach().view(-1)[: hi - lo], name, lo)
        if m is None or not shares_shard(m, st):
            if not st.store.transient:  # the shard itself (See [Note: shard store seam])
                reader.read_module_value_into(st.shard[: hi - lo], name, lo)
            else:  # read now and written to its home
                value = torch.zeros(st.shard_numel, dtype=st.shard.dtype)
                value[: hi - lo].copy_(reader.read_module_value(name, st.shard.dtype, lo, hi))
                write_shard(p, value)
        if m is not None and load_states:
            self._load_states(reader, name, m, lo, hi, offloaded)

    def _load_states(
        self, reader: Any, name: str, m: torch.Tensor, lo: int, hi: int, offloaded: bool
    ) -> None:
        """The optimizer state of master ``m`` (elements ``[lo, hi)`` of parameter ``name``)."""
        s = self.strategy
        from zero_core.checkpoint.fragments import OPTIM_PREFIX
        from zero_core.checkpoint.inplace import state_buffer, zero_uncovered

        live = {} if offloaded else s.optimizer.state.get(m, {})
        state: dict[str, Any] = {}
        for key in reader.optimizer_keys(name):
            kind = OPTIM_PREFIX + key
            if not reader.is_elementwise(name, kind):
                state[key] = reader.read_optimizer_state(name, key)
                continue
            if offloaded:  # read now, handed to the offload below
                buf = torch.zeros(m.numel(), dtype=reader.dtype(name, kind))
                buf[: hi - lo].copy_(reader.read(name, kind, lo, hi))
            else:
                buf = state_buffer(live.get(key), m.numel(), reader.dtype(name, kind), m.device)
                reader.read_into(buf[: hi - lo], name, kind, lo)
                zero_uncovered(buf, [(0, hi - lo)])  # the shard's padding
            state[key] = buf.view(m.shape)
        if state:
            if offloaded:
                s.offload.load_state(s.optimizer, m, state)
            else:
                s.optimizer.state[m] = state


def _head(read: Callable[[Any], torch.Tensor], what: Any, n: int) -> torch.Tensor:
    """The first ``n`` values of ``read(what)`` (a shard's, without its padding), flat."""
    return read(what).reshape(-1)[:n]
