"""ZeRO-Infinity's streamed arrays (a mixin of ``OptimizerOffload``): masters and gradients in swap files.

[Note: ZeRO-Infinity streaming]
Stage 3 with ``offload_optimizer.device: nvme`` (``masters_on_nvme``) is the mode that trains
models larger than host memory, so nothing of the size of the rank's partition may exist in
host memory at once, not even for a moment:

* masters: ``adopt`` takes :class:`~zero_core.protocols.optimizer_offload.MasterSource` objects
  (a shape and a function reading the initial values), reads them one at a time and writes
  each to the group's master swap file; the Parameters the client optimizer holds are
  placeholders whose storage holds no memory ([Note: masters on NVMe]);
* gradients: each reduced gradient piece staged on the accumulation-boundary backward
  (``stage_grad_range``, [Note: gradient staging]) is cast to fp32 and written to the group's
  gradient swap file at once, on its own aio handle; at most two tiles of such writes are in
  flight. ``streams_gradients()`` tells the strategy to drop its gradient shard once staged
  (it keeps the squared norm and the non-finite flag for clipping and overflow checks);
  ``staged_grad`` reads one back for ``safe_get_*_grad``;
* the step reads each tile's gradients (read-only: never written back) with its master and
  states in the tile pipeline ([Note: tile pipeline]), and hands every stepped master's new
  weights, in the training dtype, to the strategy's ``publish`` callback as soon as its last
  tile is done (one tile of low-precision values plus the largest master in progress), which
  writes them to the parameter's home (zero-offload's ``ParamOffload``, usually NVMe too);
* checkpoints read these arrays one value at a time ([Note: deferred fragments] in zero-core)
  and loads write them one at a time.

Host memory for the optimizer is then ``buffer_count`` x ``sub_group_size`` x (states + 2) x 4
bytes plus the small terms above, whatever the model size. Without gradient accumulation
nothing else holds gradients; with ``gradient_accumulation_steps`` > 1 the strategy's gradient
shards accumulate in memory between the micro-steps of a step and are streamed on its last.
This matches what DeepSpeed's ZeRO-Infinity does with ``offload_optimizer: nvme`` (its
optimizer swapper also swaps the gradient partitions out to NVMe).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from zero_core.protocols.optimizer_offload import MasterSource, master_values

from zero_offload.nvme_swapper import StateSwapper, swap_file_name
from zero_offload.offload_groups import _GRAD, _MASTER, _Group, _unallocated
from zero_offload.swap_files import SwapDirectory

Publish = Callable[[torch.Tensor, torch.Tensor], None]


class OffloadStreamMixin:
    """The streamed arrays of :class:`~zero_offload.optimizer_offload.OptimizerOffload`."""

    masters_on_nvme: bool
    swap_dir: SwapDirectory | None
    tile: int
    low_dtype: torch.dtype
    groups: list[_Group]
    _where: dict[int, tuple[int, int]]
    _staged: set[int]
    _aio_kw: dict[str, Any]
    _reserve: Callable[[StateSwapper, int], bool]

    def _stream_handles(self) -> Any:
        """The aio handle of the streamed arrays' direct reads and writes (made on first use)."""
        io = getattr(self, "_stream_io", None)
        if io is None:
            from zero_ops.aio import AsyncIOHandle

            io = self._stream_io = AsyncIOHandle(**self._aio_kw)
            self._grad_io = AsyncIOHandle(**self._aio_kw)
            self._grad_inflight: list[torch.Tensor] = []
            self._grad_inflight_numel = 0
        return io

    def _array_path(self, grp: _Group, key: str) -> str:
        assert self.swap_dir is not None
        return str(self.swap_dir.check(swap_file_name(f"optim_group{grp.index}", key)))

    # -- adoption --------------------------------------------------------------------------
    @torch.no_grad()
    def _adopt_streamed(self, g: _Group, sources: Sequence[torch.Tensor | MasterSource]) -> None:
        """Write each source to the group's master swap file in turn; placeholders as masters."""
        assert self.swap_dir is not None
        io = self._stream_handles()
        for key in (_MASTER, _GRAD):
            self.swap_dir.allocate(swap_file_name(f"optim_group{g.index}", key), g.numel * 4)
        path = self._array_path(g, _MASTER)
        for i, s in enumerate(sources):
            values = master_values(s).detach().reshape(-1).to("cpu", torch.float32).contiguous()
            if values.numel() != g.offsets[i + 1] - g.offsets[i]:
                raise ValueError(
                    f"OptimizerOffload.adopt: source {i} produced {values.numel()} values for a master of "
                    f"{g.offsets[i + 1] - g.offsets[i]} elements"
                )
            if values.numel():
                io.sync_pwrite(values, path, g.offsets[i] * 4)
            del values
            p = torch.nn.Parameter(_unallocated(s.shape))
            g.params.append(p)
            self._where[id(p)] = (g.index, i)
        g.master = _unallocated(torch.Size([g.numel]))
        g.grad = torch.empty(0)

    # -- direct reads and writes of one array ------------------------------------------------
    def _read_array(self, grp: _Group, key: str, lo: int, hi: int) -> torch.Tensor:
        """A new fp32 tensor with elements ``[lo, hi)`` of the group's swapped array ``key``."""
        if key == _GRAD:
            self._drain_grads()
            if grp.swapper is not None:
                grp.swapper.flush_grads()  # the buffered ones: See [Note: optimizer state prefetch]
        swapper = _checksummed(grp, key)
        if swapper is not None:
            return swapper.read_range(key, lo, hi)  # verified; See [Note: swap checksums]
        out = torch.empty(hi - lo, dtype=torch.float32)
        if hi > lo:
            self._stream_handles().sync_pread(out, self._array_path(grp, key), lo * 4)
        return out

    def _write_array(self, grp: _Group, key: str, lo: int, values: torch.Tensor) -> None:
        v = values.detach().reshape(-1).to("cpu", torch.float32).contiguous()
        if not v.numel():
            return
        swapper = _checksummed(grp, key)
        if swapper is not None:
            swapper.write_range(key, lo, v)  # keeps the tiles' checksums those of their bytes
        else:
            self._stream_handles().sync_pwrite(v, self._array_path(grp, key), lo * 4)

    # -- gradients -------------------------------------------------------------------------
    def _stage_streamed(self, grp: _Group, lo: int, values: torch.Tensor) -> None:
        """Put ``values`` as elements ``[lo, lo + n)`` of the gradient array: into the buffer the
        step will use for their tile where it has one, else start writing them to the swap file
        (See [Note: optimizer state prefetch] in nvme_swapper.py)."""
        v = values.detach().reshape(-1)
        hi = lo + v.numel()
        sw = grp.swapper
        a = lo
        while a < hi:
            if sw is None:
                self._write_grads(grp, a, v[a - lo :])
                return
            k = sw.tile_of(a)
            t_lo, t_hi = sw.tile_range(k)
            b = min(hi, t_hi)
            if k not in sw.grads_on_disk and (k in sw.grads_in_buffer or self._reserve(sw, k)):
                sw.buffer_view(k, _GRAD)[a - t_lo : b - t_lo].copy_(v[a - lo : b - lo])
                sw.grads_in_buffer.add(k)
            else:
                sw.grads_on_disk.add(k)
                self._write_grads(grp, a, v[a - lo : b - lo])
            a = b

    def _write_grads(self, grp: _Group, lo: int, values: torch.Tensor) -> None:
        """Start writing ``values`` (cast to fp32) as elements ``[lo, lo + n)`` of the gradient swap file."""
        self._stream_handles()
        v = values.to("cpu", torch.float32, copy=True)
        if not v.numel():
            return
        if self._grad_inflight_numel + v.numel() > 2 * self.tile:
            self._drain_grads()  # bound what waits for the disk
        self._grad_io.async_pwrite(v, self._array_path(grp, _GRAD), lo * 4)
        self._grad_inflight.append(v)
        self._grad_inflight_numel += v.numel()

    def _drain_grads(self) -> None:
        """Wait for the gradient writes in flight (before the step or a read of them)."""
        if getattr(self, "_grad_inflight", None):
            self._grad_io.wait()
            self._grad_inflight.clear()
            self._grad_inflight_numel = 0

    def streams_gradients(self) -> bool:
        """See [Note: ZeRO-Infinity streaming]: staged gradients live in the gradient swap file."""
        return self.masters_on_nvme

    def staged_grad(self, master: torch.Tensor) -> torch.Tensor | None:
        """A new fp32 tensor with ``master``'s staged gradient (None when none was staged)."""
        if id(master) not in self._staged:
            return None
        g, i = self._where[id(master)]
        grp = self.groups[g]
        lo, hi = grp.offsets[i], grp.offsets[i + 1]
        if self.masters_on_nvme:
            return self._read_array(grp, _GRAD, lo, hi).view(master.shape)
        return grp.grad[lo:hi].clone().view(master.shape)

    # -- the step's updated weights ----------------------------------------------------------------
    def _publish_tile(
        self,
        grp: _Group,
        t_lo: int,
        values: torch.Tensor,
        publish: Publish,
        pending: dict[int, torch.Tensor],
    ) -> None:
        """Hand the staged masters overlapping tile ``[t_lo, t_lo + len(values))`` their new
        values; a master spanning tiles is collected in ``pending`` until its last one."""
        t_hi = t_lo + values.numel()
        first = bisect.bisect_right(grp.offsets, t_lo) - 1
        for i in range(max(first, 0), len(grp.params)):
            lo, hi = grp.offsets[i], grp.offsets[i + 1]
            if lo >= t_hi:
                break
            p = grp.params[i]
            if id(p) not in self._staged or hi <= t_lo:
                continue
            a, b = max(lo, t_lo), min(hi, t_hi)
            piece = values[a - t_lo : b - t_lo]
            if lo >= t_lo and hi <= t_hi:
                publish(p, piece)
                continue
            buf = pending.get(i)
            if buf is None:
                buf = pending[i] = torch.empty(hi - lo, dtype=values.dtype)
            buf[a - lo : b - lo].copy_(piece)
            if hi <= t_hi:
                publish(p, pending.pop(i))

    def swap_io_bytes(self) -> dict[str, int]:
        """Bytes read from and written to the swap files so far (optimizer states, masters, gradients)."""
        handles = [getattr(self, n, None) for n in ("read_handle", "write_handle", "_stream_io", "_grad_io")]
        handles = [h for h in handles if h is not None] + getattr(self, "_prefetch_io", [])
        return {
            "read": sum(h.bytes_read for h in handles),
            "written": sum(h.bytes_written for h in handles),
        }

    def _close_streams(self) -> None:
        for name in ("_stream_io", "_grad_io"):
            h = getattr(self, name, None)
            if h is not None:
                h.wait()


def _checksummed(grp: _Group, key: str) -> StateSwapper | None:
    """The group's swapper when it writes (and so checksums) array ``key``, else None: before the
    first step, and for the read-only gradients, the arrays are read and written directly."""
    swapper = getattr(grp, "swapper", None)
    if swapper is None or key not in swapper.files or key in swapper.read_only:
        return None
    return swapper
