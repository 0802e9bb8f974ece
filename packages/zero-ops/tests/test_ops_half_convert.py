"""The kernels' fp32 -> bf16/fp16 rounding equals torch's, special values included."""

from __future__ import annotations

import pytest
import torch
from zero_ops.lion import cpu_lion_step


def _special_values() -> torch.Tensor:
    vals = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        65504.0,
        65519.99,
        65520.0,
        65536.0,
        -70000.0,
        1e-8,
        5.96e-8,
        2.98e-8,
        2.9802322e-08,
        6.1035e-05,
        6.1e-05,
        3.0e-5,
        1e38,
        -1e-40,
        float("inf"),
        float("-inf"),
        float("nan"),
        1.00390625,
        1.0039063,
        1.01171875,
        3.3895314e38,
    ]
    # Random bit patterns cover every exponent (subnormals, normals, huge) and both ties.
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), dtype=torch.int64).to(torch.int32)
    return torch.cat([torch.tensor(vals), bits.view(torch.float32), torch.randn(10_000) * 1e-6])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_matches_torch(dtype):
    x = _special_values()
    out = torch.empty(x.numel(), dtype=dtype)
    # lr=0, no decay: Lion leaves the parameters unchanged and writes their 16-bit copy.
    p = x.clone()
    cpu_lion_step(
        p,
        torch.zeros_like(x),
        torch.zeros_like(x),
        lr=0.0,
        beta1=0.9,
        beta2=0.99,
        weight_decay=0.0,
        low_precision_out=out,
    )
    expected = x.to(dtype)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_grads_are_widened_exactly(dtype):
    g16 = _special_values()[:50_000].to(dtype)
    g16 = g16[g16.isfinite()].contiguous()
    n = g16.numel()
    m = torch.zeros(n)
    cpu_lion_step(torch.zeros(n), g16, m, lr=0.0, beta1=0.0, beta2=0.0, weight_decay=0.0)
    # beta2 = 0: exp_avg becomes exactly the widened gradient.
    assert torch.equal(m, g16.float())
