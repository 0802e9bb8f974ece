"""Symmetric block-wise int8 / int4 quantization of flat tensors (ZeRO++'s qwZ and qgZ).

[Note: block quantization]
A flat tensor of ``n`` elements is zero-padded to a multiple of ``block_size`` and cut into
blocks. Each block gets one fp32 scale ``s = absmax / qmax`` (``qmax`` = 127 for int8, 7 for
int4) and its values become ``q = round(x / s)`` in ``[-qmax, qmax]``; dequantization is
``q * s``. Rounding to the nearest integer step bounds the error of every element by ``s / 2 =
absmax / (2 * qmax)`` of its block (plus the rounding of the output dtype), and the element of
largest magnitude comes back exactly (``q = ±qmax``), so re-quantizing dequantized values with
the same blocks reproduces them. An all-zero block has scale 0 and comes back as zeros.

Storage: int8 values are one byte each (two's complement, carried as ``uint8`` so that every
payload is one dtype on the wire); int4 values are stored offset by 8 (``1..15``) and packed two
per byte, the even element in the low nibble. Blocks are what the ZeRO++ paper (arXiv
2306.10209) uses instead of one scale per tensor: an outlier then only coarsens its own block.
Everything here is plain torch on the input's device (no host reads), so it runs on CPU and
GPU alike and inside the training step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Largest quantized magnitude per bit width (symmetric: -qmax..qmax).
QMAX: dict[int, int] = {8: 127, 4: 7}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check(bits: int, block_size: int, where: str) -> None:
    if bits not in QMAX:
        raise ValueError(f"{where}: bits must be 8 or 4, got {bits!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size % 2:
        raise ValueError(f"{where}: block_size must be an even int >= 2, got {block_size!r}")


def num_blocks(numel: int, block_size: int) -> int:
    """Blocks covering ``numel`` elements (the last one zero-padded)."""
    return -(-numel // block_size)


def payload_bytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of the packed values of ``numel`` elements (padded to whole blocks)."""
    return num_blocks(numel, block_size) * block_size * bits // 8


def quantized_bytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes on the wire for ``numel`` elements: packed values plus one fp32 scale per block."""
    return payload_bytes(numel, bits, block_size) + 4 * num_blocks(numel, block_size)


@dataclass
class Quantized:
    """A block-quantized flat tensor: ``payload`` (uint8), ``scales`` (fp32, one per block)."""

    payload: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block_size: int


@torch.no_grad()
def quantize_blocks(x: torch.Tensor, bits: int = 8, block_size: int = 256) -> Quantized:
    """Quantize ``x`` (any shape, float dtype) block-wise; see [Note: block quantization]."""
    _check(bits, block_size, "quantize_blocks")
    if not torch.is_tensor(x) or x.dtype not in _FLOATS:
        raise TypeError(
            f"quantize_blocks: x must be a float32/float16/bfloat16 tensor, got "
            f"{x.dtype if torch.is_tensor(x) else type(x).__name__}"
        )
    flat = x.reshape(-1)
    n = flat.numel()
    nb = num_blocks(n, block_size)
    if n == nb * block_size:  # whole blocks: no padded copy (large gradient buckets)
        blocks = flat.view(nb, block_size)
    else:
        blocks = torch.zeros(nb * block_size, dtype=torch.float32, device=x.device)
        blocks[:n].copy_(flat)
        blocks = blocks.view(nb, block_size)
    qmax = QMAX[bits]
    scales = blocks.abs().amax(dim=1).float() / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks.float() / safe.unsqueeze(1)).clamp_(-qmax, qmax).to(torch.int8)
    if bits == 8:
        payload = q.view(torch.uint8).reshape(-1)
    else:
        u = (q + 8).to(torch.uint8).view(-1, 2)
        payload = (u[:, 0] | (u[:, 1] << 4)).contiguous()
    return Quantized(payload, scales, n, bits, block_size)


@torch.no_grad()
def dequantize_blocks(
    payload: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    *,
    bits: int = 8,
    block_size: int = 256,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The flat ``numel`` values of a quantized tensor, in ``dtype`` (written into ``out`` if given).

    ``payload`` and ``scales`` may be views into a received byte buffer (``scales`` as fp32).
    """
    _check(bits, block_size, "dequantize_blocks")
    nb = num_blocks(numel, block_size)
    if payload.dtype != torch.uint8 or payload.numel() != nb * block_size * bits // 8:
        raise ValueError(
            f"dequantize_blocks: payload must be {nb * block_size * bits // 8} uint8 values for {numel} "
            f"elements ({bits}-bit, block {block_size}), got {payload.numel()} {payload.dtype}"
        )
    if scales.numel() != nb:
        raise ValueError(f"dequantize_blocks: expected {nb} scales, got {scales.numel()}")
    if bits == 8:
        q = payload.view(torch.int8).view(nb, block_size).float()
    else:
        lo = (payload & 0xF).to(torch.int8) - 8
        hi = (payload >> 4).to(torch.int8) - 8
        q = torch.stack((lo, hi), dim=1).view(nb, block_size).float()
    values = (q * scales.float().view(nb, 1)).view(-1)[:numel]
    if out is None:
        return values.to(dtype)
    out.view(-1).copy_(values)
    return out


def dequantize(qt: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`dequantize_blocks` of a :class:`Quantized`."""
    return dequantize_blocks(
        qt.payload, qt.scales, qt.numel, bits=qt.bits, block_size=qt.block_size, dtype=dtype
    )
