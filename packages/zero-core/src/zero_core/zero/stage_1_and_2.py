"""ZeRO stages 1 and 2: optimizer states (and, for stage 2, gradients) partitioned over ranks.

[Note: optimizer on a shard]
The client's real optimizer (Adam, AdamW, SGD with momentum, a user's own) is kept and
wrapped, not re-implemented: each of its parameter groups is rebound to a single flat fp32
``torch.nn.Parameter`` holding this rank's shard of that group (its pieces of the group's
chunks, see [Note: padding]). The optimizer therefore creates states (exp_avg, exp_avg_sq,
momentum_buffer) only for the shard, keeps each group's own hyper-parameters (lr, weight
decay, betas), and LR schedulers drive it unchanged through ``optimizer.param_groups``.
This is exact for element-wise optimizers; one that reduces over a whole tensor (LAMB's
trust ratio) sees the shard as one tensor, as in DeepSpeed.

A step is: reduced gradient shard -> fp32, times ``grad_scale`` (1/loss-scale and the clip
factor, computed by the engine from the global norm) -> ``optimizer.step()`` on the shard ->
the shard is cast to the training dtype and all-gathered into the flat low-precision
parameter buffer of which every module parameter is a view, so the module's parameters are
updated in place with no per-parameter copy. Frozen parameters (``requires_grad=False``) stay
out of all of this: they are neither partitioned nor updated.

[Note: fp32 master aliasing]
With 16-bit training the master shard is a separate fp32 tensor (4Ψ/N bytes). In fp32
training a copy would only duplicate what the flat fp32 parameter buffer already holds, so
when the rank's shard is one contiguous range of that buffer (a single chunk per group: the
reduce bucket is at least the group's size, DeepSpeed's default 5e8 elements) the master
*is* a view of that range: the optimizer updates the module's parameters in place and the
all-gather only fills the other ranks' ranges. Model states per rank are then
4Ψ + (4Ψ + 8Ψ)/N for stage 2 with Adam (4Ψ + 4Ψ + 8Ψ/N for stage 1) instead of
4Ψ + (4Ψ + 4Ψ + 8Ψ)/N. With several chunks a rank's shard is one piece of every chunk
(see [Note: padding]), not a contiguous range of the parameter buffer, and the master stays
a copy; ``master_aliases_params`` says which case holds.

[Note: round_robin_gradients]
DeepSpeed's ``round_robin_gradients`` (stages 1/2, aimed at CPU offload) spreads the copy of
each bucket's gradients to the partitions over the ranks so that no rank copies more than
its share. Our reduce buckets are the chunks of [Note: padding]: every chunk is cut in N
equal pieces and each rank receives and copies exactly its piece of every bucket, so the
work is already split evenly and there is nothing left to rotate. The option is therefore a
no-op by design; it is accepted so DeepSpeed configs run unchanged, and ``True`` warns
(``config/unimplemented.py``'s ``NO_EFFECT``).

``build_flat_masters`` and ``gather_shards`` are the reusable pieces (stage 3 can use them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from zero_core import comm
from zero_core.config.strategy_options import PartitionedOptions
from zero_core.protocols.optimizer_offload import NoOptimizerOffload, OptimizerOffload, add_host_breakdown
from zero_core.utils.grad_norm import any_nonfinite, needs_scaling, sum_of_squares
from zero_core.utils.master_dtype import check_master_dtype
from zero_core.utils.param_groups import reduction_groups
from zero_core.utils.storage_bytes import StorageLedger
from zero_core.utils.tensor_alias import apart_or_slot, overlaps
from zero_core.zero.flat_partition import FlatPartition
from zero_core.zero.grad_reduce import GroupGrads, PartitionedGradReducer
from zero_core.zero.param_owners import ParamLocation, register_owner, release_owner
from zero_core.zero.stage_1_and_2_access import PartitionedStateAccess
from zero_core.zero.stage_1_and_2_checkpoint import PartitionedCheckpointing

if TYPE_CHECKING:
    from zero_core.checkpoint.fragments import CheckpointReader

_T = TypeVar("_T")


class _ScalesLoss(Protocol):
    """What ``bind_loss_scaler`` needs of the engine's loss scaler."""

    @property
    def loss_scale(self) -> float: ...


