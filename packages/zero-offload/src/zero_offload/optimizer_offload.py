"""``OptimizerOffload``: fp32 masters, gradients and optimizer states off the device; the step on CPU.

[Note: optimizer offload hook]
The ZeRO strategies of zero-core keep their partitioning, reductions and parameter
publication; for the parameters they hand over (``adopt``), this object owns everything the
optimizer step touches:

* the fp32 master shard, in one flat host buffer per optimizer param group (pinned when
  ``pin_memory`` and CUDA is present); the strategy binds the client optimizer's
  ``param_groups`` to views of it, so LR schedulers and per-group hyper-parameters work
  unchanged and checkpoints see ordinary masters;
* a host copy of the reduced gradient shard (``stage_grad``: a non-blocking device->host copy
  into pinned memory on CUDA, fenced by an event; see [Note: offload copies]);
* the optimizer states: host flat buffers (``device: cpu``), exposed to the client optimizer's
  ``state`` as views in torch's own format, or NVMe swap files streamed through a buffer pool
  (``device: nvme``, see [Note: tile pipeline]);
* the step: zero-ops' CPUAdam kernel over ``sub_group_size`` tiles, fused with the cast of the
  updated weights to the training dtype (``low_precision_out``); on CUDA each finished tile is
  copied back to a device buffer while the next one is computed.

The client optimizer never steps these masters (their ``.grad`` stays None, which torch's
optimizers skip), so ``ratio < 1`` simply leaves some masters out of ``adopt`` and the
client optimizer updates those on the device. Only Adam/AdamW (torch's, or zero-ops' CPUAdam)
can be offloaded, as in DeepSpeed; the math is torch's, so trajectories match a
non-offloaded run to fp32 rounding.

This module holds construction, gradient staging and accounting; the step is in
``offload_step``, state and checkpoint access in ``offload_state``, the host buffers and
Adam settings in ``offload_groups``, the arrays ZeRO-Infinity streams through swap files
(masters, gradients) in ``offload_stream`` ([Note: ZeRO-Infinity streaming]).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from zero_core.protocols.optimizer_offload import MasterSource, master_values

from zero_offload.host_heap import bound_host_heap
from zero_offload.nvme_swapper import BufferPool, StateSwapper, buffers_needed, round_tile
from zero_offload.offload_groups import _GRAD, _MASTER, _adam_settings, _bytes, _Group, _host_empty
from zero_offload.offload_state import OffloadStateMixin
from zero_offload.offload_step import OffloadStepMixin
from zero_offload.offload_stream import OffloadStreamMixin
from zero_offload.swap_files import SwapDirectory, aio_handle_settings
from zero_offload.transfers import CopyFence

if TYPE_CHECKING:
    from zero_core.config import ZeroOptimizationConfig
    from zero_core.config.builtin_sections import AioConfig


class OptimizerOffload(OffloadStepMixin, OffloadStateMixin, OffloadStreamMixin):
    """See [Note: optimizer offload hook].

    Args:
        device: ``"cpu"`` or ``"nvme"`` (``offload_optimizer.device``).
        rank: this rank in the data-parallel group (names the swap directory).
        compute_device: where the model's parameters and gradients live (the "device side").
        low_precision_dtype: the training dtype; when not fp32 the step also writes the updated
            weights in it (the fused copy-out).
        sub_group_size: elements per tile of the step (and per NVMe transfer).
        nvme_path, buffer_count, pin_memory, pipeline_read, pipeline_write, fast_init: the
            ``offload_optimizer`` settings; ``aio``: the ``aio`` config section as a dict.
        masters_on_nvme: with ``device="nvme"``, swap the fp32 masters and the gradients with
            the states (ZeRO-Infinity; see [Note: masters on NVMe] and [Note: ZeRO-Infinity streaming]).
    """

    def __init__(
        self,
        device: str,
        *,
        rank: int = 0,
        compute_device: torch.device | str = "cpu",
        low_precision_dtype: torch.dtype = torch.float32,
        sub_group_size: int = 1_000_000_000,
        nvme_path: str | None = None,
        buffer_count: int = 4,
        pin_memory: bool = False,
        pipeline_read: bool = False,
        pipeline_write: bool = False,
        fast_init: bool = False,
        aio: dict[str, Any] | None = None,
        masters_on_nvme: bool = False,
    ) -> None:
        if device not in ("cpu", "nvme"):
            raise ValueError(
                f'zero_optimization.offload_optimizer.device must be "cpu" or "nvme", got {device!r}'
            )
        if isinstance(sub_group_size, bool) or not isinstance(sub_group_size, int) or sub_group_size < 1:
            raise ValueError(
                f"zero_optimization.sub_group_size must be a positive int, got {sub_group_size!r}"
            )
        if low_precision_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(
                f"OptimizerOffload: training dtype must be fp32, fp16 or bf16, got {low_precision_dtype}"
            )
        self.device = device
        self.rank = int(rank)
        self.compute_device = torch.device(compute_device)
        self.low_dtype = low_precision_dtype
        self.tile = sub_group_size
        self.pin = bool(pin_memory)
        self.pipeline_read = bool(pipeline_read)
        self.pipeline_write = bool(pipeline_write)
        self.fast_init = bool(fast_init)
        # See [Note: masters on NVMe]
        self.masters_on_nvme = bool(masters_on_nvme) and device == "nvme"
        self.groups: list[_Group] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(master) -> (group, index)
        self._staged: set[int] = set()
        self._partial: dict[int, int] = {}  # id(master) -> elements staged so far by pieces
        self.staged_during_backward = 0  # masters whose gradient copy overlapped backward
        self.staged_in_step = 0  # masters whose gradient step() had to copy itself
        self._finalized = False
        # events behind the device->host gradient copies and the host->device weight copies
        self.grads_landed = CopyFence()
        self.copied_back = CopyFence()
        self.swap_dir: SwapDirectory | None = None
        self.pool: BufferPool | None = None
        self._prefetch_io: list[Any] = []  # aio handles of [Note: optimizer state prefetch]
        self._reserving = False  # this backward may reserve spare pool buffers for its tiles
        self.buffer_count = buffer_count
        self._aio_kw = aio_handle_settings(aio)  # every aio handle made here takes these
        if device == "nvme":
            if nvme_path is None:
                raise ValueError(
                    'zero_optimization.offload_optimizer.nvme_path: required when device is "nvme"'
                )
            if isinstance(buffer_count, bool) or not isinstance(buffer_count, int):
                raise ValueError(
                    f"zero_optimization.offload_optimizer.buffer_count must be an int, got {buffer_count!r}"
                )
            need = buffers_needed(self.pipeline_read, self.pipeline_write)
            if buffer_count < need:
                raise ValueError(
                    f"zero_optimization.offload_optimizer.buffer_count is {buffer_count}, but pipeline_read="
                    f"{self.pipeline_read} and pipeline_write={self.pipeline_write} need at least {need} buffers"
                )
            self.swap_dir = SwapDirectory(nvme_path, self.rank, what="zero_optimization.offload_optimizer")
            bound_host_heap()  # See [Note: host heap under NVMe offload]

    # -- construction ---------------------------------------------------------------------
    @torch.no_grad()
    def adopt(self, sources: Sequence[torch.Tensor | MasterSource]) -> list[torch.nn.Parameter]:
        """fp32 masters initialised from ``sources``; one call per param group. Host masters are
        views of one flat buffer; with masters on NVMe each source is read and written to the
        swap file in turn (See [Note: ZeRO-Infinity streaming])."""
        if self._finalized:
            raise RuntimeError("OptimizerOffload.adopt: called after finalize()")
        g = _Group(len(self.groups), [int(s.numel()) for s in sources])
        if self.masters_on_nvme:
            self._adopt_streamed(g, sources)
            self.groups.append(g)
            return g.params
        with_low = self.low_dtype != torch.float32
        # The copy endpoints (staged gradients, the weights copied back) are pinned whatever
        # ``pin_memory`` says, the rest only when asked: See [Note: offload copies]
        g.master = _host_empty(g.numel, torch.float32, self.pin or not with_low)
        g.grad = _host_empty(g.numel, torch.float32, True)
        if with_low:
            g.low = _host_empty(g.numel, self.low_dtype, True)
        for i, s in enumerate(sources):
            lo, hi = g.offsets[i], g.offsets[i + 1]
            values = master_values(s).detach().reshape(-1)
            g.master[lo:hi].copy_(values)
            if g.low is not None:
                g.low[lo:hi].copy_(values)
            del values
            p = torch.nn.Parameter(g.master[lo:hi].view(s.shape))
            g.params.append(p)
            self._where[id(p)] = (g.index, i)
        if self.compute_device.type == "cuda":
            g.device_low = torch.empty(g.numel, dtype=self.low_dtype, device=self.compute_device)
            g.device_low.copy_(g.low if g.low is not None else g.master)
        self.groups.append(g)
        return g.params

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        """Allocate the optimizer states (host or swap files) once every group is adopted."""
        if self._finalized:
            return
        self._finalized = True
        names_per_group = []
        for g in self.groups:
            amsgrad = False
            for gi, pg in enumerate(optimizer.param_groups):
                if any(p is q for p in pg["params"] for q in g.params[:1]):
                    amsgrad = _adam_settings(optimizer, pg, gi)["amsgrad"]
            names_per_group.append(
                ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
            )
        if self.device == "cpu":
            for g, names in zip(self.groups, names_per_group):
                g.states = {k: _host_empty(g.numel, torch.float32, self.pin) for k in names}
                for i, p in enumerate(g.params):
                    lo, hi = g.offsets[i], g.offsets[i + 1]
                    state = {"step": torch.tensor(0.0)}
                    state.update({k: v[lo:hi].view(p.shape) for k, v in g.states.items()})
                    optimizer.state[p] = state
            return
        streamed = (_MASTER, _GRAD) if self.masters_on_nvme else ()  # See [Note: ZeRO-Infinity streaming]
        names_per_group = [(*n, *streamed) for n in names_per_group]
        tile = round_tile(min(self.tile, max((g.numel for g in self.groups), default=1)))
        nstates = max((len(n) for n in names_per_group), default=2)
        self.nvme_tile = tile
        self.pool = BufferPool(self.buffer_count, tile * nstates)
        from zero_ops.aio import AsyncIOHandle

        self.read_handle = AsyncIOHandle(**self._aio_kw)
        self.write_handle = AsyncIOHandle(**self._aio_kw)
        for g, names in zip(self.groups, names_per_group):
            g.swapper = StateSwapper(
                self.swap_dir,
                f"optim_group{g.index}",
                g.numel,
                names,
                tile_numel=tile,
                pool=self.pool,
                read_handle=self.read_handle,
                write_handle=self.write_handle,
                pipeline_read=self.pipeline_read,
                pipeline_write=self.pipeline_write,
                fast_init=self.fast_init,
                preallocated=streamed,  # written by adopt / by the gradient staging
                read_only=(_GRAD,),
            )
            for p in g.params:
                optimizer.state[p] = {"step": torch.tensor(0.0)}

    # -- per step ---------------------------------------------------------------------------
    def owns(self, master: torch.Tensor) -> bool:
        return id(master) in self._where

    def stage_grad(self, master: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Copy ``master``'s reduced gradient shard to host memory (None: no gradient this step);
        a master not offloaded keeps its gradient with the strategy (See [Note: optimizer offload seam])."""
        if id(master) not in self._where:
            return
        g, i = self._where[id(master)]
        grp = self.groups[g]
        if grad is None:
            self._staged.discard(id(master))
            return
        lo, hi = grp.offsets[i], grp.offsets[i + 1]
        if grad.numel() != hi - lo:
            raise ValueError(
                f"OptimizerOffload.stage_grad: gradient has {grad.numel()} elements, master has {hi - lo}"
            )
        if self.masters_on_nvme:  # See [Note: ZeRO-Infinity streaming]
            self._drain_grads()  # a restage must not race an earlier write of the same range
            self._stage_streamed(grp, lo, grad)
        else:
            grp.grad[lo:hi].copy_(grad.detach().reshape(-1), non_blocking=True)
            self.grads_landed.mark()  # step() waits for it: See [Note: offload copies]
        self._staged.add(id(master))
        self.staged_in_step += 1

    # [Note: gradient staging]
    # The reducers of zero-core call back (``on_reduced``) as each reduced gradient bucket
    # lands in the rank's shard; on the accumulation-boundary backward the strategies forward
    # that here, so the device->host copy of a finished bucket runs while autograd computes
    # the gradients of earlier layers (non-blocking from pinned memory on CUDA), and step()
    # copies only what no bucket delivered (``is_staged``). ``begin_staging`` at every backward
    # and at ``zero_grad`` forgets partial copies, so an overflow-skipped step never leaks stale
    # gradients into the next one.
    def begin_staging(self, is_boundary: bool, prefetch: bool = True) -> None:
        """A backward pass starts (``is_boundary``: its reductions complete the step's gradients);
        ``prefetch=False``: ``zero_grad`` forgets staged gradients, no backward follows yet."""
        self._staged.clear()
        self._partial.clear()
        self._reserving = is_boundary and prefetch and self.pool is not None
        for g in self.groups:
            if g.swapper is not None:
                g.swapper.new_backward()

    def _reserve(self, sw: StateSwapper, k: int) -> bool:
        """Whether tile ``k`` of ``sw`` has a pool buffer for the step: one it holds, or a spare
        one taken now, its states' read started (See [Note: optimizer state prefetch])."""
        if k in sw.prefetched:
            return True
        if not self._reserving:
            return False
        assert self.pool is not None
        self.pool.settle()  # the last step's writes: See [Note: writes behind the step]
        spare = self.buffer_count - buffers_needed(self.pipeline_read, self.pipeline_write)
        if spare < 1:
            return False
        if len(self.pool.reserved) >= spare:  # the rest belong to the step's pipeline
            # a smaller tile gives its buffer up: the most gradient bytes stay off the disk (a
            # group's last, partial tile is the first one backward reaches)
            size = sw.tile_size(k)
            held = [(s.tile_size(j), i, s, j) for i, s in enumerate(self._swappers()) for j in s.prefetched]
            smallest = min(held, key=lambda t: t[:2], default=None)
            if smallest is None or smallest[0] >= size:
                return False
            smallest[2].release(smallest[3])
        idle = self.pool.idle()
        busy = {id(h) for sw_ in self._swappers() for _, h in sw_.prefetched.values()}
        handle = next((h for h in self._prefetch_io if id(h) not in busy), None)
        if handle is None:
            from zero_ops.aio import AsyncIOHandle

            handle = AsyncIOHandle(**self._aio_kw)
            self._prefetch_io.append(handle)
        sw.prefetch(k, idle[0], handle)
        return True

    def _swappers(self) -> list[StateSwapper]:
        return [g.swapper for g in self.groups if g.swapper is not None]

    def _reserve_range(self, grp: _Group, lo: int, hi: int) -> None:
        """Reserve the tiles holding elements ``[lo, hi)`` of ``grp`` whose gradients land now."""
        sw = grp.swapper
        if sw is not None and hi > lo:
            for k in range(sw.tile_of(lo), sw.tile_of(hi - 1) + 1):
                self._reserve(sw, k)

    def stage_grad_range(self, master: torch.Tensor, lo: int, values: torch.Tensor) -> None:
        """Copy ``values`` (reduced gradient elements ``[lo, lo + n)`` of ``master``'s shard) to host
        (nothing for a master not offloaded: See [Note: optimizer offload seam])."""
        if id(master) not in self._where:
            return
        g, i = self._where[id(master)]
        grp = self.groups[g]
        base, n = grp.offsets[i], values.numel()
        if lo < 0 or base + lo + n > grp.offsets[i + 1]:
            raise ValueError(
                f"OptimizerOffload.stage_grad_range: [{lo}, {lo + n}) is outside a master of "
                f"{grp.offsets[i + 1] - base} elements"
            )
        if self.masters_on_nvme:  # See [Note: ZeRO-Infinity streaming]
            self._stage_streamed(grp, base + lo, values)
        else:
            grp.grad[base + lo : base + lo + n].copy_(values.detach().reshape(-1), non_blocking=True)
            self.grads_landed.mark()  # step() waits for it: See [Note: offload copies]
            self._reserve_range(grp, base + lo, base + lo + n)  # See [Note: optimizer state prefetch]
        done = self._partial.get(id(master), 0) + n
        self._partial[id(master)] = done
        if done >= grp.offsets[i + 1] - base:
            self._staged.add(id(master))
            self.staged_during_backward += 1

    def is_staged(self, master: torch.Tensor) -> bool:
        """Whether ``master``'s whole gradient was copied to host during this step's backward."""
        return id(master) in self._staged

    # -- accounting and teardown --------------------------------------------------------------
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of the host-side pools (and of the device-side copy-back buffers on CUDA)."""
        return {
            "host_master_weights": sum(g.master.untyped_storage().nbytes() for g in self.groups),
            # streamed gradients (See [Note: ZeRO-Infinity streaming]): only their writes in flight
            "host_gradients": _bytes(g.grad for g in self.groups)
            + _bytes(getattr(self, "_grad_inflight", ())),
            "host_low_precision_params": _bytes(g.low for g in self.groups),
            "host_optimizer_states": _bytes(t for g in self.groups for t in g.states.values()),
            "host_swap_buffers": self.pool.nbytes() if self.pool is not None else 0,
            "offload_device_buffers": _bytes(g.device_low for g in self.groups),
        }

    def swapped_bytes_per_step(self) -> int:
        """Bytes one optimizer step reads plus writes through the swap files (0 with device cpu)."""
        return sum(2 * 4 * g.numel * len(g.swapper.state_names) for g in self.groups if g.swapper is not None)

    def owned_tensors(self) -> list[torch.Tensor]:
        """Host tensors owned here (the strategies exclude them from device-side accounting)."""
        return [
            t for g in self.groups for t in (g.master, g.grad, g.low, *g.states.values()) if t is not None
        ]

    def close(self) -> None:
        """Wait for I/O and remove the swap files (see [Note: swap file lifecycle])."""
        if self.pool is not None:
            self.pool.settle()
        for g in self.groups:
            if g.swapper is not None:
                g.swapper.drop_prefetch(keep_grads=False)
        for h in (getattr(self, "read_handle", None), getattr(self, "write_handle", None)):
            if h is not None:
                h.wait()
        self._close_streams()
        if self.swap_dir is not None:
            self.swap_dir.close()


def build_optimizer_offload(
    zero_config: ZeroOptimizationConfig,
    aio_config: AioConfig | None = None,
    *,
    rank: int = 0,
    compute_device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> OptimizerOffload | None:
    """The :class:`OptimizerOffload` that ``zero_optimization.offload_optimizer`` asks for (None when off)."""
    oo = zero_config.offload_optimizer
    if oo is None or not oo.enabled:
        return None
    if oo.device == "nvme" and zero_config.stage == 3:
        _warn_unbounded_backward(int(zero_config.reduce_bucket_size), int(zero_config.sub_group_size), dtype)
    return OptimizerOffload(
        oo.device,
        rank=rank,
        compute_device=compute_device,
        low_precision_dtype=dtype,
        sub_group_size=int(zero_config.sub_group_size),
        nvme_path=None if oo.nvme_path is None else str(oo.nvme_path),
        buffer_count=int(oo.buffer_count),
        pin_memory=bool(oo.pin_memory),
        pipeline_read=bool(oo.pipeline_read),
        pipeline_write=bool(oo.pipeline_write),
        fast_init=bool(oo.fast_init),
        aio=aio_config.model_dump() if aio_config is not None else {},
        # ZeRO-Infinity swaps the masters too; stages 1/2 keep them in CPU memory, as DeepSpeed does
        masters_on_nvme=zero_config.stage == 3,
    )


def _warn_unbounded_backward(reduce_bucket_size: int, sub_group_size: int, dtype: torch.dtype) -> None:
    """ZeRO-Infinity bounds the optimizer's host memory by ``sub_group_size``; stage 3's backward
    holds up to ``reduce_bucket_size`` unreduced gradient elements before it reduces them, and
    DeepSpeed's default (5e8: 2 GB in fp32) often outweighs everything else a rank holds at the
    memory limit. Say so when the bucket is more than 4 tiles (the config is valid, and
    DeepSpeed runs it the same way)."""
    if reduce_bucket_size <= 4 * sub_group_size:
        return
    import warnings

    size = dtype.itemsize
    warnings.warn(
        f"zero_optimization.reduce_bucket_size is {reduce_bucket_size} elements: with offload_optimizer "
        f"on NVMe at stage 3, backward may hold that many unreduced gradient elements before reducing "
        f"them ({reduce_bucket_size * size / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')}, at most "
        f"the model's gradients), more than 4x sub_group_size ({sub_group_size}), which bounds the optimizer's "
        f"swap buffers. To bound backward's memory too, set reduce_bucket_size near sub_group_size.",
        UserWarning,
        stacklevel=3,
    )
