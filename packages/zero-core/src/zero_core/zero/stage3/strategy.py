"""ZeRO stage 3 as a :class:`~zero_core.engine.strategy.TrainingStrategy`.

Each rank owns 1/N of every parameter (see [Note: stage 3 parameter layout]; expert
parameters 1/N of the expert-data-parallel group, see [Note: stage 3 expert parameters]), of its gradient
(reduce-scattered in buckets as soon as it is produced, see [Note: stage 3 hooks] and
[Note: stage 3 gradient buckets]) and of the optimizer
state: the client optimizer's ``param_groups`` are rebound to fp32 *master shards*, one per
parameter. In fp32 the master shard is the parameter's shard itself (no copy); in fp16/bf16 it
is an fp32 copy and the 16-bit shard is refreshed from it after every step. Model-state bytes
per rank are therefore (2 + 2 + 12)Ψ/N with 16-bit training and Adam, plus what is gathered.
With bf16 masters (See [Note: bf16 master weights]) the master is the bf16 shard itself and
the bytes are (2 + 2 + 4)Ψ/N.
See [Note: engine strategies] for the contract with the engine.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from zero_core import comm
from zero_core.config.strategy_options import Stage3Options
from zero_core.protocols.optimizer_offload import (
    MasterSource,
    NoOptimizerOffload,
    OptimizerOffload,
    add_host_breakdown,
)
from zero_core.protocols.shard_store import PLAIN_SHARDS, ShardStore
from zero_core.utils.grad_norm import any_nonfinite, needs_scaling, sum_of_squares
from zero_core.utils.master_dtype import check_master_dtype
from zero_core.utils.param_groups import is_expert_param
from zero_core.utils.storage_bytes import StorageLedger
from zero_core.zero.param_owners import register_owner, release_owner
from zero_core.zero.stage3.collective_agreement import confirm_agreement
from zero_core.zero.stage3.expert_partition import partition_group
from zero_core.zero.stage3.hooks import Stage3Hooks
from zero_core.zero.stage3.module_granularity import mark_fine_grained_leaves
from zero_core.zero.stage3.param_coordinator import ParamCoordinator
from zero_core.zero.stage3.param_records import RecordOwner, partition_state
from zero_core.zero.stage3.partitioned_param import (
    ParamStatus,
    PartitionState,
    gather_params,
    is_partitioned,
    partition_on_route,
    partition_param,
    read_shard,
    release_param,
    set_param_name,
    set_shard_dtype,
    shares_shard,
    write_shard,
)
from zero_core.zero.stage3.reduce_buckets import GradBucketReducer
from zero_core.zero.stage3.shard_groups import ShardRoute, drop_secondary
from zero_core.zero.stage3.state_access import Stage3StateAccess
from zero_core.zero.stage3.strategy_checkpoint import Stage3Checkpointing
from zero_core.zero.stage3.streamed_grads import StreamedGradients


def _unique_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _check_arguments(
    module: Any,
    optimizer: Any,
    dtype: Any,
    param_persistence_threshold: Any,
    model_persistence_threshold: Any,
) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"Stage3Strategy: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"Stage3Strategy: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"Stage3Strategy: dtype must be float32, float16 or bfloat16, got {dtype}")
    for name, v in (
        ("param_persistence_threshold", param_persistence_threshold),
        ("model_persistence_threshold", model_persistence_threshold),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"Stage3Strategy: {name} must be a non-negative int, got {v!r}")


def _reducer(
    bucket_size: int, overlap: bool, comm_dtype: torch.dtype | None, accum_dtype: torch.dtype | None
) -> GradBucketReducer:
    reducer = GradBucketReducer(int(bucket_size), overlap=bool(overlap), comm_dtype=comm_dtype)
    reducer.accum_dtype = accum_dtype  # See [Note: gradient accumulation dtype] (grad_buckets.py)
    return reducer


class Stage3Strategy:
    """Partitioned parameters, gradients and optimizer states.

    ``state_dict``/``load_state_dict``, ``save_16bit_model`` and the checkpoint fragments are
    delegated to the :class:`~zero_core.zero.stage3.strategy_checkpoint.Stage3Checkpointing` it holds
    (``self.checkpointing``): composition, not a mixin.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        options: Stage3Options,
        *,
        group: Any = None,
        optimizer_offload: OptimizerOffload | None = None,
        param_offload: ShardStore = PLAIN_SHARDS,
        route: ShardRoute | None = None,
    ) -> None:
        _check_arguments(
            module,
            optimizer,
            options.dtype,
            options.param_persistence_threshold,
            options.model_persistence_threshold,
        )
        check_master_dtype(
            options.master_dtype, options.dtype, "Stage3Strategy", offloaded=optimizer_offload is not None
        )
        self.master_dtype = options.master_dtype  # See [Note: bf16 master weights]
        self.module = module
        self.optimizer = optimizer
        self.group = group
        # MiCS or hpZ groups (None: plain stage 3); See [Note: MiCS and hpZ shard groups]
        self.route = route
        self.dtype = options.dtype
        self.gather_16bit_weights_on_model_save = bool(options.gather_16bit_weights_on_model_save)
        self.params = _unique_params(module)
        self.master: dict[int, torch.nn.Parameter] = {}  # PartitionState.id -> fp32 master shard
        # False for an engine without an optimizer: no masters (See [Note: engine without an optimizer])
        self._make_masters = bool(options.masters)
        # where the shards live (See [Note: shard store seam]): with zero-offload's ParamOffload
        # off the device, so a master never aliases its shard; zero.Init(remote_device="nvme")
        # may have placed some there already
        self.param_offload = param_offload
        # See [Note: optimizer offload hook] in zero_offload; the null object when nothing is
        # offloaded (See [Note: optimizer offload seam])
        self.offload: OptimizerOffload = optimizer_offload or NoOptimizerOffload()
        self._partition_all()
        # their records, in the same order: this strategy owns them (zero.Init hands its own over
        # in _take_ownership) and the step's loops read them (See [Note: stage 3 parameter records])
        self.records = [partition_state(p) for p in self.params]
        self._make_masters_and_offload(float(options.offload_ratio))
        self._split_masters()
        self._adopt_shard_stores(param_offload, options.quantized_nontrainable_weights)
        self.checkpointing = Stage3Checkpointing(self)  # its checkpoint methods delegate there
        self.streamed = StreamedGradients()  # gradients the offload keeps on NVMe
        for name, p in module.named_parameters():
            set_param_name(p, name)
        self.persistent = self._choose_persistent(
            options.param_persistence_threshold, options.model_persistence_threshold
        )
        self.coordinator = ParamCoordinator(
            module.modules(),
            group,
            prefetch_bucket_size=int(options.prefetch_bucket_size),
            max_live_parameters=int(options.max_live_parameters),
            max_reuse_distance=int(options.max_reuse_distance),
        )
        self.reducer = _reducer(
            options.reduce_bucket_size, options.overlap_comm, options.comm_dtype, options.accum_dtype
        )
        self._switch_zeropp(
            options.quantized_weights, options.quantized_nontrainable_weights, options.quantized_gradients
        )
        for store in self.shard_stores():
            store.follow(self.coordinator)  # read ahead in the recorded module order
        # every fetch of these parameters as an all-reduce: See [Note: all-reduce fetch]
        self.fetch_by_all_reduce = bool(options.use_all_reduce_for_fetch_params)
        self._install_hooks(options.module_granularity_threshold)
        self._rebind_optimizer()
        self.offload.finalize(self.optimizer)
        self._take_ownership()

    def _install_hooks(self, module_granularity_threshold: int) -> None:
        """The hooks of [Note: stage 3 hooks]; first the fine-grained modules become leaves, which
        get one hook for their subtree (See [Note: module granularity threshold])."""
        self.granularity_leaves = mark_fine_grained_leaves(self.module, module_granularity_threshold)
        self.hooks = Stage3Hooks(
            self.module,
            self.coordinator,
            self.reducer.add,
            on_backward_end=self.reducer.flush,
            grad_bytes_live=self.reducer.live_bytes,
        )

    def _take_ownership(self) -> None:
        """Become the owner of the parameters: for the safe_get helpers (See [Note: parameter
        owners]) and of their records, which ``zero.Init`` (or an earlier engine) hands over (See
        [Note: stage 3 parameter records])."""
        self._state_access = Stage3StateAccess(self)
        register_owner(self.params, self._state_access)
        self._owner_ref = weakref.ref(self)
        earlier: dict[int, tuple[RecordOwner, list[PartitionState]]] = {}
        for st in self.records:
            owner = st.owner_of()
            if owner is not None and owner is not self:
                earlier.setdefault(id(owner), (owner, []))[1].append(st)
            st.owner = self._owner_ref
        for owner, records in earlier.values():
            owner.hand_over(records)

    def hand_over(self, records: Iterable[PartitionState]) -> None:
        """A later engine over the same parameters took ``records``: this one keeps its list (its
        step still reads them) but is no longer their owner (See [Note: stage 3 parameter records])."""

    # -- construction ------------------------------------------------------------------
    def _adopt_shard_stores(self, param_offload: ShardStore, quantized_nontrainable_weights: bool) -> None:
        """Shards kept off the device (See [Note: parameter offload] in zero_offload) or frozen
        shards stored quantized (See [Note: quantized frozen shards]); See [Note: shard store seam]."""
        param_offload.adopt(self.params)  # the plain store (the default) takes nothing
        if quantized_nontrainable_weights:
            from zero_core.zero.stage3.quantized_shards import QuantizedShardStore

            QuantizedShardStore().adopt(self.params)

    def _switch_zeropp(self, weights: bool, nontrainable_weights: bool, gradients: bool) -> None:
        """ZeRO++'s quantized communication: qwZ on the coordinator's forward gathers (See
        [Note: quantized weight all-gather (qwZ)]), qgZ on the reducer (See [Note: quantized
        gradient reduce-scatter (qgZ)])."""
        self.coordinator.quantize_weights = bool(weights)
        self.coordinator.quantize_nontrainable = bool(nontrainable_weights)
        if gradients:
            from zero_core.comm.quantized_collectives import QgzReducer

            self.reducer.qgz = QgzReducer(self.group)

    @torch.no_grad()
    def _partition_all(self) -> None:
        for p in self.params:
            group, grad_divisor = self._partition_one(p)
            st = partition_state(p)
            if (st.group is not group and comm.get_world_size(group) != st.world) or (
                st.grad_divisor != grad_divisor
            ):
                kind = "expert-data-parallel" if is_expert_param(p) else "data-parallel"
                raise ValueError(
                    "Stage3Strategy: a parameter was partitioned by zero.Init over a group of "
                    f"{st.world} ranks but its {kind} group in the engine has {comm.get_world_size(group)}"
                )

    @torch.no_grad()
    def _new_master(self, p: torch.nn.Parameter, st: Any) -> torch.Tensor:
        """``p``'s master values (``master_dtype``), read before its shard is cast to the training dtype."""
        if self.master_dtype == self.dtype and not (self.param_offload.transient or st.store.transient):
            # the shard itself, kept on the device: no extra copy in fp32, nor with bf16 masters
            # (See [Note: bf16 master weights])
            set_shard_dtype(p, self.dtype)
            return st.shard
        master = read_shard(p).detach().to(self.master_dtype, copy=True)
        set_shard_dtype(p, self.dtype)
        return master

    def _partition_one(self, p: torch.nn.Parameter) -> tuple[Any, int]:
        """Partition ``p`` (unless zero.Init did); returns the group and divisor it must have."""
        if self.route is None:
            # experts over their expert-data-parallel group: See [Note: stage 3 expert parameters]
            group, grad_divisor = partition_group(p, self.group)
            if not is_partitioned(p):
                partition_param(p, group, broadcast_from=0, grad_divisor=grad_divisor)
            return group, grad_divisor
        if is_expert_param(p):
            raise ValueError(
                "Stage3Strategy: MiCS and hpZ do not support Mixture-of-Experts parameters; "
                "turn off mics_shard_size / zero_hpz_partition_size"
            )
        route = self.route  # See [Note: MiCS and hpZ shard groups]
        if not is_partitioned(p):
            partition_on_route(p, route)
        elif partition_state(p).route is None and route.mics:
            raise ValueError(
                "Stage3Strategy: a parameter was partitioned by zero.Init, but the config sets "
                "mics_shard_size: build the model under zero.MiCS_Init with the same config"
            )
        partition_state(p).route = route
        if route.mics:
            return route.shard_group, route.world
        return self.group, comm.get_world_size(self.group)

    def _choose_persistent(self, threshold: int, model_threshold: int) -> list[torch.nn.Parameter]:
        chosen, total = [], 0
        for p in self.params:
            n = partition_state(p).numel
            if n <= threshold and total + n <= model_threshold:
                chosen.append(p)
                total += n
        for p in chosen:
            partition_state(p).persistent = True
        handle = gather_params(chosen, what="persistent parameters")
        if handle is not None:
            handle.wait()
        return chosen

    def _rebind_optimizer(self) -> None:
        by_param = {id(p): p for p in self.params}
        for group in self.optimizer.param_groups:
            masters = []
            for p in group["params"]:
                if id(p) not in by_param and not is_partitioned(p):
                    raise ValueError(
                        "Stage3Strategy: the optimizer holds a tensor that is not a parameter of the model "
                        f"(shape {tuple(p.shape)}); build the optimizer from model.parameters()"
                    )
                m = self.master.get(partition_state(p).id) if p.requires_grad else None
                if m is not None:
                    masters.append(m)
            group["params"] = masters

    def on_shard_changed(self, p: torch.nn.Parameter) -> None:
        """``p``'s shard was changed outside the optimizer (``GatheredParameters`` with a
        modifier rank): refresh its master from it."""
        st = partition_state(p)
        m = self.master.get(st.id)
        if m is not None and not shares_shard(m, st):
            self._set_master_value(m, read_shard(p))

    # -- TrainingStrategy --------------------------------------------------------------
    def before_backward(self, is_boundary: bool) -> None:
        self.offload.begin_staging(is_boundary)  # See [Note: gradient staging] in zero_offload
        self.streamed.clear()
        # only masters the offload owns are staged as they land (See [Note: gradient staging])
        self.reducer.on_reduced = self._stage_reduced if is_boundary and self.offloaded else None

    def _stage_reduced(self, params: list[torch.nn.Parameter]) -> None:
        streams = self.offload.streams_gradients()
        for st in map(partition_state, params):
            m = self.offloaded.get(st.id)
            if m is not None:
                self.offload.stage_grad_range(m, 0, st.grad_shard)
                if streams:  # See [Note: ZeRO-Infinity streaming] in zero_offload
                    self.streamed.drop(st)

    def grad_shard_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """``p``'s reduced gradient shard, also when the offload holds it on NVMe (read back)."""
        st = partition_state(p)
        m = self.offloaded.get(st.id)
        if st.grad_shard is None and m is not None and self.offload.streams_gradients():
            g = self.offload.staged_grad(m)
            return None if g is None else g.reshape(-1)
        return st.grad_shard

    def restage_grad(self, p: torch.nn.Parameter) -> None:
        """``p``'s gradient shard was set outside backward (``safe_set_*_grad``): hand the new
        value to the offload that steps it, if any."""
        st = partition_state(p)
        m = self.offloaded.get(st.id)  # the device optimizer's masters keep their gradient here
        if m is None or st.grad_shard is None:
            return
        self.offload.stage_grad(m, st.grad_shard)
        if self.offload.streams_gradients():
            self.streamed.drop(st)

    def after_backward(self, is_boundary: bool) -> None:
        self.wait_reductions()
        if is_boundary:  # headers compared before the step: See [Note: stage 3 collective agreement]
            confirm_agreement()

    def wait_reductions(self) -> None:
        self.reducer.finish()

    def _grad_shards(self) -> list[torch.Tensor]:
        return [st.grad_shard for st in self.records if st.grad_shard is not None]

    def local_overflow(self) -> torch.Tensor:
        """A device flag (0-dim bool): does this rank's gradient shard hold an inf or a NaN?"""
        return self.streamed.add_overflow(any_nonfinite(self._grad_shards()))

    def grad_norm_sq(self) -> torch.Tensor:
        # fused, in fp32, on the device: See [Note: scalars stay on the device in the step]
        return self.streamed.add_norm_sq(sum_of_squares(self._grad_shards()))

    def norm_group(self) -> Any:
        # The engine reads None as "nothing to reduce": name the default group explicitly.
        if self.route is not None and self.route.mics:  # shards are replicated across shard groups
            return self.route.shard_group if self.route.shard_size > 1 else None
        if comm.get_world_size(self.group) == 1:
            return None
        return self.group if self.group is not None else torch.distributed.GroupMember.WORLD

    @torch.no_grad()
    def step(self, grad_scale: float | torch.Tensor) -> None:
        self.wait_reductions()
        self.coordinator.release_all()
        for st, m in self._offloaded_steps:
            if not self.offload.is_staged(m):  # else copied already during backward
                self.offload.stage_grad(m, st.grad_shard)  # host copy; scaled and applied by the CPU step
            m.grad = None
        for st, m in self._device_steps:
            g = st.grad_shard
            if g is None:
                m.grad = None
            elif g.dtype == m.dtype and shares_shard(m, st):  # fp32, or bf16 masters: as it is
                m.grad = g.mul_(grad_scale) if needs_scaling(grad_scale) else g
            else:
                m.grad = g.to(m.dtype).mul_(grad_scale)
        self.optimizer.step()  # device-side masters (all of them without offload; 1 - ratio with it)
        # offloaded masters: their new low-precision weights come back through _publish
        self.offload.step(self.optimizer, grad_scale, publish=self._publish)
        for p, st, m in self._device_written:
            if not shares_shard(m, st):  # a separate copy: the new values go to the shard
                write_shard(p, m)
        self.refresh_persistent()

    def _publish(self, master: torch.Tensor, values: torch.Tensor) -> None:
        """The offload's updated weights of ``master`` (training dtype) into its parameter's shard."""
        write_shard(self._param_of_master[id(master)], values)

    def refresh_persistent(self) -> None:
        """Re-gather persistent parameters after their shards changed."""
        drop_secondary(self.params)  # stale hpZ copies: See [Note: MiCS and hpZ shard groups]
        for p in self.persistent:
            release_param(p, force=True)
        handle = gather_params(self.persistent, what="persistent parameters")
        if handle is not None:
            handle.wait()

    def zero_grad(self) -> None:
        self.offload.begin_staging(True, prefetch=False)  # a skipped step must not leave staged gradients
        self.streamed.clear()
        for p, st in zip(self.params, self.records):
            st.grad_shard = None
            p.grad = None
        for m in self.master.values():
            m.grad = None

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of the distinct live storages by category (each storage once; see [Note: memory
        breakdown counts storages] in zero_core/utils/storage_bytes.py). The peak of gathered
        parameters and full gradients is not a live storage: see :meth:`memory_peaks`."""
        off = self.offload
        state = [
            t
            for m, s in self.optimizer.state.items()
            if not off.owns(m)
            for t in s.values()
            if torch.is_tensor(t)
        ]
        ledger = StorageLedger(exclude=off.owned_tensors())
        # offloaded shards' device copies are reported by their offload (offloaded_parameters_device)
        ledger.add(
            "parameters",
            (st.shard for st in self.records if not st.store.transient),
        )
        # with the statistics of the gradients streamed to NVMe (See [Note: ZeRO-Infinity streaming])
        ledger.add("gradients", [*self._grad_shards(), *self.streamed.tensors()])
        ledger.add("master_weights", self.master.values())
        ledger.add("optimizer_states", state)
        ledger.add(
            "persistent_parameters",
            (st.full for st in map(partition_state, self.persistent) if st.status is ParamStatus.AVAILABLE),
        )
        ledger.add(
            "gathered_parameters", (partition_state(p).full for p in self.coordinator.gathered.values())
        )
        secondary = (st.secondary for st in self.records if st.secondary is not None)
        ledger.add("secondary_parameters", secondary)  # hpZ: See [Note: MiCS and hpZ shard groups]
        out = ledger.categories
        # host-side pools, see [Note: optimizer offload hook] in zero_offload
        add_host_breakdown(out, off, self.optimizer, ledger.count)
        for store in self.shard_stores():  # See [Note: shard store seam]
            for k, v in store.memory_breakdown().items():
                out[k] = out.get(k, 0) + v
        return out

    def memory_peaks(self) -> dict[str, int]:
        """High-water marks since the engine was built (not live storages)."""
        return {"peak_gathered_and_full_grads": self.coordinator.peak_bytes}

    def swap_io_bytes(self) -> dict[str, int]:
        """Bytes read from and written to NVMe swap files so far by this strategy's offloads
        (optimizer states, masters, gradients and parameters; zero without NVMe offload)."""
        out = {"read": 0, "written": 0}
        for store in [self.offload, *self.shard_stores()]:
            counts = getattr(store, "swap_io_bytes", None)
            if counts is not None:
                for k, v in counts().items():
                    out[k] += v
        return out

    def shard_stores(self) -> list[ShardStore]:
        """The distinct shard stores of this strategy's parameters (See [Note: shard store seam])."""
        found = {id(st.store): st.store for st in self.records}
        return list(found.values())

    # Masters may live on NVMe (See [Note: masters on NVMe] in zero_offload): read and write them
    # through the offload, which answers for the masters it does not own too (See [Note:
    # optimizer offload seam]).
    def _master_value(self, m: torch.Tensor) -> torch.Tensor:
        return self.offload.master_value(m)

    def _set_master_value(self, m: torch.Tensor, values: torch.Tensor) -> None:
        self.offload.set_master(m, values)

    # -- checkpointing: delegated to Stage3Checkpointing ---------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """See :meth:`Stage3Checkpointing.state_dict`."""
        return self.checkpointing.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """See :meth:`Stage3Checkpointing.load_state_dict`."""
        self.checkpointing.load_state_dict(state)

    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "model.safetensors",
        exclude_frozen_parameters: bool = False,
        max_shard_size: int | str = "5GB",
    ) -> bool:
        """See :meth:`Stage3Checkpointing.save_16bit_model` (collective)."""
        return self.checkpointing.save_16bit_model(
            save_dir, save_filename, exclude_frozen_parameters, max_shard_size
        )

    def checkpoint_fragments(self, exclude_frozen_parameters: bool = False) -> list[Any]:
        """See :meth:`Stage3Checkpointing.checkpoint_fragments`."""
        return self.checkpointing.checkpoint_fragments(exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint_fragments(
        self,
        reader: Any,
        *,
        load_optimizer_states: bool = True,
        load_module_only: bool = False,
        strict: bool = True,
    ) -> None:
        """See :meth:`Stage3Checkpointing.load_checkpoint_fragments` (collective)."""
        self.checkpointing.load_checkpoint_fragments(
            reader,
            load_optimizer_states=load_optimizer_states,
            load_module_only=load_module_only,
            strict=strict,
        )

    # -- optimizer offload (zero-offload; see [Note: optimizer offload hook] there) ----------
    def _offload_choice(self, ratio: float) -> set[int]:
        """Record ids of the first ``ratio`` of the master elements (in parameter order): the
        masters handed to the offload (``offload_optimizer.ratio``; the rest stay on the device)."""
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"zero_optimization.offload_optimizer.ratio must be in [0, 1], got {ratio!r}")
        wanted = [st for p, st in zip(self.params, self.records) if p.requires_grad and self._make_masters]
        total = sum(st.shard_numel for st in wanted)
        chosen, acc = set(), 0
        for st in wanted:
            if acc + st.shard_numel > ratio * total + 1e-9:
                break
            chosen.add(st.id)
            acc += st.shard_numel
        return chosen

    @torch.no_grad()
    def _make_masters_and_offload(self, ratio: float) -> None:
        """fp32 masters of the trainable parameters; shards cast to the training dtype.

        The offload's share is handed over as ``MasterSource`` objects per optimizer param
        group, so an offload on NVMe reads and stores them one at a time (See [Note: ZeRO-Infinity
        streaming] in zero_offload); the rest are built here."""
        chosen = self._offload_choice(ratio)
        by_param = {id(p): (p, st) for p, st in zip(self.params, self.records)}
        for group in self.optimizer.param_groups:
            mine = [by_param[id(q)] for q in group["params"] if id(q) in by_param]
            mine = [(p, st) for p, st in mine if st.id in chosen and st.id not in self.master]
            if not mine:
                continue
            sources = [
                MasterSource(torch.Size([st.shard_numel]), functools.partial(self._new_master, p, st))
                for p, st in mine
            ]
            for (_, st), m in zip(mine, self.offload.adopt(sources)):  # the null object keeps them
                self.master[st.id] = m
        for p, st in zip(self.params, self.records):
            if not p.requires_grad or not self._make_masters:
                set_shard_dtype(p, self.dtype)
            elif st.id not in self.master:
                self.master[st.id] = torch.nn.Parameter(self._new_master(p, st))
        self._param_of_master = {
            id(m): p for p, st in zip(self.params, self.records) if (m := self.master.get(st.id)) is not None
        }

    def _split_masters(self) -> None:
        """The step's lists, made once (the masters never change after construction): the masters
        the offload steps and those the strategy's optimizer steps, with their parameters (their
        new values are written back to the shards; the offload publishes its own). See [Note:
        optimizer offload seam]."""
        pairs = [
            (p, st, self.master[st.id]) for p, st in zip(self.params, self.records) if st.id in self.master
        ]
        self.offloaded = {st.id: m for _, st, m in pairs if self.offload.owns(m)}
        self._device_written = [(p, st, m) for p, st, m in pairs if st.id not in self.offloaded]
        self._offloaded_steps = [(st, m) for _, st, m in pairs if st.id in self.offloaded]
        self._device_steps = [(st, m) for _, st, m in self._device_written]

    def _optimizer_state(self, m: torch.Tensor) -> dict[str, Any]:
        return self.offload.state_of(self.optimizer, m)

    def close(self) -> None:
        """Release offload resources (swap files) and the parameters' owner entries; the engine's
        ``destroy()`` calls it."""
        release_owner(self.params, self._state_access)
        for st in self.records:  # a later engine over the same parameters stays their owner
            if st.owner is self._owner_ref:
                st.owner = None
        self.offload.close()
        for store in self.shard_stores():
            store.close()

    # -- stage-3 extras -------------------------------------------------------------------
    def empty_partition_cache(self) -> None:
        """Release every gathered parameter, persistent ones included (they return on next use)."""
        self.wait_reductions()
        self.coordinator.release_all(force=True)
        for p in self.params:
            release_param(p, force=True)
        drop_secondary(self.params)  # hpZ copies are a cache too (See [Note: MiCS and hpZ shard groups])
