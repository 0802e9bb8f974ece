"""A state dict with DeepSpeed's MoE names (``deepspeed_moe.experts.deepspeed_experts.*``) loads
into zero-moe's layer, which keeps its own names."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zero_moe import MoE

M, H, E = 8, 16, 4


class Net(nn.Module):
    def __init__(self, use_residual: bool = False) -> None:
        super().__init__()
        expert = nn.Sequential(nn.Linear(M, H), nn.ReLU(), nn.Linear(H, M))
        self.moe = MoE(M, expert, num_experts=E, k=1, use_residual=use_residual)
        self.head = nn.Linear(M, 2)

    def forward(self, x):
        out, _, _ = self.moe(x)
        return self.head(out)


def as_deepspeed(sd: dict) -> dict:
    """The same weights under the names DeepSpeed's MoE gives them."""
    return {
        k.replace("zero_moe.", "deepspeed_moe.").replace("zero_experts.", "deepspeed_experts."): v
        for k, v in sd.items()
    }


@pytest.mark.parametrize("use_residual", [False, True])
def test_deepspeed_named_state_dict_loads(use_residual):
    torch.manual_seed(0)
    src = Net(use_residual)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p))  # every expert different, unlike the fresh copies
    ds = as_deepspeed(src.state_dict())
    assert "moe.deepspeed_moe.experts.deepspeed_experts.3.2.weight" in ds
    assert "moe.deepspeed_moe.gate.wg.weight" in ds
    torch.manual_seed(1)
    dst = Net(use_residual)
    result = dst.load_state_dict(ds)  # strict
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert sorted(dst.state_dict()) == sorted(src.state_dict())  # our names kept
    for k, v in src.state_dict().items():
        torch.testing.assert_close(dst.state_dict()[k], v, rtol=0, atol=0)
    x = torch.randn(2, 3, M)
    src.eval(), dst.eval()
    torch.testing.assert_close(dst(x), src(x))


def test_both_spellings_of_one_key_is_an_error():
    net = Net()
    sd = net.state_dict()
    sd["moe.deepspeed_moe.gate.wg.weight"] = sd["moe.zero_moe.gate.wg.weight"].clone()
    with pytest.raises(RuntimeError, match="both"):
        net.load_state_dict(sd)


def test_experts_container_loads_deepspeed_names_directly():
    net = Net()
    experts = net.moe.zero_moe.experts
    sd = {k.replace("zero_experts.", "deepspeed_experts."): v for k, v in experts.state_dict().items()}
    experts.load_state_dict(sd)
