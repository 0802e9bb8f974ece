"""``ParamOffload``: stage-3 parameter partitions that live off the device (CPU memory or NVMe).

[Note: parameter offload]
``zero_optimization.offload_param`` (stage 3 only). Each partitioned parameter's shard
(``p.zero_shard``, see [Note: stage 3 parameter layout] in zero-core) has a *home* off the
device and a *device copy* that exists only while it is needed:

* home: a host tensor (``device: cpu``, pinned when ``pin_memory`` and CUDA is present), or a
  4096-byte aligned region of the rank's parameter swap file (``device: nvme``); with NVMe the
  first ``max_in_cpu`` shard elements (in parameter order) keep a host home instead.
* device copy: ``st.shard`` itself, whose *storage* is resized to zero bytes while released
  (the tensor object, its dtype and its device stay, so code holding ``p.zero_shard`` sees the
  same object). zero-core's ``gather_params`` calls :meth:`fetch` just before it packs the
  shard for the all-gather and :meth:`release` right after, so a shard is on the device only
  for the duration of its gather; every other access goes through ``read_shard`` /
  ``write_shard`` (zero-core), which land here.
* NVMe transfers go through ``buffer_count`` page-aligned (page-locked where allowed) buffers
  of ``buffer_size`` elements: a shard is read into a buffer, copied to the device and the
  buffer returned. After each bucket the next shards in the coordinator's recorded module
  order (see [Note: stage 3 parameter coordinator]) are read ahead into the free buffers, so
  the all-gather of module k+1 finds its shards already in memory ([Note: read-ahead]). Resident CPU bytes for
  parameters are thus at most ``buffer_count x buffer_size`` (+ ``max_in_cpu``) elements.
* each read in flight has an aio handle of its own (a pool of at most ``buffer_count`` + 1
  handles; an aio handle's ``wait`` collects everything submitted on it), so a fetch waits
  for its own shard only. With one handle for all reads, each fetch waited for every
  read-ahead in flight, then issued one more that the next fetch waited for: the shards of a
  module, fetched back to back, were read one after the other with no compute under them.
  ``fetch_wait_s`` counts the seconds fetches spent waiting for the disk (the part of the
  parameter swapping the compute did not hide).
* after the optimizer step, the updated low-precision shard is written back to its home
  (``write_shard``; NVMe writes go through a pool buffer and are left in flight until a
  buffer or a read needs them).

[Note: read-ahead]
Which shards are read ahead, and when. zero-core's gather hands a bucket's shards to
:meth:`ParamOffload.fetch_bucket` together: their reads start at once (as buffers allow), each
fetch waits for its own, and a buffer freed by one fetch starts the next shard's read. Once
the bucket is in, the store scans the coordinator's trace from its position for the next
``buffer_count`` shards in order of use and reads those not read yet; a shard that is gathered
now (in flight or available, e.g. kept by ``max_reuse_distance``) holds its place in that window
without being read, so that a window reaching far past shards the coordinator may release and
need again does not fill buffers with reads that would be dropped. A buffer is taken from a
read-ahead only when that shard has left the window (never from the bucket being fetched), and
on a miss from the read-ahead wanted last. Shards whose gather is in flight are never read
again: their device copy is packed and released before the all-gather's full buffer exists, so
"not allocated" alone does not mean "released" (that mistake re-read them, and the extra reads
pushed the shards actually next out of the buffers: a 101M-parameter GPT read 2.3x its
parameters per forward; test_offload_param_readahead.py counts reads against fetches).

On a machine without a GPU the device is the CPU itself: the home and the device copy are
separate CPU allocations, and ``memory_breakdown`` reports them apart.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any

import torch
from zero_core.protocols.shard_store import PLAIN_SHARDS
from zero_core.zero.stage3.param_records import is_partitioned, partition_state
from zero_core.zero.stage3.partitioned_param import ParamStatus
from zero_core.zero.stage3.transient_shards import TransientShards
from zero_ops.aio import AsyncIOHandle, locked_empty

from zero_offload.host_heap import bound_host_heap
from zero_offload.swap_checksums import SwapChecksums
from zero_offload.swap_files import SwapDirectory, aio_handle_settings
from zero_offload.transfers import CopyFence, host_buffer

if TYPE_CHECKING:
    from zero_core.config import ZeroOptimizationConfig
    from zero_core.config.builtin_sections import AioConfig
    from zero_core.zero.stage3.partitioned_param import PartitionState

_ALIGN = 4096
# Several ParamOffload objects of a process share the rank's swap directory (zero.Init's and
# the engine's): each names its files with its own number, so none truncates another's.
_INSTANCES = itertools.count()


def _round(nbytes: int) -> int:
    return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)


def _nbytes(st: Any) -> int:
    return st.shard_numel * st.shard.element_size()


class ParamOffload(TransientShards):
    """See [Note: parameter offload]; a transient ``ShardStore`` (See [Note: shard store seam]
    in zero-core's ``protocols/shard_store.py``): fetch and release are ``TransientShards``'.

    Args:
        device: ``"cpu"`` or ``"nvme"`` (``offload_param.device``).
        rank: this rank in the data-parallel group (names the swap directory).
        nvme_path, buffer_count, buffer_size, max_in_cpu, pin_memory: the ``offload_param``
            settings (buffer_size and max_in_cpu in elements); ``aio``: the ``aio`` section.
    """

    def __init__(
        self,
        device: str,
        *,
        rank: int = 0,
        nvme_path: str | None = None,
        buffer_count: int = 5,
        buffer_size: int = 100_000_000,
        max_in_cpu: int = 1_000_000_000,
        pin_memory: bool = False,
        aio: dict[str, Any] | None = None,
    ) -> None:
        if device not in ("cpu", "nvme"):
            raise ValueError(
                f'zero_optimization.offload_param.device must be "cpu" or "nvme", got {device!r}'
            )
        for name, v, lo in (
            ("buffer_count", buffer_count, 1 if device == "nvme" else 0),
            ("buffer_size", buffer_size, 1 if device == "nvme" else 0),
            ("max_in_cpu", max_in_cpu, 0),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"zero_optimization.offload_param.{name} must be an int >= {lo}, got {v!r}")
        self.device = device
        self.rank = int(rank)
        self.buffer_count = buffer_count
        self.buffer_size = buffer_size
        self.max_in_cpu = max_in_cpu
        self.pin = bool(pin_memory)
        self.fetched = CopyFence()  # behind the latest home->device copy
        self.params: dict[int, torch.nn.Parameter] = {}  # PartitionState.id -> param, adoption order
        self.host: dict[int, torch.Tensor] = {}  # id -> host home
        self.offset: dict[int, tuple[str, int]] = {}  # id -> (swap file, byte offset) of NVMe homes
        self.in_cpu_numel = 0
        self.coordinator: Any = None
        self.instance = next(_INSTANCES)
        self.fetches = 0
        self.read_ahead_hits = 0
        self.fetch_wait_s = 0.0  # seconds fetches waited for reads (See [Note: parameter offload])
        self.swap_dir: SwapDirectory | None = None
        self._files: list[str] = []
        self._file_bytes = 0
        self._buffers: list[torch.Tensor] = []
        self._free: list[torch.Tensor] = []
        # read ahead, complete or in flight: id -> (buffer, the handle its read was submitted on)
        self._landed: OrderedDict[int, tuple[torch.Tensor, Any]] = OrderedDict()
        self._writing: list[torch.Tensor] = []
        self._readers: list[Any] = []  # every read handle made (the byte counters add them up)
        self._idle_readers: list[Any] = []  # read handles with nothing in flight
        self._wanted: dict[int, int] = {}  # the latest read-ahead scan: See [Note: read-ahead]
        self._bucket: dict[int, int] = {}  # the bucket fetch_bucket is fetching: id -> position
        self._aio_kw: dict[str, Any] = {}
        if device == "nvme":
            if nvme_path is None:
                raise ValueError('zero_optimization.offload_param.nvme_path: required when device is "nvme"')
            self.swap_dir = SwapDirectory(nvme_path, self.rank, what="zero_optimization.offload_param")
            self.sums = SwapChecksums(self.swap_dir)  # See [Note: swap checksums]
            bound_host_heap()  # See [Note: host heap under NVMe offload]
            self._aio_kw = aio_handle_settings(aio)
            self.wh = AsyncIOHandle(**self._aio_kw)

    # -- adoption ------------------------------------------------------------------------------
    @torch.no_grad()
    def adopt(self, params: list[torch.nn.Parameter]) -> None:
        """Move the shards of ``params`` (partitioned, released) to their homes and free the device copies."""
        for p in params:
            if not is_partitioned(p):
                raise TypeError(
                    f"ParamOffload.adopt: expected parameters partitioned by ZeRO stage 3 (zero_core's is_partitioned), "
                    f"got a {type(p).__name__} of shape {tuple(getattr(p, 'shape', ()))}"
                )
        new = [p for p in params if not partition_state(p).store.transient]  # others keep theirs
        nvme_new = []
        for p in new:
            st = partition_state(p)
            if self.device == "cpu" or self.in_cpu_numel + st.shard_numel <= self.max_in_cpu:
                home = host_buffer(st.shard_numel, st.shard.dtype, self.pin)  # See [Note: offload copies]
                home.copy_(st.shard)
                self.host[st.id] = home
                if self.device == "nvme":
                    self.in_cpu_numel += st.shard_numel
            else:
                nvme_new.append(p)
        if nvme_new:
            self._grow_file(nvme_new)
        for p in new:
            st = partition_state(p)
            self.params[st.id] = p  # (NVMe homes were registered by _grow_file already)
            st.store = self
            st.shard.untyped_storage().resize_(0)

    def _grow_file(self, params: list[torch.nn.Parameter]) -> None:
        """Give ``params`` NVMe homes in a new swap file created with its final size, then written.

        One file per ``adopt`` call: zero.Init adopts a submodule at a time, and the engine adopts
        the rest, without rewriting earlier files.
        """
        assert self.swap_dir is not None
        states = [partition_state(p) for p in params]
        biggest = max(states, key=_nbytes)
        if _nbytes(biggest) > self.buffer_size * biggest.shard.element_size():
            raise ValueError(
                f"zero_optimization.offload_param.buffer_size is {self.buffer_size} elements, but a parameter "
                f"shard ({tuple(biggest.shape)}: {biggest.shard_numel} elements per rank) "
                "does not fit in one buffer; raise buffer_size to at least the largest shard"
            )
        name = f"params{self.instance}.{len(self._files)}.swp"
        cursor = 0
        for st in states:
            self.offset[st.id] = (name, cursor)
            cursor += _round(_nbytes(st))
        self.swap_dir.allocate(name, cursor)
        self._files.append(name)
        self._file_bytes += cursor
        # Buffers: only as large as the largest shard needs (never more than buffer_size elements).
        need = _round(_nbytes(biggest))
        if not self._buffers or self._buffers[0].numel() < need:
            for pid in list(self._landed):
                self._drop_landed(pid)
            self.wh.wait()
            self._writing = []
            self._buffers = [locked_empty(need, torch.uint8) for _ in range(self.buffer_count)]
            self._free = list(self._buffers)
        for p, st in zip(params, states):
            self.params[st.id] = p
            self._write_nvme(st.id, st.shard)
        self.wh.wait()
        self._free.extend(self._writing)
        self._writing.clear()

    # -- the device copy (TransientShards.fetch calls this from zero-core's gather_params) -------
    def _fill(self, st: PartitionState) -> None:
        """Copy the shard's values from its home into ``st.shard`` (allocated)."""
        self.fetches += 1
        if st.id in self.host:
            st.shard.copy_(self.host[st.id], non_blocking=True)
            self.fetched.mark()  # write() waits before changing a home: See [Note: offload copies]
        else:
            landed = self._landed.pop(st.id, None)
            if landed is not None:
                self.read_ahead_hits += 1
                buf, reader = landed
            else:
                buf = self._take()
                reader = self._read_nvme(st.id, buf)
            t0 = time.perf_counter()
            self._settle(reader)  # this shard's read only: the read-aheads stay in flight
            self.fetch_wait_s += time.perf_counter() - t0
            self._verify(st.id, buf)
            st.shard.copy_(buf[: _nbytes(st)].view(st.shard.dtype))
            self._free.append(buf)

    @torch.no_grad()
    def fetch_bucket(self, states: list[PartitionState]) -> None:
        """Fetch a gather's bucket with its reads in flight together, then read ahead in the
        trace (See [Note: read-ahead])."""
        queue = deque(st for st in states if st.id in self.offset)
        self._bucket = {st.id: i for i, st in enumerate(states)}

        def top_up() -> None:
            while queue and self._free:
                st = queue.popleft()
                if st.id not in self._landed and st.shard.untyped_storage().nbytes() == 0:
                    buf = self._free.pop()
                    self._landed[st.id] = (buf, self._read_nvme(st.id, buf))

        try:
            top_up()
            for st in states:
                self.fetch(st)
                top_up()
        finally:
            self._bucket = {}
        self._read_ahead()

    # -- values (checkpoints, step write-back, modifiers) --------------------------------------
    @torch.no_grad()
    def read(self, st: PartitionState) -> torch.Tensor:
        """A new CPU tensor with the shard's values (from the home; whole shard, padding included)."""
        if st.id in self.host:
            return self.host[st.id].clone()
        self._drop_landed(st.id)
        self.wh.wait()
        self._free.extend(self._writing)
        self._writing.clear()
        buf = self._take()
        self._settle(self._read_nvme(st.id, buf))
        self._verify(st.id, buf)
        out = buf[: _nbytes(st)].view(st.shard.dtype).clone()
        self._free.append(buf)
        return out

    @torch.no_grad()
    def write(self, st: PartitionState, values: torch.Tensor) -> None:
        """Set the shard to ``values`` (cast to its dtype) at its home (and in a live device copy)."""
        v = values.detach().reshape(-1)
        if v.numel() != st.shard_numel:
            raise ValueError(
                f"ParamOffload.write: {v.numel()} values for a shard of {st.shard_numel} elements"
            )
        if st.shard.untyped_storage().nbytes() > 0:
            st.shard.copy_(v)
        if st.id in self.host:
            self.fetched.wait()  # a copy to the device may still read the home
            self.host[st.id].copy_(v)
            return
        self._drop_landed(st.id)
        self._write_nvme(st.id, v.to(st.shard.dtype))

    @torch.no_grad()
    def set_dtype(self, p: torch.nn.Parameter, dtype: torch.dtype) -> None:
        """Change the shard's dtype (the strategy's training dtype after zero.Init placed it).

        The shard gets a new home here at once (its old NVMe region is left unused), so changing
        the dtype of every parameter holds one shard in memory at a time, not the partition."""
        st = partition_state(p)
        values = self.read(st).to(dtype)
        del self.params[st.id]
        self.host.pop(st.id, None)
        self.offset.pop(st.id, None)
        st.store = PLAIN_SHARDS
        st.shard = torch.empty(st.shard_numel, dtype=dtype, device=st.shard.device)
        st.shard.copy_(values)
        p.zero_shard = st.shard
        del values
        self.adopt([p])

    # -- NVMe plumbing ------------------------------------------------------------------------
    def _take(self) -> torch.Tensor:
        if not self._free and self._writing:
            self.wh.wait()
            self._free.extend(self._writing)
            self._writing.clear()
        if not self._free and self._landed:
            self._drop_landed(self._furthest_landed())
        return self._free.pop()

    def _furthest_landed(self) -> int:
        """The read-ahead to evict: never one of the bucket being fetched; else one the latest
        trace scan no longer wants (gathered by other means, or its use is past), else the one
        wanted last."""
        bucket, rank = self._bucket, self._wanted

        def distance(pid: int) -> int:
            return bucket[pid] - len(bucket) if pid in bucket else rank.get(pid, len(rank))

        return max(self._landed, key=distance)

    def _read_nvme(self, pid: int, buf: torch.Tensor) -> Any:
        """Start reading ``pid``'s shard into ``buf`` on an idle handle; returns that handle."""
        assert self.swap_dir is not None
        if self._writing:  # a read must see every earlier write of the same file
            self.wh.wait()
            self._free.extend(self._writing)
            self._writing.clear()
        name, offset = self.offset[pid]
        n = _round(_nbytes(partition_state(self.params[pid])))
        if self._idle_readers:
            reader = self._idle_readers.pop()
        else:  # at most one read per buffer is in flight, plus the one of read()
            reader = AsyncIOHandle(**self._aio_kw)
            self._readers.append(reader)
        reader.async_pread(buf[:n], self.swap_dir.check(name), offset)
        return reader

    def _settle(self, reader: Any) -> None:
        """Wait for the read submitted on ``reader`` and make the handle idle again."""
        try:
            reader.wait()
        finally:
            self._idle_readers.append(reader)

    def _write_nvme(self, pid: int, values: torch.Tensor) -> None:
        assert self.swap_dir is not None
        buf = self._take()
        nb = values.numel() * values.element_size()
        buf[:nb].view(values.dtype).copy_(values.reshape(-1))
        name, offset = self.offset[pid]
        self.sums.record(name, offset, buf[:nb])
        self.wh.async_pwrite(buf[: _round(nb)], self.swap_dir.check(name), offset)
        self._writing.append(buf)

    def _verify(self, pid: int, buf: torch.Tensor) -> None:
        """The shard read into ``buf`` is what was written (see [Note: swap checksums])."""
        name, offset = self.offset[pid]
        self.sums.verify(name, offset, buf[: _nbytes(partition_state(self.params[pid]))])

    def _drop_landed(self, pid: int) -> None:
        landed = self._landed.pop(pid, None)
        if landed is not None:
            buf, reader = landed
            self._settle(reader)
            self._free.append(buf)

    def _read_ahead(self) -> None:
        """Read the next NVMe-homed shards of the recorded trace into buffers (See [Note: read-ahead])."""
        co = self.coordinator
        if self.device != "nvme" or co is None or co.trace is None:
            return
        from zero_core.zero.stage3.param_coordinator import module_params

        # The next buffer_count NVMe-homed shards in order of use. A shard gathered now (kept by
        # the coordinator for its reuse) takes a place too without being read: it may be released
        # and needed again soon, and shards further away would be read only to be dropped.
        want: dict[int, int] = {}  # pid -> rank in order of use
        held: set[int] = set()
        for idx, _phase in co.trace[co.pos :]:
            if idx < 0:
                continue
            for q in module_params(co.modules[idx]):
                st = partition_state(q)
                if st.store is not self or st.id in self.host or st.id in want:
                    continue
                if st.status is not ParamStatus.NOT_AVAILABLE or st.shard.untyped_storage().nbytes() > 0:
                    if st.persistent:
                        continue
                    held.add(st.id)
                want[st.id] = len(want)
            if len(want) >= self.buffer_count:
                break
        self._wanted = want
        for pid in want:
            if pid in self._landed or pid in held:
                continue
            if not self._free:
                stale = [q for q in self._landed if q not in want]
                if not stale:
                    return
                self._drop_landed(stale[0])
            buf = self._free.pop()
            self._landed[pid] = (buf, self._read_nvme(pid, buf))

    # -- accounting and teardown --------------------------------------------------------------
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of the parameter homes and buffers (host side), and of the device copies alive now."""
        return {
            "offloaded_parameters_device": sum(
                partition_state(p).shard.untyped_storage().nbytes() for p in self.params.values()
            ),
            "host_parameters": sum(t.numel() * t.element_size() for t in self.host.values()),
            "host_param_swap_buffers": sum(b.numel() for b in self._buffers),
            "nvme_parameters": self._file_bytes,
        }

    def owns(self, p: torch.nn.Parameter) -> bool:
        return partition_state(p).store is self

    def swap_io_bytes(self) -> dict[str, int]:
        """Bytes read from and written to the parameter swap files so far."""
        if self.swap_dir is None:
            return {"read": 0, "written": 0}
        return {"read": sum(r.bytes_read for r in self._readers), "written": self.wh.bytes_written}

    def close(self) -> None:
        """Wait for I/O and remove the swap file (see [Note: swap file lifecycle])."""
        if self.swap_dir is not None:
            for reader in self._readers:
                reader.wait()
            self.wh.wait()
            self.swap_dir.close()


def build_param_offload(
    zero_config: ZeroOptimizationConfig, aio_config: AioConfig | None = None, *, rank: int = 0
) -> ParamOffload | None:
    """The :class:`ParamOffload` that ``zero_optimization.offload_param`` asks for (None when off)."""
    op = zero_config.offload_param
    if op is None or not op.enabled:
        return None
    if zero_config.stage != 3:
        raise ValueError(
            f"zero_optimization.offload_param: offloading parameters needs stage 3, got stage {zero_config.stage}"
        )
    return ParamOffload(
        op.device,
        rank=rank,
        nvme_path=None if op.nvme_path is None else str(op.nvme_path),
        buffer_count=int(op.buffer_count),
        buffer_size=int(op.buffer_size),
        max_in_cpu=int(op.max_in_cpu),
        pin_memory=bool(op.pin_memory),
        aio=aio_config.model_dump() if aio_config is not None else {},
    )
