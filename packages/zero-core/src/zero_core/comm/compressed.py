"""Error-compensated 1-bit all-reduce, the exchange of 1-bit Adam, 0/1 Adam and 1-bit LAMB.

[Note: compressed all-reduce]
The 1-bit Adam paper (arXiv 2102.02888) averages a tensor over the data-parallel group in
two phases, each sending one sign bit per element plus a scale, and carries what the
compression lost into the next call (error feedback):

1. worker: ``c = x + worker_error``; the flat tensor is cut into ``world_size`` equal chunks
   (chunk ``i`` goes to rank ``i``), each compressed to its signs (+1 where the sign bit is clear, so a zero
   has a sign, as in DeepSpeed's backends) and one scale per *segment* of the chunk, the root
   mean square of that segment; ``worker_error = c - scale * sign``. The packed bits
   (8 per byte) and the fp32 scales of chunk ``i`` travel to rank ``i`` in one
   ``all_to_all_single`` of bytes.
2. server: rank ``i`` decompresses the ``world_size`` copies of its chunk, averages them,
   adds ``server_error`` and compresses again the same way (``server_error`` keeps the
   loss); the compressed chunks are gathered to every rank with one ``all_gather``, and every
   rank writes the same decompressed average back into ``x``.

Segments (consecutive column ranges of a chunk, sizes given as Python ints so no device value is
ever read back) let a caller keep one scale per parameter tensor within a chunk (the optimizers of
zero-ops' ``zero_ops.onebit`` lay each tensor's ``1/world_size`` share into every chunk, see
[Note: chunk-major layout]): a flat buffer mixing embeddings and layer norms under one scale
would turn small entries into large ones. Without ``segment_sizes`` each chunk has one scale.

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

import functools
from collections.abc import Sequence
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


@functools.lru_cache(maxsize=16)
def _masks(device: torch.device) -> torch.Tensor:
    """Bit ``k`` of a byte holds element ``k`` of its eight. Cached: building it copies from the
    host, which on a GPU would wait for the queued work inside every training step."""
    return torch.tensor([1 << k for k in range(_BITS)], dtype=torch.uint8, device=device)


@functools.lru_cache(maxsize=16)
def _sign_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The +1/-1 signs of every byte value, ``(256, 8)``: one gather unpacks a byte."""
    byte = torch.arange(256, device=device).to(torch.uint8).unsqueeze(1)
    return torch.where(torch.bitwise_and(byte, _masks(device)).ne(0), 1.0, -1.0).to(dtype)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Sign bits of ``x`` (1 where the sign bit is clear) packed 8 per byte along the last dimension."""
    if x.shape[-1] % _BITS:
        raise ValueError(f"pack_signs: the last dimension ({x.shape[-1]}) must be a multiple of 8")
    # Eight 0/1 bytes read as one little-endian int64 (byte k at bit 8k); three shift-ors fold byte k's bit into
    # bit k of the low byte. Bit 63 stays clear, so the arithmetic shifts bring in zeros.
    word = torch.signbit(x).view(torch.uint8).view(torch.int64)
    word = word | (word >> 7)
    word = word | (word >> 14)
    word = word | (word >> 28)
    return word.bitwise_and_(0xFF).to(torch.uint8).bitwise_not_()


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`pack_signs`: +1/-1 values of ``dtype``, 8 per byte."""
    flat = torch.nn.functional.embedding(packed.reshape(-1).long(), _sign_table(packed.device, dtype))
    return flat.view(*packed.shape[:-1], packed.shape[-1] * _BITS)


def _bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


def _compress(x: torch.Tensor, bounds: list[tuple[int, int]], error: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` as ``[bits | fp32 scales]`` bytes; ``error`` receives ``x`` minus what the bytes say."""
    # one scale per row and segment: the root mean square (what keeps the row's norm)
    scales = torch.stack(
        [
            torch.linalg.vector_norm(x[:, a:b], dim=1, dtype=torch.float32).div_((b - a) ** 0.5)
            for a, b in bounds
        ],
        dim=1,
    )
    sent = torch.empty_like(x)
    s = scales.to(x.dtype)
    for k, (a, b) in enumerate(bounds):
        torch.copysign(s[:, k : k + 1], x[:, a:b], out=sent[:, a:b])
    torch.sub(x, sent, out=error)
    return torch.cat([pack_signs(x), scales.view(torch.uint8)], dim=1)


def _decompress(
    payload: torch.Tensor, width: int, bounds: list[tuple[int, int]], dtype: torch.dtype
) -> torch.Tensor:
    """``(rows, L)`` values of ``dtype`` from rows of ``[bits | fp32 scales]`` bytes."""
    bits, scales = payload[:, : width // _BITS], payload[:, width // _BITS :].contiguous().view(torch.float32)
    out = unpack_signs(bits, dtype)
    s = scales.to(dtype)
    for k, (a, b) in enumerate(bounds):
        out[:, a:b].mul_(s[:, k : k + 1])
    return out


def _check(
    tensor: Any, worker_error: Any, server_error: Any, segment_sizes: Any, n: int
) -> list[tuple[int, int]]:
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
    width = tensor.numel() // n
    if segment_sizes is None:
        return [(0, width)]
    sizes = list(segment_sizes) if isinstance(segment_sizes, (list, tuple)) else None
    if (
        not sizes
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes)
        or sum(sizes) != width
    ):
        raise ValueError(
            f"zero_core.comm.{where}: segment_sizes must be a list of ints >= 1 summing to one chunk's length "
            f"({width}), got {segment_sizes!r}"
        )
    return _bounds(sizes)


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
    segment_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Average ``tensor`` over ``group`` in place through the two-phase 1-bit exchange.

    ``tensor`` is flat with ``padded_numel`` elements; ``worker_error`` (same size) and
    ``server_error`` (one chunk, ``numel / world_size``) are this rank's error-feedback buffers,
    updated in place, to be passed again on the next call. ``segment_sizes`` (Python ints
    summing to one chunk's length) cuts every chunk into consecutive segments with one scale
    each; None is one segment per chunk. See [Note: compressed all-reduce]. Returns ``tensor``.
    """
    n = _prepare("compressed_all_reduce", group)
    bounds = _check(tensor, worker_error, server_error, segment_sizes, n)
    if n == 1:
        return tensor  # the average over one rank is the tensor itself; nothing is sent
    width = tensor.numel() // n
    dev = tensor.device
    record = begin("compressed_all_reduce", group, compressed_size(tensor.numel(), n, len(bounds)), dev)

    # phase 1 (worker): compress every chunk, send chunk i to rank i
    corrected = tensor.view(n, width) + worker_error.view(n, width)
    sent = _compress(corrected, bounds, worker_error.view(n, width))
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    # phase 2 (server): average this rank's chunk, compress it again, gather every chunk
    mine = _decompress(received, width, bounds, tensor.dtype).sum(dim=0).div_(n).add_(server_error)
    chunk = _compress(mine.unsqueeze(0), bounds, server_error.view(1, width))
    gathered = torch.empty(n, chunk.shape[1], dtype=torch.uint8, device=dev)
    _all_gather(gathered.view(-1), chunk.view(-1), group=group)
    tensor.view(n, width).copy_(_decompress(gathered, width, bounds, tensor.dtype))

    if record is not None:
        record.finish()
    return tensor
