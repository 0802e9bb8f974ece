"""Weight-only int8: quantizer round trip and model logits within the documented tolerance."""

from __future__ import annotations

import inference_models as M
import pytest
import torch
import zero_inference as zi
from zero_inference.quantize import Int8Weight, QuantizedLinear

# See [Note: int8 weight groups]: logits move by < 2% of their max magnitude on these models.
INT8_TOL = 0.02


def test_quantize_roundtrip_error_bound() -> None:
    w = torch.randn(16, 64)
    for groups in (1, 4, 16):
        q, s = zi.quantize_weight(w, groups)
        assert q.dtype == torch.int8 and s.shape == (16, groups)
        err = (zi.dequantize_weight(q, s) - w).abs()
        # Symmetric rounding: at most half a step of the group's scale.
        bound = s.repeat_interleave(64 // groups, dim=1) / 2 + 1e-7
        assert bool((err <= bound).all())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("tokens", [1, 5, 40], ids=["decode", "few", "prefill"])
def test_int8_kernel_equals_dequantized_matmul(groups: int, tokens: int) -> None:
    # The CPU kernel (bf16 activations, one batched call or one call per group) against the
    # exact fp32 matmul with the dequantized weight: only bf16 rounding of x and y separates them.
    w, x, b = torch.randn(24, 64), torch.randn(tokens, 64), torch.randn(24)
    lin = QuantizedLinear(w, b, q_groups=groups)
    ref = torch.nn.functional.linear(x, zi.dequantize_weight(*zi.quantize_weight(w, groups)), b)
    assert lin.weight.dequantize().equal(zi.dequantize_weight(*zi.quantize_weight(w, groups)))
    assert _rel(lin(x), ref) < 1e-2
    assert _rel(lin(x.view(1, tokens, 64)), ref.view(1, tokens, 24)) < 1e-2  # batched input shape


@pytest.mark.parametrize("groups, in_features", [(4, 32), (4, 688), (3, 96)], ids=["k8", "k172", "k32"])
def test_int8_padded_groups(groups: int, in_features: int) -> None:
    # Group sizes that are not multiples of 16 are zero-padded for the kernel; results unchanged.
    w = torch.randn(24, in_features)
    weight = Int8Weight(w, groups)
    assert weight.qweight.shape[-1] % 16 == 0 and weight.shape == (24, in_features)
    exact = zi.dequantize_weight(*zi.quantize_weight(w, groups))
    assert weight.dequantize().equal(exact)
    for tokens in (1, 20):
        x = torch.randn(tokens, in_features)
        assert _rel(weight.linear(x), torch.nn.functional.linear(x, exact)) < 1e-2


def test_validation() -> None:
    with pytest.raises(ValueError, match="q_groups=3 does not divide the input size 64"):
        zi.quantize_weight(torch.randn(4, 64), 3)
    with pytest.raises(ValueError, match="expected a 2-D weight"):
        zi.quantize_weight(torch.randn(4), 1)


@pytest.mark.parametrize("make", [M.gpt2, M.llama, M.bert], ids=["gpt2", "llama", "bert"])
@pytest.mark.parametrize("groups", [1, 4])
def test_int8_logits_within_tolerance(make, groups: int) -> None:
    x = M.ids()
    with torch.no_grad():
        want = make()(x).logits
    engine = zi.init_inference(make(), dtype="int8", quant={"weight": {"q_groups": groups}})
    assert not any(isinstance(m, torch.nn.Linear) for m in engine.module.modules())
    rel = float((engine(x).logits - want).abs().max() / want.abs().max())
    assert 0 < rel < INT8_TOL, rel


def test_int8_with_kernel_injection_generates() -> None:
    x = M.ids()
    engine = zi.init_inference(M.llama(), dtype="int8", replace_with_kernel_inject=True)
    with torch.no_grad():
        want = M.llama()(x).logits
    assert float((engine(x).logits - want).abs().max() / want.abs().max()) < INT8_TOL
    assert engine.generate(x, max_new_tokens=4).shape == (2, 11)