def _snapshot(obj: _T) -> _T:
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v) for v in obj]
    return obj


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"zero_optimization.{name} must be a positive number of elements, got {value!r}")
    return value


def build_flat_masters(
    layout: FlatPartition,
    params: list[torch.nn.Parameter],
    rank: int,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Parameter:
    """The master shard (fp32, or bf16 with bf16 masters) of ``params`` owned by ``rank`` under
    ``layout``, as a flat Parameter.

    Reads the parameters' current values (call it before they are cast to 16 bits).
    """
    shard = torch.zeros(layout.shard_numel, dtype=dtype, device=params[0].device if params else "cpu")
    for chunk in layout.chunks:
        a, b = chunk.piece_range(rank)
        base = layout.shard_offsets[chunk.index] - a
        for s in chunk.slices:
            lo = max(a, chunk.start + s.chunk_lo)
            hi = min(b, chunk.start + s.chunk_lo + s.numel)
            if hi > lo:
                src = params[s.param_index].detach().reshape(-1)
                p_lo = s.param_lo + lo - (chunk.start + s.chunk_lo)
                shard[base + lo : base + hi].copy_(src[p_lo : p_lo + hi - lo])
    return torch.nn.Parameter(shard)


def gather_shards(
    layout: FlatPartition,
    shard: torch.Tensor,
    flat: torch.Tensor,
    *,
    rank: int,
    group: dist.ProcessGroup | None = None,
    bucket_numel: int | None = None,
    use_all_gather: bool = True,
) -> None:
    """Fill ``flat`` (the padded buffer, any dtype) with every rank's ``shard`` (see [Note: padding]).

    One all-gather per chunk straight into ``flat``; a chunk larger than ``bucket_numel`` is
    gathered in sub-pieces through a bucket-sized scratch buffer. With ``use_all_gather``
    False each rank broadcasts its pieces instead (``allgather_partitions: false``).
    """
    n = layout.world_size
    works = []
    for chunk in layout.chunks:
        so = layout.shard_offsets[chunk.index]
        piece = shard[so : so + chunk.piece].to(flat.dtype)
        region = flat[chunk.start : chunk.start + chunk.padded]
        if not use_all_gather:
            a, b = chunk.piece_range(rank)
            if not overlaps(piece, flat[a:b]):
                flat[a:b].copy_(piece)
            for r in range(n):
                src = comm.get_global_rank(group, r) if group is not None else r
                works.append(
                    comm.broadcast(
                        region[r * chunk.piece : (r + 1) * chunk.piece], src=src, group=group, async_op=True
                    )
                )
            continue
        q = chunk.piece if bucket_numel is None else max(1, bucket_numel // n)
        if chunk.piece <= q:
            # fp32 master aliasing: the piece is usually this rank's own range of ``region``, the
            # in-place all-gather torch documents (input = output's rank-th slice; NCCL gathers in
            # place, gloo through its own scratch), so no copy is made; any other overlap is cloned.
            if not apart_or_slot(region, piece, rank):
                piece = piece.clone()
            works.append(comm.all_gather_into_tensor(region, piece, group=group, async_op=True))
            continue
        for lo in range(0, chunk.piece, q):
            hi = min(lo + q, chunk.piece)
            tmp = torch.empty(n * (hi - lo), dtype=flat.dtype, device=flat.device)
            comm.all_gather_into_tensor(tmp, piece[lo:hi].contiguous(), group=group)
            region.view(n, chunk.piece)[:, lo:hi].copy_(tmp.view(n, hi - lo))
    for w in works:
        w.wait()


def _check_arguments(
    stage: int,
    optimizer: object,
    dtype: torch.dtype,
    reduce_bucket_size: int,
    allgather_bucket_size: int,
    round_robin_gradients: object,
) -> None:
    """Clear errors for the strategy's arguments, before anything is built."""
    if stage not in (1, 2):
        raise ValueError(
            f"PartitionedOptimizerStrategy implements zero_optimization.stage 1 and 2, got {stage!r}"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"ZeRO stage {stage}: optimizer must be a torch.optim.Optimizer, got {type(optimizer)}"
        )
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"ZeRO stage {stage}: training dtype must be fp32, fp16 or bf16, got {dtype}")
    _positive_int(reduce_bucket_size, "reduce_bucket_size")
    _positive_int(allgather_bucket_size, "allgather_bucket_size")
    if len(optimizer.state) > 0:
        raise ValueError(
            f"ZeRO stage {stage}: the optimizer already has state (it has stepped); pass a fresh optimizer, "
            "its states are created on this rank's partition only"
        )
    if not isinstance(round_robin_gradients, bool):
        raise TypeError(
            f"zero_optimization.round_robin_gradients must be true or false, got {round_robin_gradients!r}"
        )


def _partition_groups(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    stage: int,
    group: dist.ProcessGroup | None,
    reduce_bucket_size: int,
) -> tuple[list[GroupGrads], dict[int, int]]:
    """One :class:`GroupGrads` per (optimizer param group, reduction group), its parameters in
    backward order, and that order (parameter id -> position)."""
    names = {id(p): n for n, p in module.named_parameters()}
    registration = [p for p in module.parameters()]
    backward_order = {id(p): k for k, p in enumerate(reversed(registration))}
    in_groups: set[int] = set()
    groups: list[GroupGrads] = []
    for gi, pg in enumerate(optimizer.param_groups):
        params = []
        for p in pg["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"ZeRO stage {stage}: optimizer param_groups[{gi}] holds a tensor of shape {tuple(p.shape)} "
                    "that is not a parameter of the model"
                )
            in_groups.add(id(p))
            if p.requires_grad:
                params.append(p)
        params.sort(key=lambda p: backward_order[id(p)])  # flat order = backward order
        # dense and expert parameters are partitioned over different process groups
        # (see [Note: expert parameters] in utils/param_groups.py)
        split = reduction_groups(params, group) or [(group, [])]
        for comm_group, ps in split:
            layout = FlatPartition(
                [p.numel() for p in ps], comm.get_world_size(comm_group), reduce_bucket_size
            )
            groups.append(GroupGrads(ps, [names[id(p)] for p in ps], layout, comm_group, gi))
    orphans = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in in_groups]
    if orphans:
        raise ValueError(
            f"ZeRO stage {stage} partitions the optimizer's parameters, but these trainable parameters are in "
            f"no optimizer param group: {', '.join(orphans)}. Add them to the optimizer or freeze them "
            "(requires_grad=False) before zero.initialize."
        )
    return groups, backward_order


