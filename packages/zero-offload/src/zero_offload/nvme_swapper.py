"""Optimizer states on NVMe, streamed through a small pool of pinned buffers tile by tile.

[Note: tile pipeline]
A parameter group's optimizer states (``exp_avg``, ``exp_avg_sq`` ...) are flat fp32 arrays
kept in one swap file per state. The step walks the group in tiles of ``sub_group_size``
elements: read the tile's states into a buffer, update, write them back. A buffer holds one
tile of every state, so resident CPU memory for optimizer states is at most
``buffer_count x tile bytes`` whatever the model size. The pipeline needs
``1 + pipeline_read + pipeline_write`` buffers:

* ``pipeline_read``: tile k+1 is read (on the read handle's threads) while tile k is updated;
* ``pipeline_write``: a buffer is kept for tile k's write to stay in flight while tile k+1 is
  read and updated (without it a write stays in flight only while the next tile needs no
  buffer: [Note: writes behind the step]); a buffer still being written is reused only after
  the write handle has drained.

Arrays created and filled before the swapper (``preallocated``: the fp32 masters and the
gradients of [Note: ZeRO-Infinity streaming]) are neither allocated nor zeroed here, and
``read_only`` arrays (the gradients) are read with each tile but never written back.

[Note: optimizer state prefetch]
The pool has ``buffer_count`` buffers and the step's pipeline uses ``1 + pipeline_read +
pipeline_write`` of them; the others are idle during the step, and the whole pool is idle
during backward. So during an accumulation-boundary backward, when the first reduced gradient
piece of a tile lands and a spare buffer is left, the offload reserves one for that tile and
starts reading its states into it (every array but the read-only gradients), on an aio handle
of its own. Tiles are thus read in the order backward finishes them, which spreads the reads
over backward by itself (all at once at its start delayed the parameter reads backward begins
with). The disk does this under backward's compute; the step then finds those tiles in memory.

Under ZeRO-Infinity streaming ([Note: ZeRO-Infinity streaming] in offload_stream.py) the
gradients of such a tile go into that buffer's gradient slot instead of the swap file: a tile's
gradients are either all in its buffer or all on disk, decided by its first piece of the
backward. With no spare buffer left, a smaller tile gives its buffer up (its gradients so far
written to the file) to a larger one, so the largest tiles keep them: a group's last, partial
tile is the first one backward reaches. With as many spare buffers as tiles no gradient
touches the disk: two fewer passes over the rank's gradients per step (a write in backward, a
read in the step). The 101M-parameter benchmark GPT (3 spare buffers, 4 tiles and a partial one
per rank) moves 3.81 GB per step instead of 4.41.

The states do not change between backward and the step: a write to a reserved region (a
checkpoint load, ``safe_set_*``) first puts the tile's buffered gradients in the swap file and
drops the reservation, and a read of the gradients (``safe_get_*_grad``) puts them there too;
the tile is verified against its checksum when the step uses it as when it reads it. No memory
beyond the configured pool is used.

[Note: writes behind the step]
A tile's write is waited for only when its buffer is needed again. Tiles found in memory (read
ahead during backward) need none, so their updates run while the previous tiles are written,
and the last writes of a step stay in flight after it: into the next forward, which reads
parameters, not these files. Their buffers count as reserved until ``BufferPool.settle`` waits
for them, which everything that reads or writes these files, or takes a buffer, does first (the
next step, the next backward's reservations, checkpoint and ``safe_*`` access, teardown); the
next ``zero_grad`` does not. Measured on the 101M-parameter benchmark GPT against waiting for
each write at once: 3% faster steps (0.05-0.14 s in each of 4 paired passes); the disk is busy
through most of the step with the parameters' writes as well, so little is left to hide. No
memory beyond the configured pool is used.

Without either flag every read is waited for at once (simple, least memory). Reads and
writes use two separate aio handles so that waiting for the next tile's read never waits for
the previous tile's write. Tiles start at multiples of 1024 elements (4096 bytes), so the
aligned, page-locked buffers go through O_DIRECT where the file system allows it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from zero_ops.aio import AsyncIOHandle, locked_empty

from zero_offload.swap_checksums import SwapChecksums
from zero_offload.swap_files import SwapDirectory

_ALIGN_ELEMS = 1024  # 4096 bytes of fp32


def round_tile(tile_numel: int) -> int:
    """``tile_numel`` rounded up to a multiple of 1024 elements (O_DIRECT alignment)."""
    return max(_ALIGN_ELEMS, -(-tile_numel // _ALIGN_ELEMS) * _ALIGN_ELEMS)


def swap_file_name(array: str, key: str) -> str:
    """The swap file of state ``key`` of the swapped ``array`` (e.g. ``optim_group0.exp_avg.swp``)."""
    return f"{array}.{key}.swp"


def buffers_needed(pipeline_read: bool, pipeline_write: bool) -> int:
    return 1 + int(pipeline_read) + int(pipeline_write)


class BufferPool:
    """``count`` page-aligned (and page-locked where allowed) buffers of ``numel`` fp32 elements each."""

    def __init__(self, count: int, numel: int) -> None:
        self.buffers = [locked_empty(numel, torch.float32) for _ in range(count)]
        self.numel = numel
        # ids of buffers holding a prefetched tile or a write left behind by the last step
        self.reserved: set[int] = set()
        self._behind: list[Callable[[], None]] = []  # See [Note: writes behind the step]

    def idle(self) -> list[torch.Tensor]:
        """The buffers no prefetch nor write behind holds (See [Note: optimizer state prefetch])."""
        return [b for b in self.buffers if id(b) not in self.reserved]

    def leave_behind(self, settle: Callable[[], None]) -> None:
        self._behind.append(settle)

    def settle(self) -> None:
        """Wait for the writes the last step left in flight (See [Note: writes behind the step])."""
        while self._behind:
            self._behind.pop()()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


class StateSwapper:
    """The optimizer states of one flat group of ``numel`` elements, in swap files (see [Note: tile pipeline])."""

    def __init__(
        self,
        swap_dir: SwapDirectory,
        name: str,
        numel: int,
        state_names: tuple[str, ...],
        *,
        tile_numel: int,
        pool: BufferPool,
        read_handle: AsyncIOHandle,
        write_handle: AsyncIOHandle,
        pipeline_read: bool,
        pipeline_write: bool,
        fast_init: bool,
        preallocated: tuple[str, ...] = (),
        read_only: tuple[str, ...] = (),
    ) -> None:
        if pool.numel < tile_numel * len(state_names):
            raise ValueError(
                f"StateSwapper {name}: pool buffers of {pool.numel} elements cannot hold a tile of "
                f"{tile_numel} elements x {len(state_names)} states"
            )
        if len(pool.buffers) < buffers_needed(pipeline_read, pipeline_write):
            raise ValueError(
                f"StateSwapper {name}: {len(pool.buffers)} buffers, but pipeline_read={pipeline_read} and "
                f"pipeline_write={pipeline_write} need {buffers_needed(pipeline_read, pipeline_write)}"
            )
        self.dir = swap_dir
        self.name = name
        self.numel = numel
        self.state_names = state_names
        self.tile = tile_numel
        self.pool = pool
        self.rh = read_handle
        self.wh = write_handle
        self.pipeline_read = pipeline_read
        self.pipeline_write = pipeline_write
        self.files = {k: swap_file_name(name, k) for k in state_names}
        self.read_only = frozenset(read_only)
        # tile -> (buffer, aio handle) of the tiles read ahead: See [Note: optimizer state prefetch]
        self.prefetched: dict[int, tuple[torch.Tensor, AsyncIOHandle]] = {}
        # tiles whose gradients this backward are in their reserved buffer / in the swap file
        # (See [Note: optimizer state prefetch]; reset by :meth:`new_backward`)
        self.grads_in_buffer: set[int] = set()
        self.grads_on_disk: set[int] = set()
        self.sums = SwapChecksums(swap_dir)  # See [Note: swap checksums]
        fresh = [k for k in state_names if k not in preallocated]
        for k in fresh:
            swap_dir.allocate(self.files[k], numel * 4)
        if not fast_init:
            # Write the zero initial states through the same path training uses: proves the disk
            # accepts writes now rather than at the first step. fast_init trusts fallocate's zeros.
            buf = pool.buffers[0]
            buf.zero_()
            for lo, hi in self.tiles():
                for k in fresh:
                    self.wh.async_pwrite(buf[: hi - lo], self.dir.check(self.files[k]), lo * 4)
                self.wh.wait()
        # Preallocated arrays were filled outside the swapper (adopted masters, staged gradients):
        # their regions are checksummed from the first time the swapper writes them back.
        for lo, hi in self.tiles():
            for k in fresh:
                self.sums.record_zeros(self.files[k], lo * 4, (hi - lo) * 4)

    def tiles(self) -> list[tuple[int, int]]:
        return [self.tile_range(k) for k in range(-(-self.numel // self.tile))]

    def tile_range(self, k: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of tile ``k``."""
        lo = k * self.tile
        return lo, min(lo + self.tile, self.numel)

    def _views(self, buf: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
        return {k: buf[i * self.tile : i * self.tile + n] for i, k in enumerate(self.state_names)}

    def _read(
        self,
        lo: int,
        hi: int,
        buf: torch.Tensor,
        read_only: bool | None = None,
        handle: AsyncIOHandle | None = None,
    ) -> None:
        """Start reading tile ``[lo, hi)`` into ``buf`` on ``handle`` (the read handle by default):
        every state, or only the read-only arrays (``read_only=True``) or only the others (False)."""
        for k, v in self._views(buf, hi - lo).items():
            if read_only is None or (k in self.read_only) == read_only:
                (handle or self.rh).async_pread(v, self.dir.check(self.files[k]), lo * 4)

    def prefetch(self, k: int, buf: torch.Tensor, handle: AsyncIOHandle) -> None:
        """Start reading tile ``k``'s states (not the read-only arrays) into ``buf`` on ``handle``;
        :meth:`run` uses them. See [Note: optimizer state prefetch]."""
        self.pool.settle()
        self._drop_tile(k)
        self._read(*self.tile_range(k), buf, read_only=False, handle=handle)
        self.pool.reserved.add(id(buf))
        self.prefetched[k] = (buf, handle)

    def tile_of(self, elem: int) -> int:
        return elem // self.tile

    def tile_size(self, k: int) -> int:
        lo, hi = self.tile_range(k)
        return hi - lo

    def new_backward(self) -> None:
        """A boundary backward starts: where its gradients go is decided afresh, tile by tile."""
        self.grads_in_buffer.clear()
        self.grads_on_disk.clear()

    def buffer_view(self, k: int, key: str) -> torch.Tensor:
        """Array ``key`` of reserved tile ``k`` in its buffer (See [Note: optimizer state prefetch])."""
        return self._views(self.prefetched[k][0], self.tile_size(k))[key]

    def flush_grads(self, only: int | None = None) -> None:
        """Write the gradients held in reserved buffers (of tile ``only``, or all) to the swap file
        (before something reads that file or the reservation is dropped), so that file is again
        the whole truth."""
        for k in sorted(self.grads_in_buffer if only is None else self.grads_in_buffer & {only}):
            lo = self.tile_range(k)[0]
            for key in self.read_only:
                self.wh.sync_pwrite(self.buffer_view(k, key), self.dir.check(self.files[key]), lo * 4)
            self.grads_on_disk.add(k)
            self.grads_in_buffer.discard(k)

    def release(self, k: int) -> None:
        """Give up reserved tile ``k`` (its buffered gradients go to the swap file first)."""
        self.flush_grads(k)
        self._drop_tile(k)

    def drop_prefetch(self, keep_grads: bool = True) -> None:
        """Forget every prefetched tile (their reads waited for, their buffers idle again); their
        buffered gradients go to the swap file first unless ``keep_grads`` is False (teardown)."""
        if keep_grads:
            self.flush_grads()
        else:
            self.grads_in_buffer.clear()
        for k in list(self.prefetched):
            self._drop_tile(k)

    def _drop_tile(self, k: int) -> torch.Tensor | None:
        """Forget tile ``k``'s prefetch; returns its buffer, its read complete (None if none)."""
        entry = self.prefetched.pop(k, None)
        if entry is None:
            return None
        buf, handle = entry
        try:
            handle.wait()
        finally:
            self.pool.reserved.discard(id(buf))
        return buf

    def _write(self, lo: int, hi: int, buf: torch.Tensor) -> None:
        for k, v in self._views(buf, hi - lo).items():
            if k not in self.read_only:
                self.sums.record_async(self.files[k], lo * 4, v)  # drained before ``buf`` is reused
                self.wh.async_pwrite(v, self.dir.check(self.files[k]), lo * 4)

    def _verify(self, lo: int, hi: int, buf: torch.Tensor) -> None:
        """The tile read into ``buf`` is what was written (see [Note: swap checksums])."""
        for k, v in self._views(buf, hi - lo).items():
            self.sums.verify(self.files[k], lo * 4, v)

    def run(self, update: Callable[[int, int, dict[str, torch.Tensor]], None]) -> None:
        """Call ``update(lo, hi, states)`` on every tile, states swapped in and out around it."""
        self.pool.settle()
        tiles = self.tiles()
        free = deque(self.pool.idle())  # prefetched tiles keep theirs until used
        writing: list[torch.Tensor] = []

        def take() -> torch.Tensor:
            if not free:
                self.wh.wait()
                self.sums.drain()
                free.extend(writing)
                writing.clear()
            return free.popleft()

        def start(k: int) -> torch.Tensor:
            """Start reading tile ``k`` (only what no prefetch read: See [Note: optimizer state prefetch])."""
            buf = self._drop_tile(k)
            if buf is None:
                buf = take()
                self._read(*tiles[k], buf)
            elif k not in self.grads_in_buffer:
                self._read(*tiles[k], buf, read_only=True)
            self.grads_in_buffer.discard(k)  # consumed by this step
            return buf

        done = False
        try:
            nxt = None
            if self.pipeline_read and tiles:
                nxt = start(0)
            for k, (lo, hi) in enumerate(tiles):
                if self.pipeline_read:
                    self.rh.wait()
                    cur = nxt
                    if k + 1 < len(tiles):
                        nxt = start(k + 1)
                else:
                    cur = start(k)
                    self.rh.wait()
                self._verify(lo, hi, cur)
                update(lo, hi, self._views(cur, hi - lo))
                self._write(lo, hi, cur)
                writing.append(cur)  # waited for when a buffer is needed: See [Note: writes behind the step]
            done = True
        finally:
            self.rh.wait()
            if done and writing:
                self._leave_behind(writing)
            else:
                self.wh.wait()
                self.sums.drain()

    def _leave_behind(self, writing: list[torch.Tensor]) -> None:
        """Keep ``writing``'s buffers until their writes end (See [Note: writes behind the step])."""
        ids = {id(b) for b in writing}
        self.pool.reserved |= ids

        def settle() -> None:
            try:
                self.wh.wait()
                self.sums.drain()
            finally:
                self.pool.reserved -= ids

        self.pool.leave_behind(settle)

    def _covering(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The tiles that hold elements ``[lo, hi)``."""
        first = lo // self.tile * self.tile
        return [(a, min(a + self.tile, self.numel)) for a in range(first, hi, self.tile)]

    def _read_tile(self, key: str, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=torch.float32)
        self.rh.sync_pread(out, self.dir.check(self.files[key]), lo * 4)
        self.sums.verify(self.files[key], lo * 4, out)
        return out

    def read_range(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """A new CPU tensor with elements ``[lo, hi)`` of state ``key`` (for checkpoints and inspection).

        The tiles holding the range are read whole, so that their checksums can be verified."""
        self.pool.settle()
        out = torch.empty(hi - lo, dtype=torch.float32)
        for a, b in self._covering(lo, hi) if hi > lo else []:
            tile = self._read_tile(key, a, b)
            x, y = max(lo, a), min(hi, b)
            out[x - lo : y - lo].copy_(tile[x - a : y - a])
        return out

    def write_range(self, key: str, lo: int, values: torch.Tensor) -> None:
        """Write ``values`` (fp32) as elements ``[lo, lo + numel)`` of state ``key``.

        Tiles covered in part are read (and verified), patched and written whole, so each
        tile's checksum stays that of its bytes (see [Note: swap checksums])."""
        v = values.detach().reshape(-1).to(torch.float32).contiguous()
        if lo < 0 or lo + v.numel() > self.numel:
            raise ValueError(
                f"StateSwapper {self.name}: range [{lo}, {lo + v.numel()}) outside {self.numel} elements"
            )
        hi = lo + v.numel()
        self.pool.settle()
        self.drop_prefetch()  # it may hold the old values of this range
        for a, b in self._covering(lo, hi) if hi > lo else []:
            if lo <= a and b <= hi:
                tile = v[a - lo : b - lo]
            else:
                tile = self._read_tile(key, a, b)
                x, y = max(lo, a), min(hi, b)
                tile[x - a : y - a].copy_(v[x - lo : y - lo])
            self.sums.record(self.files[key], a * 4, tile)
            self.wh.sync_pwrite(tile, self.dir.check(self.files[key]), a * 4)
