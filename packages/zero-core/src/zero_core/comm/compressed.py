"""Error-compensated 1-bit all-reduce, the exchange of 1-bit Adam, 0/1 Adam and 1-bit LAMB.

[Note: compressed all-reduce]
The 1-bit Adam paper (arXiv 2102.02888) averages a tensor over the data-parallel group in
two phases, each sending one sign bit per element plus a scale, and carries what the
compression lost into the next call (error feedback):

1. worker: ``c = x + worker_error``; the flat tensor is cut into ``world_size`` equal chunks
   (chunk ``i`` goes to rank ``i``), each compressed to its signs (``c >= 0`` gives +1, as
   DeepSpeed's backends do, so zero has a sign) and one scale per *segment* of the chunk, the
   root mean square of that segment; ``worker_error = c - scale * sign``. The packed bits
   (8 per byte) and the fp32 scales of chunk ``i`` travel to rank ``i`` in one
   ``all_to_all_single`` of bytes.
2. server: rank ``i`` decompresses the ``world_size`` copies of its chunk, averages them,
   adds ``server_error`` and compresses again the same way (``server_error`` keeps the
   loss); the compressed chunks are gathered to every rank with one ``all_gather``, and every
   rank writes the same decompressed average back into ``x``.

Segments let a caller keep one scale per parameter tensor within a chunk (the optimizers of
``zero_core.optim.onebit`` lay each tensor's ``1/world_size`` share into every chunk, see
[Note: chunk-major layout]): a flat buffer mixing embeddings and layer norms under one scale
would turn small entries into large ones. Without ``segment_ids`` each chunk has one scale.

The comms logger records one ``compressed_all_reduce`` per call with the size of the
compressed tensor: ``world_size`` chunks of ``L/8`` bytes of bits and ``4 * num_segments``
bytes of scales, the counterpart of ``all_reduce`` recording its tensor's size. Each phase
moves ``(world_size - 1) / world_size`` of that per rank, like the two halves of a ring
all-reduce, so the ratio to a dense fp32 ``all_reduce`` of the same tensor is the ratio of
these logged sizes (about 1/32).

Everything stays on the tensor's device and nothing waits for the host, so the call can sit
inside a training step on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zero_core.comm._issue import begin, check_tensor
from zero_core.comm.collectives import _all_gather, _prepare

_BITS = 8


def padded_numel(numel: int, world_size: int) -> int:
    """The smallest length >= ``numel`` that splits into ``world_size`` whole-byte chunks."""
    if numel < 0 or world_size < 1:
        raise ValueError(f"padded_numel: need numel >= 0 and world_size >= 1, got {numel}, {world_size}")
    unit = _BITS * world_size
    return -(-numel // unit) * unit


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(_BITS - 1, -1, -1, dtype=torch.uint8, device=device)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Sign bits of ``x`` (1 where ``x >= 0``) packed 8 per byte along the last dimension."""
    if x.shape[-1] % _BITS:
        raise ValueError(f"pack_signs: the last dimension ({x.shape[-1]}) must be a multiple of 8")
    bits = (x >= 0).to(torch.uint8).reshape(*x.shape[:-1], -1, _BITS)
    return torch.bitwise_left_shift(bits, _shifts(x.device)).sum(dim=-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`pack_signs`: +1/-1 values of ``dtype``, 8 per byte."""
    bits = torch.bitwise_right_shift(packed.unsqueeze(-1), _shifts(packed.device)).bitwise_and_(1)
    return bits.reshape(*packed.shape[:-1], -1).to(dtype).mul_(2).sub_(1)


def _segment_scales(x: torch.Tensor, seg: torch.Tensor, counts: torch.Tensor, segments: int) -> torch.Tensor:
    """Root mean square of each segment of each row of ``x`` ``(rows, L)``: ``(rows, segments)`` fp32."""
    sq = torch.zeros(x.shape[0], segments, dtype=torch.float32, device=x.device)
    sq.index_add_(1, seg, x.float().square())
    return sq.div_(counts).sqrt_()


def _compress(
    x: torch.Tensor, seg: torch.Tensor, counts: torch.Tensor, segments: int, error: torch.Tensor
) -> torch.Tensor:
    """Rows of ``x`` as ``[bits | fp32 scales]`` bytes; ``error`` receives ``x`` minus what the bytes say."""
    scales = _segment_scales(x, seg, counts, segments)
    signs = torch.where(x >= 0, 1.0, -1.0).to(x.dtype)
    error.copy_(x - signs * scales[:, seg].to(x.dtype))
    return torch.cat([pack_signs(x), scales.view(torch.uint8)], dim=1)


def _decompress(payload: torch.Tensor, width: int, seg: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(rows, L)`` values of ``dtype`` from rows of ``[bits | fp32 scales]`` bytes."""
    bits, scales = payload[:, : width // _BITS], payload[:, width // _BITS :].contiguous().view(torch.float32)
    return unpack_signs(bits, dtype).mul_(scales[:, seg].to(dtype))


def _check(
    tensor: Any, worker_error: Any, server_error: Any, segment_ids: Any, num_segments: int, n: int
) -> None:
    where = "compressed_all_reduce"
    for name, t in (("tensor", tensor), ("worker_error", worker_error), ("server_error", server_error)):
        check_tensor(t, name, where)
        if not t.is_floating_point() or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"zero_core.comm.{where}: {name} must be a contiguous 1-D floating-point tensor")
        if t.dtype != tensor.dtype or t.device != tensor.device:
            raise ValueError(f"zero_core.comm.{where}: {name} must share the tensor's dtype and device")
    if tensor.numel() % (_BITS * n):
        raise ValueError(
            f"zero_core.comm.{where}: tensor has {tensor.numel()} elements, not a multiple of 8 x world_size "
            f"({_BITS * n}); pad it to padded_numel(numel, world_size) = {padded_numel(tensor.numel(), n)}"
        )
    if worker_error.numel() != tensor.numel() or server_error.numel() != tensor.numel() // n:
        raise ValueError(
            f"zero_core.comm.{where}: worker_error must have the tensor's {tensor.numel()} elements and "
            f"server_error tensor.numel() / world_size = {tensor.numel() // n}; got "
            f"{worker_error.numel()} and {server_error.numel()}"
        )
    if isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments < 1:
        raise ValueError(f"zero_core.comm.{where}: num_segments must be an int >= 1, got {num_segments!r}")
    if segment_ids is not None:
        check_tensor(segment_ids, "segment_ids", where)
        if segment_ids.dtype != torch.int64 or segment_ids.shape != (tensor.numel() // n,):
            raise ValueError(
                f"zero_core.comm.{where}: segment_ids must be an int64 tensor of one chunk's length "
                f"({tensor.numel() // n}), got {segment_ids.dtype} of shape {tuple(segment_ids.shape)}"
            )


def compressed_size(numel: int, world_size: int, num_segments: int = 1) -> int:
    """Bytes of the compressed form of a padded tensor of ``numel`` elements (what the logger records)."""
    return world_size * (numel // world_size // _BITS + 4 * num_segments)


@torch.no_grad()
def compressed_all_reduce(
    tensor: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group: Any = None,
    *,
    segment_ids: torch.Tensor | None = None,
    num_segments: int = 1,
) -> torch.Tensor:
    """Average ``tensor`` over ``group`` in place through the two-phase 1-bit exchange.

    ``tensor`` is flat with ``padded_numel`` elements; ``worker_error`` (same size) and
    ``server_error`` (one chunk, ``numel / world_size``) are this rank's error-feedback buffers,
    updated in place, to be passed again on the next call. ``segment_ids`` (int64, one chunk
    long, values in ``[0, num_segments)``) gives each element of a chunk its segment: one scale
    per segment and chunk. See [Note: compressed all-reduce]. Returns ``tensor``.
    """
    n = _prepare("compressed_all_reduce", group)
    _check(tensor, worker_error, server_error, segment_ids, num_segments, n)
    if n == 1:
        return tensor  # the average over one rank is the tensor itself; nothing is sent
    width = tensor.numel() // n
    dev = tensor.device
    seg = segment_ids if segment_ids is not None else torch.zeros(width, dtype=torch.int64, device=dev)
    counts = torch.zeros(num_segments, dtype=torch.float32, device=dev)
    counts.index_add_(0, seg, torch.ones(width, dtype=torch.float32, device=dev)).clamp_(min=1.0)
    record = begin("compressed_all_reduce", group, compressed_size(tensor.numel(), n, num_segments), dev)

    # phase 1 (worker): compress every chunk, send chunk i to rank i
    corrected = tensor.view(n, width) + worker_error.view(n, width)
    sent = _compress(corrected, seg, counts, num_segments, worker_error.view(n, width))
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    # phase 2 (server): average this rank's chunk, compress it again, gather every chunk
    mine = _decompress(received, width, seg, tensor.dtype).sum(dim=0).div_(n).add_(server_error)
    chunk = _compress(mine.unsqueeze(0), seg, counts, num_segments, server_error.view(1, width))
    gathered = torch.empty(n, chunk.shape[1], dtype=torch.uint8, device=dev)
    _all_gather(gathered.view(-1), chunk.view(-1), group=group)
    tensor.view(n, width).copy_(_decompress(gathered, width, seg, tensor.dtype))

    if record is not None:
        record.finish()
    return tensor