class PartitionedOptimizerStrategy:
    """The :class:`~zero_core.engine.strategy.TrainingStrategy` of ZeRO stages 1 and 2.

    See [Note: optimizer on a shard] and [Note: partitioned gradient reduction]. Its parts are
    held, not mixed in: ``checkpointing`` (:class:`PartitionedCheckpointing`, checkpoint
    fragments) and ``state_access`` (:class:`PartitionedStateAccess`, the safe_get / safe_set
    owner of its parameters).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        options: PartitionedOptions,
        *,
        group: dist.ProcessGroup | None = None,
        optimizer_offload: OptimizerOffload | None = None,
    ) -> None:
        _check_arguments(
            options.stage,
            optimizer,
            options.dtype,
            options.reduce_bucket_size,
            options.allgather_bucket_size,
            options.round_robin_gradients,
        )
        check_master_dtype(
            options.master_dtype,
            options.dtype,
            f"ZeRO stage {options.stage}",
            offloaded=optimizer_offload is not None,
        )
        self.stage = options.stage
        self.master_dtype = options.master_dtype  # See [Note: bf16 master weights]
        self.module = module
        self.optimizer = optimizer
        self.group = group
        self.dtype = options.dtype
        self.world_size = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.allgather_bucket_size = options.allgather_bucket_size
        self.allgather_partitions = options.allgather_partitions
        # a no-op: see [Note: round_robin_gradients]
        self.round_robin_gradients = options.round_robin_gradients
        self._loss_scaler: _ScalesLoss | None = None  # see bind_loss_scaler
        groups, backward_order = _partition_groups(
            module, optimizer, options.stage, group, options.reduce_bucket_size
        )
        self.groups = groups
        self._ranks = [comm.get_rank(gg.group) for gg in groups]  # this rank within each group's group
        # See [Note: optimizer offload hook] in zero_offload; the null object when nothing is
        # offloaded (See [Note: optimizer offload seam])
        self.checkpointing = PartitionedCheckpointing(self)  # its checkpoint methods delegate there
        self.state_access = PartitionedStateAccess(self)  # the owner: See [Note: parameter owners]
        self.offload: OptimizerOffload = (
            optimizer_offload if optimizer_offload is not None else NoOptimizerOffload()
        )
        self._build_flat_buffers()
        self.reducer = PartitionedGradReducer(
            groups,
            group=group,
            partition_grads=options.stage == 2,
            overlap_comm=options.overlap_comm,
            contiguous_gradients=options.contiguous_gradients,
            reduce_scatter=options.reduce_scatter,
            use_multi_rank_bucket_allreduce=options.use_multi_rank_bucket_allreduce,
            ignore_unused_parameters=options.ignore_unused_parameters,
            comm_dtype=options.comm_dtype,
            backward_order=backward_order,
            accum_dtype=options.accum_dtype,
        )

    def _build_flat_buffers(self) -> None:
        """Masters (fp32, or bf16: See [Note: bf16 master weights]) from the still-fp32 parameters,
        then the flat low-precision parameter buffers the parameters become views of (See
        [Note: fp32 master aliasing]: a master of the training dtype is a view of them)."""
        self.masters: list[torch.nn.Parameter] = []
        self.flat_params: list[torch.Tensor] = []
        # See [Note: parameter owners].
        self._param_locations: dict[torch.nn.Parameter, ParamLocation] = {}
        # See [Note: fp32 master aliasing].
        # With optimizer offload the masters live in host memory: never aliased (``adopt`` copies
        # them there; the flag is recomputed after it).
        groups, dtype = self.groups, self.dtype
        self.master_aliases_params = dtype == self.master_dtype and all(
            len(gg.layout.chunks) <= 1 for gg in groups
        )
        with torch.no_grad():
            for g, gg in enumerate(groups):
                if not self.master_aliases_params:
                    self.masters.append(
                        build_flat_masters(gg.layout, gg.params, self._ranks[g], self.master_dtype)
                    )
                device = gg.params[0].device if gg.params else torch.device("cpu")
                flat = torch.zeros(gg.layout.padded_numel, dtype=dtype, device=device)
                for i, p in enumerate(gg.params):
                    off = gg.layout.offsets[i]
                    view = flat[off : off + p.numel()].view_as(p)
                    view.copy_(p.detach())
                    p.data = view
                    self._param_locations[p] = ParamLocation(g, i)
                self.flat_params.append(flat)
                if self.master_aliases_params:
                    a = self._ranks[g] * gg.layout.shard_numel
                    self.masters.append(torch.nn.Parameter(flat[a : a + gg.layout.shard_numel]))
            register_owner(self._param_locations, self.state_access)
            before = self.masters
            self.masters = [self.offload.adopt([m])[0] for m in before]
            self.master_aliases_params &= all(a is m for a, m in zip(self.masters, before))
            # who steps each group's master, decided once: the offload (every master with
            # offload_optimizer) or the strategy's optimizer (See [Note: optimizer offload seam])
            owned = [self.offload.owns(m) for m in self.masters]
            self._offloaded_groups = [g for g, o in enumerate(owned) if o]
            self._device_groups = [g for g, o in enumerate(owned) if not o]
            self._bind_optimizer_groups()
            self.offload.finalize(self.optimizer)
            if dtype != torch.float32:
                self.module.to(dtype)  # frozen parameters and floating buffers; flat views are already cast

    def _bind_optimizer_groups(self) -> None:
        """Point every optimizer param group at the flat master shards of its partitions."""
        for k, pg in enumerate(self.optimizer.param_groups):
            pg["params"] = [m for m, gg in zip(self.masters, self.groups) if gg.opt_group == k]

    def bind_loss_scaler(self, loss_scaler: _ScalesLoss | None) -> None:
        """Let the debugging getters unscale fp16 gradients (``loss_scaler.loss_scale``).

        The engine calls it; without it gradients are returned as reduced (still scaled).
        """
        if loss_scaler is not None and not hasattr(loss_scaler, "loss_scale"):
            raise TypeError(
                f"bind_loss_scaler: expected an object with a 'loss_scale' attribute, got {type(loss_scaler).__name__}"
            )
        self._loss_scaler = loss_scaler

    def _loss_scale(self) -> float:
        return float(self._loss_scaler.loss_scale) if self._loss_scaler is not None else 1.0

    # -- TrainingStrategy --------------------------------------------------------------
    def before_backward(self, is_boundary: bool) -> None:
        self.reducer.arm(is_boundary)
        self.offload.begin_staging(is_boundary)  # See [Note: gradient staging] in zero_offload
        self.reducer.on_reduced = self._stage_reduced if is_boundary else None

    def _stage_reduced(self, g: int, lo: int, values: torch.Tensor) -> None:
        self.offload.stage_grad_range(self.masters[g], lo, values)

    def after_backward(self, is_boundary: bool) -> None:
        self.reducer.finish()

    def _shard_grads(self) -> list[torch.Tensor]:
        return [self.reducer.shard_grad(g) for g in range(len(self.groups))]

    def local_overflow(self) -> torch.Tensor:
        """A device flag (0-dim bool): does this rank's gradient shard hold an inf or a NaN?"""
        return any_nonfinite(self._shard_grads())

    def grad_norm_sq(self) -> torch.Tensor:
        # fused, in fp32, on the device: See [Note: scalars stay on the device in the step]
        return sum_of_squares(self._shard_grads())

    def norm_group(self) -> dist.ProcessGroup | None:
        return self.group if self.group is not None else dist.GroupMember.WORLD

    @torch.no_grad()
    def step(self, grad_scale: float | torch.Tensor) -> None:
        for g in self._offloaded_groups:
            m = self.masters[g]
            if not self.offload.is_staged(m):  # not already copied during backward
                self.offload.stage_grad(m, self.reducer.shard_grad(g))
        for g in self._device_groups:
            m = self.masters[g]
            # gradients of the master's dtype (fp32, or bf16 with bf16 masters) are scaled in place:
            # they are zeroed right after the step anyway
            grad = self.reducer.shard_grad(g).to(m.dtype)
            if needs_scaling(grad_scale):
                grad.mul_(grad_scale)
            m.grad = grad
        if self._device_groups:  # an offload owning every master steps them itself
            self.optimizer.step()
        self.offload.step(self.optimizer, grad_scale)
        for m in self.masters:
            m.grad = None
        self._publish_params()

    def _publish_params(self) -> None:
        """Cast each rank's updated shard and all-gather it into the module's parameters."""
        for g, gg in enumerate(self.groups):
            gather_shards(
                gg.layout,
                self.offload.updated(self.masters[g]),  # the null offload: the master itself
                self.flat_params[g],
                rank=self._ranks[g],
                group=gg.group,
                bucket_numel=self.allgather_bucket_size,
                use_all_gather=self.allgather_partitions,
            )

    def zero_grad(self) -> None:
        self.reducer.zero_grad()
        self.offload.begin_staging(True, prefetch=False)  # a skipped step must not leave staged gradients
        for m in self.masters:
            m.grad = None

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of the distinct live storages by category; a storage is counted once, in the first
        category holding it (fp32 masters that alias the parameters count as parameters).
        With optimizer offload the host-side pools are reported under ``host_*`` keys.
        See [Note: memory breakdown counts storages] in zero_core/utils/storage_bytes.py."""
        state = [
            t
            for m, s in self.optimizer.state.items()
            if not self.offload.owns(m)
            for t in s.values()
            if torch.is_tensor(t)
        ]
        grads = [*self.reducer.flat_grads, *self.reducer.grad_shards]
        grads += [p.grad for p in self.module.parameters() if p.grad is not None]
        grads += [m.grad for m in self.masters]
        # offloaded masters/states/grads are host-side: kept out of the device-side categories
        ledger = StorageLedger(exclude=self.offload.owned_tensors())
        ledger.add("parameters", [*self.flat_params, *self.module.parameters()])
        ledger.add("gradients", grads)
        ledger.add("master_weights", self.masters)
        ledger.add("optimizer_states", state)
        ledger.add("buffers", self.reducer.live_buffers())
        out = ledger.categories
        add_host_breakdown(out, self.offload, self.optimizer, ledger.count)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "zero_stage": self.stage,
            "world_size": self.world_size,
            "rank": self.rank,
            "layout": [
                [gg.layout.numel, gg.layout.padded_numel, len(gg.layout.chunks)] for gg in self.groups
            ],
            # a snapshot (torch's optimizer state_dict shares the live state tensors)
            "optimizer": _snapshot(self.optimizer.state_dict()),
            "master": [m.detach().clone() for m in self.masters],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state saved by the same rank of a run with the same layout (collective)."""
        if not isinstance(state, dict) or "master" not in state or "optimizer" not in state:
            raise ValueError("ZeRO stage 1/2 load_state_dict: expected the dict returned by state_dict()")
        mine = [[gg.layout.numel, gg.layout.padded_numel, len(gg.layout.chunks)] for gg in self.groups]
        if (
            int(state.get("world_size", -1)) != self.world_size
            or [list(x) for x in state.get("layout", [])] != mine
        ):
            raise ValueError(
                f"ZeRO stage 1/2 load_state_dict: the state was saved with world_size {state.get('world_size')} and "
                f"layout {state.get('layout')}; this run has world_size {self.world_size} and layout {mine} "
                "(same world size, model, param groups and reduce_bucket_size are required)"
            )
        if int(state.get("rank", self.rank)) != self.rank:
            raise ValueError(
                f"ZeRO stage 1/2 load_state_dict: the state belongs to rank {state['rank']}, this is rank {self.rank}"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self._bind_optimizer_groups()
        with torch.no_grad():
            for m, saved in zip(self.masters, state["master"]):
                if saved.shape != m.shape:
                    raise ValueError(
                        f"ZeRO stage 1/2 load_state_dict: master shard shape {tuple(saved.shape)} "
                        f"!= {tuple(m.shape)}"
                    )
                m.copy_(saved)
        self._publish_params()

    # -- checkpointing: delegated to PartitionedCheckpointing ----------------------------------
    def checkpoint_fragments(self, exclude_frozen_parameters: bool = False) -> list[Any]:
        """See :meth:`PartitionedCheckpointing.checkpoint_fragments`."""
        return self.checkpointing.checkpoint_fragments(exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint_fragments(
        self,
        reader: CheckpointReader,
        *,
        load_optimizer_states: bool = True,
        load_module_only: bool = False,
        strict: bool = True,
    ) -> None:
        """See :meth:`PartitionedCheckpointing.load_checkpoint_fragments` (collective)."""
        self.checkpointing.load_checkpoint_fragments(
            reader,
            load_optimizer_states=load_optimizer_states,
            load_module_only=load_module_only,
            strict=strict,
        )

    # -- optimizer offload (zero-offload; see [Note: optimizer offload hook] there) ----------
    def _optimizer_state(self, g: int) -> dict[str, Any]:
        """Group ``g``'s optimizer state in torch's format, read from its offload store if any."""
        return self.offload.state_of(self.optimizer, self.masters[g])

    def close(self) -> None:
        """Release offload resources (swap files) and the parameters' owner entries; the engine's
        ``destroy()`` calls it."""
        release_owner(self._param_locations, self.state_access)
        self.offload.close()
