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


def test_int8_matmul_paths_agree() -> None:
    w, x = torch.randn(24, 32), torch.randn(3, 5, 32)
    fused = Int8Weight(w, 1).linear(x)  # torch's int8 weight kernel
    ref = torch.nn.functional.linear(x, zi.dequantize_weight(*zi.quantize_weight(w, 1)))
    assert torch.allclose(fused, ref, atol=1e-4)
    lin = QuantizedLinear(w, torch.ones(24), q_groups=4)
    assert torch.allclose(
        lin(x),
        torch.nn.functional.linear(x, zi.dequantize_weight(*zi.quantize_weight(w, 4)), torch.ones(24)),
        atol=1e-5,
    )


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
