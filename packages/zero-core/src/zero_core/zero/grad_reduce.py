"""Bucketed, overlapped reduction of gradients into each rank's partition (ZeRO stages 1 and 2).

[Note: partitioned gradient reduction]
The reduce buckets are the chunks of [Note: padding]: chunk ``c`` of a parameter group is a
contiguous range of that group's flat gradient, and after reduction rank ``r`` needs only
its piece ``r`` of it. One ``reduce_scatter_tensor`` per chunk does exactly that, so a step
moves about Ψ reduce-scattered elements, the same volume as data parallel's all-reduce.
With ``reduce_scatter: false`` a chunk is reduced with one ``all_reduce`` when
``use_multi_rank_bucket_allreduce`` (DeepSpeed's default) or with one ``reduce`` per owning
rank otherwise.

Where gradients live:

* stage 1 (``partition_grads=False``): every parameter's ``.grad`` is a view of one flat,
  padded gradient buffer per group (2Ψ bytes with 16-bit gradients), so autograd
  accumulates micro-batches in place; on the accumulation boundary each chunk is
  reduce-scattered and the rank's piece of the buffer is overwritten with the average.
* stage 2 (``partition_grads=True``): only the rank's shard of the reduced gradient is kept
  (2Ψ/N bytes). Chunks are reduced on *every* micro-step (as DeepSpeed does) and the results
  accumulate in the shard, so full-size gradients never outlive one bucket. With
  ``contiguous_gradients`` a parameter's gradient is copied into its chunk's bucket the moment
  autograd produces it and ``.grad`` is freed at once; without it ``.grad`` is kept until its
  chunk is launched.

With a wider ``data_types.grad_accum_dtype`` (fp32 with bf16/fp16 training) the flat buffer
(stage 1) or the shard (stage 2) has that dtype: stage 1's hook adds each micro-step's gradient
into it and frees ``.grad``, stage 2 adds each reduced piece into it; the buckets stay in the
communication dtype (see [Note: gradient accumulation dtype] in ``engine/grad_buckets.py``).

Each group carries the process group it is reduced and partitioned over (its layout is cut
for that group's size): the data-parallel group for dense parameters, the expert-data-parallel
group for Mixture-of-Experts expert parameters (see [Note: expert parameters] in
``utils/param_groups.py``). Every gradient is divided by the *data-parallel* world size
whichever group reduces it, because the loss is the mean over all data-parallel ranks.

Ordering and overlap follow [Note: gradient buckets] in ``engine/grad_buckets.py``: chunks
are launched strictly in one global order (by backward order of their parameters) so every
rank issues the same sequence of collectives; with ``overlap_comm`` a chunk is launched from
the post-accumulate-grad hook as soon as it and all chunks before it are complete, and at
most ``_MAX_IN_FLIGHT`` chunks are in flight (older ones are waited for), which bounds the
bucket buffers to a few bucket sizes; stage 2 keeps one of them between backward passes (as DDP
keeps its buckets), so a step does not pay for allocating and zero-filling a fresh bucket. Whatever is left is launched by ``finish()``. A
parameter that produced no gradient contributes zeros, so unused parameters never hang;
with ``ignore_unused_parameters: false`` they are reported instead (see ``finish``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zero_core import comm
from zero_core.zero.flat_partition import Chunk, FlatPartition

_MAX_IN_FLIGHT = 2


@dataclass
class GroupGrads:
    """Trainable parameters partitioned together, in flat order, and their layout.

    ``group`` is the process group they are reduced and partitioned over (the layout's
    ``world_size`` is its size); ``opt_group`` the index of the optimizer param group they
    belong to (one optimizer group may hold dense and expert partitions).
    """

    params: list[torch.nn.Parameter]
    names: list[str]
    layout: FlatPartition
    group: dist.ProcessGroup | None = None
    opt_group: int = 0


@dataclass
class _Pending:
    g: int
    chunk: Chunk
    inp: torch.Tensor
    out: torch.Tensor
    works: list[Any] = field(default_factory=list)


class PartitionedGradReducer:
    """Reduces the gradients of ``groups`` so each rank ends with its shard; see the Note above."""

    def __init__(
        self,
        groups: Sequence[GroupGrads],
        *,
        group: dist.ProcessGroup | None = None,
        partition_grads: bool,
        overlap_comm: bool,
        contiguous_gradients: bool = True,
        reduce_scatter: bool = True,
        use_multi_rank_bucket_allreduce: bool = True,
        ignore_unused_parameters: bool = True,
        comm_dtype: torch.dtype | None = None,
        backward_order: dict[int, int] | None = None,
        accum_dtype: torch.dtype | None = None,
    ) -> None:
        self.groups = list(groups)
        self.group = group
        # the divisor of every gradient: the data-parallel world size (see the Note)
        self.world_size = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        for g, gg in enumerate(self.groups):
            if gg.layout.world_size != comm.get_world_size(gg.group):
                raise ValueError(
                    f"PartitionedGradReducer: group {g} has a layout for {gg.layout.world_size} ranks but its "
                    f"process group has {comm.get_world_size(gg.group)}"
                )
        self._group_rank = [comm.get_rank(gg.group) for gg in self.groups]
        self.partition_grads = partition_grads
        self.overlap = overlap_comm
        self.contiguous = contiguous_gradients
        self.use_reduce_scatter = reduce_scatter
        self.multi_rank_allreduce = use_multi_rank_bucket_allreduce
        self.ignore_unused = ignore_unused_parameters
        self.comm_dtype = comm_dtype
        self._global_ranks = [
            [
                comm.get_global_rank(gg.group, r) if gg.group is not None else r
                for r in range(gg.layout.world_size)
            ]
            for gg in self.groups
        ]
        self._plan_launch_order(backward_order or {})
        # Spent bucket buffers kept for the next chunks (see _bucket): at most _MAX_IN_FLIGHT + 1
        # are alive at once, so reusing them saves an allocation (and its page faults) per chunk.
        # finish() keeps one for the next backward, as DDP keeps its buckets and DeepSpeed its
        # reduce buffer: a fresh bucket per step cost stage 2 about 7% of the bench's step CPU
        # time (tools/bench/results/bench_zero12.md). It is listed under "buffers".
        self._spare: list[torch.Tensor] = []

        # Gradient storage (see the Note): stage 1 full flat buffers, stage 2 shards, in the
        # gradients' dtype or the wider accumulation dtype (then .grad is not a view of them).
        self.accum_dtype = accum_dtype
        self._grad_dtypes = [gg.params[0].dtype if gg.params else torch.float32 for gg in self.groups]
        self.flat_grads: list[torch.Tensor] = []
        self.grad_shards: list[torch.Tensor] = []
        for gg, grad_dtype in zip(self.groups, self._grad_dtypes):
            dtype = accum_dtype or grad_dtype
            device = gg.params[0].device if gg.params else torch.device("cpu")
            if partition_grads:
                self.grad_shards.append(torch.zeros(gg.layout.shard_numel, dtype=dtype, device=device))
            else:
                self.flat_grads.append(torch.zeros(gg.layout.padded_numel, dtype=dtype, device=device))
        if not partition_grads and accum_dtype is None:
            self._attach_flat_grads()
        self._shard_has_grad = False
        self.armed = False
        # Called as ``on_reduced(group, shard_offset, values)`` when a chunk's reduced piece has
        # landed in this rank's shard (accumulated, for stage 2): optimizer offload copies it to
        # host memory there, overlapped with the rest of backward (See [Note: gradient staging]
        # in zero_offload's optimizer_offload.py). None: nothing to do.
        self.on_reduced: Callable[[int, int, torch.Tensor], None] | None = None
        self._reset_round()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad) for gg in self.groups for p in gg.params
        ]

    def _plan_launch_order(self, order: dict[int, int]) -> None:
        """Global launch order of the chunks: by the earliest backward position of their params."""
        keyed = []
        for g, gg in enumerate(self.groups):
            for chunk in gg.layout.chunks:
                key = min((order.get(id(gg.params[s.param_index]), 0) for s in chunk.slices), default=0)
                keyed.append((key, g, chunk.index))
        keyed.sort()
        self.order: list[tuple[int, int]] = [(g, c) for _, g, c in keyed]
        self._slot = {gc: i for i, gc in enumerate(self.order)}
        # param id -> (group, param index, [slots of the chunks holding it])
        self._where: dict[int, tuple[int, int, list[int]]] = {}
        for g, gg in enumerate(self.groups):
            for i, p in enumerate(gg.params):
                slots = [self._slot[(g, c.index)] for c, _ in gg.layout.chunks_of_param(i)]
                self._where[id(p)] = (g, i, slots)
        self._needed = [len(self.groups[g].layout.chunks[c].slices) for g, c in self.order]
        # param id -> [(slot, chunk_lo, param_lo, numel)]: where the hook copies a gradient into
        # buckets, computed once (the hook runs for every parameter on every micro-step)
        self._copies: dict[int, list[tuple[int, int, int, int]]] = {}
        for g, gg in enumerate(self.groups):
            for i, p in enumerate(gg.params):
                self._copies[id(p)] = [
                    (self._slot[(g, c.index)], s.chunk_lo, s.param_lo, s.numel)
                    for c, _ in gg.layout.chunks_of_param(i)
                    for s in c.slices
                    if s.param_index == i
                ]

    # -- storage ----------------------------------------------------------------------------
    def _grad_view(self, g: int, i: int) -> torch.Tensor:
        gg = self.groups[g]
        off = gg.layout.offsets[i]
        p = gg.params[i]
        return self.flat_grads[g][off : off + p.numel()].view_as(p)

    def _attach_flat_grads(self) -> None:
        for g, gg in enumerate(self.groups):
            for i, p in enumerate(gg.params):
                p.grad = self._grad_view(g, i)

    def _reset_round(self) -> None:
        self._ready = [0] * len(self.order)
        self._buffers: dict[int, torch.Tensor] = {}
        self._launched_chunks: dict[int, int] = {}  # param id -> chunks launched (non-contiguous stage 2)
        self._next = 0
        self._pending: deque[_Pending] = deque()
        self._got_grad: set[int] = set()

    def live_buffers(self) -> list[torch.Tensor]:
        """Bucket buffers alive right now (between backward passes: stage 2's one spare bucket); some may be views of
        the flat gradients, which the caller's ledger counts once. See [Note: memory breakdown
        counts storages] in zero_core/utils/storage_bytes.py."""
        return [*self._buffers.values(), *self._spare, *(t for p in self._pending for t in (p.inp, p.out))]

    # -- the round --------------------------------------------------------------------------
    def arm(self, is_boundary: bool) -> None:
        """Prepare for a backward pass: stage 2 reduces every micro-step, stage 1 on boundaries."""
        self._reset_round()
        self.armed = self.partition_grads or is_boundary
        if not self.partition_grads and self.accum_dtype is None:
            # A user's zero_grad(set_to_none=True) detaches .grad from the flat buffer: re-attach.
            for g, gg in enumerate(self.groups):
                for i, p in enumerate(gg.params):
                    view = self._grad_view(g, i)
                    if p.grad is None:
                        view.zero_()
                        p.grad = view
                    elif p.grad.data_ptr() != view.data_ptr():
                        view.copy_(p.grad)
                        p.grad = view

    def _dtype(self, g: int) -> torch.dtype:
        """The dtype chunks are reduced in: ``communication_data_type``, else that of what is reduced
        (stage 1's flat buffer, stage 2's micro-step gradients)."""
        return self.comm_dtype or (self._grad_dtypes[g] if self.partition_grads else self.flat_grads[g].dtype)

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        g, i, slots = self._where[id(param)]
        if not self.partition_grads and self.accum_dtype is not None:
            # See [Note: gradient accumulation dtype]: the sum of the micro-steps in the wide buffer
            self._grad_view(g, i).add_(param.grad)
            param.grad = None
        elif not self.partition_grads:
            view = self._grad_view(g, i)
            if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                # autograd made a fresh tensor (grad was None): it replaces the buffer's content
                view.copy_(param.grad)
                param.grad = view
        if not self.armed:
            return
        self._got_grad.add(id(param))
        if self.partition_grads and self.contiguous:
            flat = param.grad.reshape(-1)
            for slot, chunk_lo, param_lo, numel in self._copies[id(param)]:
                self._bucket(slot)[chunk_lo : chunk_lo + numel].copy_(flat[param_lo : param_lo + numel])
            param.grad = None
        for slot in slots:
            self._ready[slot] += 1
        if self.overlap:
            self._launch_ready()

    def _bucket(self, slot: int) -> torch.Tensor:
        buf = self._buffers.get(slot)
        if buf is None:
            g, c = self.order[slot]
            n, dtype = self.groups[g].layout.chunks[c].padded, self._dtype(g)
            k = next((k for k, t in enumerate(self._spare) if t.numel() >= n and t.dtype == dtype), None)
            if k is not None:
                buf = self._spare.pop(k)[:n]
            else:
                buf = torch.empty(n, dtype=dtype, device=self._device(g))
            # Only the padding is zeroed here: every parameter slice is overwritten by its gradient,
            # or zeroed at launch if its parameter produced none (see _input).
            buf[self.groups[g].layout.chunks[c].numel :].zero_()
            self._buffers[slot] = buf
        return buf

    def _device(self, g: int) -> torch.device:
        return (self.flat_grads[g] if self.flat_grads else self.grad_shards[g]).device

    def _launch_ready(self) -> None:
        while self._next < len(self.order) and self._ready[self._next] >= self._needed[self._next]:
            self._launch(self._next)
            self._next += 1

    def _input(self, slot: int) -> torch.Tensor:
        g, c = self.order[slot]
        gg = self.groups[g]
        chunk = gg.layout.chunks[c]
        if not self.partition_grads:
            inp = self.flat_grads[g][chunk.start : chunk.start + chunk.padded]
            return inp.to(self._dtype(g))  # the buffer itself when the dtypes agree
        buf = self._bucket(slot)
        if self.contiguous:
            if self._ready[slot] < self._needed[slot]:  # some parameters produced no gradient: zeros
                for s in chunk.slices:
                    if id(gg.params[s.param_index]) not in self._got_grad:
                        buf[s.chunk_lo : s.chunk_lo + s.numel].zero_()
        else:
            for s in chunk.slices:
                p = gg.params[s.param_index]
                dst = buf[s.chunk_lo : s.chunk_lo + s.numel]
                if p.grad is not None:
                    dst.copy_(p.grad.reshape(-1)[s.param_lo : s.param_hi])
                else:
                    dst.zero_()
                done = self._launched_chunks.get(id(p), 0) + 1
                self._launched_chunks[id(p)] = done
                if done == len(self._where[id(p)][2]):
                    p.grad = None
        return buf

    def _launch(self, slot: int) -> None:
        g, c = self.order[slot]
        gg = self.groups[g]
        chunk = gg.layout.chunks[c]
        inp = self._input(slot)
        self._buffers.pop(slot, None)
        # Average before summing: keeps fp16 sums in range; exact for power-of-two N.
        inp.div_(self.world_size)
        pend = _Pending(g, chunk, inp, inp)
        rank = self._group_rank[g]
        if self.use_reduce_scatter:
            pend.out = self._scatter_target(g, chunk, inp)
            pend.works.append(comm.reduce_scatter_tensor(pend.out, inp, group=gg.group, async_op=True))
        else:
            pend.out = inp[rank * chunk.piece : (rank + 1) * chunk.piece]
            if self.multi_rank_allreduce:
                pend.works.append(comm.all_reduce(inp, group=gg.group, async_op=True))
            else:
                for r in range(gg.layout.world_size):
                    part = inp[r * chunk.piece : (r + 1) * chunk.piece]
                    pend.works.append(
                        comm.reduce(part, dst=self._global_ranks[g][r], group=gg.group, async_op=True)
                    )
        self._pending.append(pend)
        if self.overlap and len(self._pending) > _MAX_IN_FLIGHT:
            self._complete(self._pending.popleft())

    def _scatter_target(self, g: int, chunk: Chunk, inp: torch.Tensor) -> torch.Tensor:
        """Where the reduce-scatter of ``inp`` writes this rank's piece, with no copy afterwards.

        Stage 2's first micro-step: straight into the gradient shard. Otherwise this rank's own
        piece of ``inp``, the in-place reduce-scatter torch documents (output = input's rank-th
        slice; NCCL reduces in place, gloo through its own scratch), which for stage 1 without a
        ``comm_dtype`` is the flat gradient buffer's own range, so ``_complete`` copies nothing.
        """
        if self.partition_grads and not self._shard_has_grad:
            lo = self.groups[g].layout.shard_offsets[chunk.index]
            dst = self.grad_shards[g][lo : lo + chunk.piece]
            if dst.dtype == inp.dtype:
                return dst
        rank = self._group_rank[g]
        return inp[rank * chunk.piece : (rank + 1) * chunk.piece]

    def _complete(self, pend: _Pending) -> None:
        for w in pend.works:
            w.wait()
        lo = self.groups[pend.g].layout.shard_offsets[pend.chunk.index]
        if self.partition_grads:
            dst = self.grad_shards[pend.g][lo : lo + pend.chunk.piece]
            if self._shard_has_grad:
                dst.add_(pend.out)
            elif dst.data_ptr() != pend.out.data_ptr():
                dst.copy_(pend.out)
        else:
            a, b = pend.chunk.piece_range(self._group_rank[pend.g])
            dst = self.flat_grads[pend.g][a:b]
            if dst.data_ptr() != pend.out.data_ptr():
                dst.copy_(pend.out)
        if self.on_reduced is not None:
            self.on_reduced(pend.g, lo, dst)
        if self.partition_grads and len(self._spare) <= _MAX_IN_FLIGHT:  # a bucket buffer: reuse it
            self._spare.append(pend.inp if pend.inp._base is None else pend.inp._base)

    def finish(self) -> None:
        """Launch what is left in order, wait for everything, and check for unused parameters."""
        if not self.armed:
            return
        while self._next < len(self.order):
            self._launch(self._next)
            self._next += 1
        while self._pending:
            self._complete(self._pending.popleft())
        self._buffers.clear()
        del self._spare[1:]  # one bucket buffer stays for the next backward (see __init__)
        if self.partition_grads:
            self._shard_has_grad = True
            for gg in self.groups:
                for p in gg.params:
                    p.grad = None  # non-contiguous leftovers of params without a chunk launch
        if not self.ignore_unused:
            self._check_unused()
        self.armed = False

    def _check_unused(self) -> None:
        """Raise on every rank, naming them, if some rank produced no gradient for parameters."""
        from zero_core.accelerator import get_accelerator

        # Built on the host, then moved to the backend's device (NCCL reduces GPU tensors only);
        # read back with one copy, not one .item() per parameter.
        flags = torch.tensor(
            [1 if id(p) in self._got_grad else 0 for gg in self.groups for p in gg.params], dtype=torch.uint8
        ).to(get_accelerator().current_device_name())
        if flags.numel() == 0:
            return
        comm.all_reduce(flags, op=comm.ReduceOp.MIN, group=self.group)
        names = [n for gg in self.groups for n in gg.names]
        got = flags.tolist()
        missing = [names[k] for k in range(len(names)) if got[k] == 0]
        if missing:
            raise RuntimeError(
                "ZeRO gradient reduction: these parameters received no gradient on at least one rank in this "
                f"backward pass: {', '.join(missing)}. Set zero_optimization.ignore_unused_parameters to true "
                "to treat their gradients as zero, or make the forward use them (or freeze them with "
                "requires_grad=False before zero.initialize)."
            )

    def zero_grad(self) -> None:
        """Forget the gradients: zero the flat buffers (stage 1) or mark the shards empty (stage 2)."""
        if self.partition_grads:
            self._shard_has_grad = False
            for t in self.grad_shards:
                t.zero_()
            for gg in self.groups:
                for p in gg.params:
                    p.grad = None
        else:
            for t in self.flat_grads:
                t.zero_()
            if self.accum_dtype is None:
                self._attach_flat_grads()

    def shard_grad(self, g: int) -> torch.Tensor:
        """This rank's shard of group ``g``'s reduced gradient (a new tensor for stage 1)."""
        if self.partition_grads:
            return self.grad_shards[g]
        layout = self.groups[g].layout
        rank = self._group_rank[g]
        pieces = [self.flat_grads[g][slice(*c.piece_range(rank))] for c in layout.chunks]
        if not pieces:
            return self.flat_grads[g][:0]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
