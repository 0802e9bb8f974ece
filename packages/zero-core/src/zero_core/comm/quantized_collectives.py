"""Quantized collectives of ZeRO++ (arXiv 2306.10209): qwZ's all-gather, qgZ's reduce-scatter.

[Note: quantized weight all-gather (qwZ)]
The shards of a gather bucket are concatenated into one fp32 stream per rank, block-quantized
to int8 (see [Note: block quantization]) and sent as one byte buffer, ``[payload | scales]``,
through ``zero_core.comm.all_gather_into_tensor`` (so the comms logger counts the real bytes:
about half of a 16-bit gather, a quarter of an fp32 one, plus 4 bytes of scale per block).
Blocks may span two parameters of the bucket, as in DeepSpeed's flat-buffer quantization;
padding is per bucket, not per parameter. On arrival every rank's stream is dequantized into
the parameters' full buffers in their dtype. Only the gathered copy is approximate: the shard
and the fp32 master are never quantized. Stage 3 quantizes the gathers of the forward pass only
(the coordinator knows the phase; a prefetch bucket never spans forward and backward): backward,
``GatheredParameters`` and other on-demand gathers are full precision. A weight still gathered
from forward when it is used again (``max_reuse_distance``, or code inside that module's forward)
is the quantized copy, as the forward computed with it.

[Note: quantized gradient reduce-scatter (qgZ)]
A gradient bucket is a ``(N, S)`` buffer whose row r is what rank r must receive summed (see
[Note: stage 3 gradient buckets]). Instead of a reduce-scatter, which sums in the wire dtype
at every hop, qgZ moves int4 blocks with all-to-alls and sums in fp32 after dequantizing:

1. inside the node (``L`` ranks, local index ``l``), local peer ``j`` gets the rows of every
   rank whose local index is ``j`` -- rows ``m * L + j`` for nodes ``m`` -- quantized; each rank
   dequantizes what its ``L`` peers sent and sums: it now holds, for every node ``m``, this node's
   partial sum of row ``m * L + l``.
2. across nodes (the ``M`` ranks with the same local index), node ``m`` gets the partial sum of
   row ``m * L + l``, re-quantized; each rank dequantizes the ``M`` partial sums of its own row
   and adds them.

Rows are picked by global index in both hops, so rank r ends with exactly row r summed over all
ranks: the same shard layout as the plain reduce-scatter (the permutation that the paper's
tensor-slicing formulation must undo never arises). Only ``1/L`` of the quantized volume
crosses nodes. With one node (or one rank per node) step 1 (or step 2) is the only hop. Rows
are padded to whole blocks so a block never mixes two destinations.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from zero_core import comm
from zero_core.comm.quantize import dequantize_blocks, num_blocks, quantize_blocks
from zero_core.comm.work import Work

#: qwZ: int8 weights in blocks of 256 elements (scale overhead 4/256 byte per element).
WEIGHT_BITS, WEIGHT_BLOCK = 8, 256
#: qgZ: int4 gradients in blocks of 256 elements, as the ZeRO++ paper's 4-bit gradients.
GRAD_BITS, GRAD_BLOCK = 4, 256
_ALIGN = 16


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _pack(values: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """``(rows, cols)`` floats (cols a multiple of ``block``) -> ``(rows, bytes)`` uint8 ``[payload | scales]``."""
    rows, cols = values.shape
    qt = quantize_blocks(values, bits, block)
    pb = cols * bits // 8
    out = torch.empty(rows, pb + 4 * (cols // block), dtype=torch.uint8, device=values.device)
    out[:, :pb].copy_(qt.payload.view(rows, pb))
    out[:, pb:].copy_(qt.scales.view(rows, cols // block).view(torch.uint8))
    return out


def _unpack(packed: torch.Tensor, cols: int, bits: int, block: int) -> torch.Tensor:
    """Inverse of :func:`_pack`: ``(rows, bytes)`` -> ``(rows, cols)`` fp32."""
    rows = packed.shape[0]
    pb = cols * bits // 8
    payload = packed[:, :pb].reshape(-1)
    scales = packed[:, pb : pb + 4 * (cols // block)].contiguous().view(torch.float32).reshape(-1)
    return dequantize_blocks(
        payload, scales, rows * cols, bits=bits, block_size=block, dtype=torch.float32
    ).view(rows, cols)


# -- qwZ ------------------------------------------------------------------------------------
def quantized_all_gather(
    shards: list[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    bits: int = WEIGHT_BITS,
    block_size: int = WEIGHT_BLOCK,
    aligned: bool = False,
) -> tuple[Work | None, Callable[[int, torch.Tensor], None]]:
    """Start an all-gather of ``shards`` (this rank's, same sizes on every rank) quantized.

    Returns ``(work, unpack)``: after ``work.wait()``, ``unpack(i, full)`` writes the gathered,
    dequantized values of shard ``i`` from every rank (rank order, ``world * shard.numel()``
    elements) into the flat tensor ``full`` in its dtype. ``aligned`` starts every shard on a block
    boundary (the blocks of shards stored quantized; see [Note: quantized frozen shards]). See
    [Note: quantized weight all-gather (qwZ)].
    """
    if not shards:
        raise ValueError("quantized_all_gather: no shards to gather")
    world = comm.get_world_size(group)
    sizes = [s.numel() for s in shards]
    step = [num_blocks(n, block_size) * block_size if aligned else n for n in sizes]
    offsets = [sum(step[:i]) for i in range(len(step))]
    cols = num_blocks(sum(step), block_size) * block_size
    stream = torch.zeros(1, cols, dtype=torch.float32, device=shards[0].device)
    for s, off in zip(shards, offsets):
        stream[0, off : off + s.numel()].copy_(s.reshape(-1))
    send = _pack(stream, bits, block_size).view(-1)
    chunk = _aligned(send.numel())
    if chunk != send.numel():
        send = torch.cat((send, send.new_zeros(chunk - send.numel())))
    recv = torch.empty(world * chunk, dtype=torch.uint8, device=send.device)
    work = comm.all_gather_into_tensor(recv, send, group=group, async_op=True)
    nbytes = cols * bits // 8 + 4 * (cols // block_size)
    values: list[torch.Tensor] = []

    def unpack(i: int, full: torch.Tensor) -> None:
        if not values:  # dequantize every rank's stream once, on first use
            values.append(_unpack(recv.view(world, chunk)[:, :nbytes], cols, bits, block_size))
        n, off = sizes[i], offsets[i]
        full.view(world, n).copy_(values[0][:, off : off + n])

    unpack.buffers = (recv,)  # type: ignore[attr-defined]  # made on a side stream: See [Note: stage-3 streams]
    return work, unpack


# -- qgZ ------------------------------------------------------------------------------------
class QuantizedReduceScatter:
    """An in-flight qgZ reduce-scatter; :meth:`wait` finishes it into ``out``.

    See [Note: quantized gradient reduce-scatter (qgZ)]. Hop 1 is launched at construction (so
    it overlaps with backward like the plain reduce-scatter); hop 2 needs hop 1's sums and runs
    inside :meth:`wait`.
    """

    def __init__(
        self,
        out: torch.Tensor,
        rows: torch.Tensor,
        intra: dist.ProcessGroup | None,
        inter: dist.ProcessGroup | None,
        bits: int,
        block: int,
    ) -> None:
        self.out, self.inter, self.bits, self.block = out, inter, bits, block
        n, s = rows.shape
        self.local = comm.get_world_size(intra)
        self.nodes = 1 if inter is None else comm.get_world_size(inter)
        if self.local * self.nodes != n:
            raise ValueError(
                f"quantized_reduce_scatter: {n} rows but the groups hold {self.local} x {self.nodes} ranks"
            )
        self.cols = num_blocks(s, block) * block
        if self.cols == s:  # whole blocks: no padded copy
            padded = rows
        else:
            padded = rows.new_zeros(n, self.cols)
            padded[:, :s].copy_(rows)
        # peer j (local index) receives rows m * L + j for every node m: (L, M * cols)
        by_peer = padded.view(self.nodes, self.local, self.cols).transpose(0, 1).reshape(-1, self.cols)
        send = _pack(by_peer, bits, block).view(self.local, -1)
        self._recv1 = torch.empty_like(send)
        self._work1 = comm.all_to_all_single(self._recv1, send, group=intra, async_op=True)
        self.done = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self.done:
            return True
        self.done = True
        self._work1.wait(timeout)
        got = _unpack(self._recv1.view(self.local * self.nodes, -1), self.cols, self.bits, self.block)
        partial = got.view(self.local, self.nodes, self.cols).sum(dim=0)  # (M, cols), fp32
        self._recv1 = None
        if self.nodes > 1:
            send = _pack(partial, self.bits, self.block)
            recv = torch.empty_like(send)
            comm.all_to_all_single(recv, send, group=self.inter, async_op=True).wait(timeout)
            partial = _unpack(recv, self.cols, self.bits, self.block).sum(dim=0, keepdim=True)
        self.out.copy_(partial[0, : self.out.numel()])
        return True


def quantized_reduce_scatter(
    out: torch.Tensor,
    rows: torch.Tensor,
    intra_group: dist.ProcessGroup | None,
    inter_group: dist.ProcessGroup | None = None,
    *,
    bits: int = GRAD_BITS,
    block_size: int = GRAD_BLOCK,
) -> QuantizedReduceScatter:
    """Start qgZ's reduce-scatter of ``rows`` (``(N, S)``, row r for global/group rank r) into ``out``.

    ``intra_group`` holds the ``L`` ranks of this node and ``inter_group`` the ranks with this
    rank's local index on every node (``zero_core.comm.topology.node_groups()``), numbered
    node-major; with ``inter_group=None`` ``intra_group`` is the whole reducing group and there
    is one hop. ``out`` (``S`` elements, any float dtype) receives this rank's row summed over
    all ranks. Returns a handle whose ``wait()`` completes it.
    """
    if rows.dim() != 2 or not rows.is_floating_point():
        raise ValueError(
            f"quantized_reduce_scatter: rows must be a 2-D float tensor, got {tuple(rows.shape)}"
        )
    if out.numel() != rows.shape[1]:
        raise ValueError(
            f"quantized_reduce_scatter: out has {out.numel()} elements, rows have {rows.shape[1]} columns"
        )
    return QuantizedReduceScatter(out, rows, intra_group, inter_group, bits, block_size)


class QgzReducer:
    """Launches qgZ reduce-scatters for the buckets of one data-parallel ``group``.

    Built once (collective: it may create the node groups of ``zero_core.comm.topology``). When
    ``group`` is the whole world and the topology has several nodes of several ranks, buckets go
    through both hops; otherwise (one node, one rank per node, or a sub-group such as an
    expert-data-parallel group) through one all-to-all over their own group.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        from zero_core.comm.topology import current_topology, node_groups

        self.group = group
        topo = current_topology()
        self.hierarchical = (
            comm.get_world_size(group) == topo.world_size and 1 < topo.ranks_per_node < topo.world_size
        )
        self.intra, self.inter = node_groups() if self.hierarchical else (None, None)

    def __call__(
        self, out: torch.Tensor, rows: torch.Tensor, group: dist.ProcessGroup | None
    ) -> QuantizedReduceScatter:
        # a group of the whole world numbers its ranks as the world does (node-major)
        if self.hierarchical and comm.get_world_size(group) == comm.get_world_size():
            return quantized_reduce_scatter(out, rows, self.intra, self.inter)
        return quantized_reduce_scatter(out, rows, group)
