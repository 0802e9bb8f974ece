"""Block quantizers of ZeRO++ (``zero_core.comm.quantize``): round trip within the block bound."""

from __future__ import annotations

import pytest
import torch
from zero_core.accelerator import get_accelerator
from zero_core.comm.quantize import (
    QMAX,
    dequantize,
    dequantize_blocks,
    num_blocks,
    quantize_blocks,
    quantized_bytes,
)


def _device() -> str:
    return get_accelerator().current_device_name()


def _bound(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Per-element bound absmax(block) / (2 qmax), padded blocks as the quantizer pads them."""
    n = x.numel()
    nb = num_blocks(n, block)
    padded = torch.zeros(nb * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1).float()
    absmax = padded.view(nb, block).abs().amax(dim=1, keepdim=True)
    return (absmax / (2 * QMAX[bits])).expand(nb, block).reshape(-1)[:n]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel,block", [(1024, 256), (1000, 256), (7, 4), (300, 64)])
def test_round_trip_within_block_bound(bits, dtype, numel, block):
    g = torch.Generator().manual_seed(numel + bits)
    x = (torch.randn(numel, generator=g) * torch.logspace(-3, 2, numel)).to(dtype).to(_device())
    qt = quantize_blocks(x, bits, block)
    assert qt.payload.dtype == torch.uint8
    assert qt.payload.numel() == num_blocks(numel, block) * block * bits // 8  # int4: two per byte
    assert qt.scales.numel() == num_blocks(numel, block)
    assert qt.payload.numel() + 4 * qt.scales.numel() == quantized_bytes(numel, bits, block)
    back = dequantize(qt, torch.float32)
    assert back.shape == (numel,)
    err = (back - x.float()).abs()
    bound = _bound(x, bits, block)
    assert bool((err <= bound * (1 + 1e-5) + 1e-12).all()), float((err - bound).max())
    # and the bound is tight enough to mean something: the error is not zero everywhere
    assert float(err.max()) > 0
    # the largest element of every block comes back exactly
    assert torch.allclose(back.abs().max(), x.float().abs().max())
    # into an output of the input's dtype
    out = torch.empty(numel, dtype=dtype, device=x.device)
    dequantize_blocks(qt.payload, qt.scales, numel, bits=bits, block_size=block, out=out)
    assert torch.equal(out, back.to(dtype))


@pytest.mark.parametrize("bits", [8, 4])
def test_zeros_and_equal_blocks(bits):
    z = torch.zeros(600, device=_device())
    qt = quantize_blocks(z, bits, 256)
    assert torch.equal(qt.scales, torch.zeros(3, device=z.device))
    assert torch.equal(dequantize(qt), z)
    # every block all-equal (one of them negative): exact round trip
    x = torch.cat((torch.full((256,), 3.5), torch.full((256,), -0.25), torch.full((88,), 1e-3))).to(z.device)
    assert torch.equal(dequantize(quantize_blocks(x, bits, 256)), x)


def test_requantizing_is_idempotent():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(_device())
    once = dequantize(quantize_blocks(x, 8, 128))
    twice = dequantize(quantize_blocks(once, 8, 128))
    assert torch.allclose(once, twice, rtol=0, atol=1e-6)


def test_int4_packs_two_values_per_byte():
    x = torch.tensor([-7.0, 7.0, 0.0, 1.0], device=_device())
    qt = quantize_blocks(x, 4, 4)
    # values + 8, even element in the low nibble: (-7+8) | (7+8) << 4, 8 | 9 << 4
    assert qt.payload.tolist() == [1 | (15 << 4), 8 | (9 << 4)]
    assert dequantize(qt).tolist() == x.tolist()


def test_bad_input_errors():
    x = torch.randn(8)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quantize_blocks(x, 2)
    with pytest.raises(ValueError, match="block_size must be an even int"):
        quantize_blocks(x, 8, 3)
    with pytest.raises(TypeError, match="float32/float16/bfloat16"):
        quantize_blocks(torch.arange(8), 8)
    qt = quantize_blocks(x, 8, 4)
    with pytest.raises(ValueError, match="expected 2 scales"):
        dequantize_blocks(qt.payload, qt.scales[:1], 8, bits=8, block_size=4)
    with pytest.raises(ValueError, match="payload must be"):
        dequantize_blocks(qt.payload[:4], qt.scales, 8, bits=8, block_size=4)
