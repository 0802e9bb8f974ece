"""The MoE layer on one process against a dense reference that routes tokens one by one."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from zero_moe import MoE

M, H, E = 8, 16, 4


def make_expert() -> nn.Module:
    return nn.Sequential(nn.Linear(M, H), nn.ReLU(), nn.Linear(H, M))


def randomize_experts(moe: MoE, seed: int) -> None:
    """Give every expert distinct weights (they start as identical copies)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for expert in moe.zero_moe.experts.zero_experts:
            for p in expert.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def dense_reference(moe: MoE, x: torch.Tensor, k: int) -> torch.Tensor:
    """Route each token to its top-k experts one at a time and sum the weighted outputs."""
    experts = moe.zero_moe.experts.zero_experts
    wg = moe.zero_moe.gate.wg.weight
    tokens = x.reshape(-1, M)
    rows = []
    for t in tokens:
        probs = torch.softmax(t @ wg.t(), dim=0)
        top = probs.topk(k)
        weights = top.values if k == 1 else top.values / top.values.sum()
        rows.append(sum(w * experts[int(e)](t[None])[0] for w, e in zip(weights, top.indices)))
    return torch.stack(rows).view(x.shape)


def build(k: int, **kwargs) -> MoE:
    torch.manual_seed(0)
    moe = MoE(M, make_expert(), num_experts=E, k=k, use_rts=False, top2_2nd_expert_sampling=False, **kwargs)
    randomize_experts(moe, 1)
    return moe


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize(
    "mode",
    [
        {"capacity_factor": 8.0},
        {"drop_tokens": False},
        {"drop_tokens": False, "dropless_impl": "padded"},
    ],
    ids=["capacity", "ragged", "padded-dropless"],
)
def test_matches_dense_reference(k, mode):
    moe = build(k, **mode)
    x = torch.randn(3, 5, M, requires_grad=True)
    out, l_aux, counts = moe(x)
    ref_x = x.detach().clone().requires_grad_(True)
    ref = dense_reference(moe, ref_x, k)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert counts.sum().item() == 15 * k
    # gradients w.r.t. inputs and every parameter agree as well
    grad_out = torch.randn_like(out)
    params = list(moe.parameters())
    got = torch.autograd.grad(out, [x, *params], grad_out, allow_unused=True)
    want = torch.autograd.grad(ref, [ref_x, *params], grad_out, allow_unused=True)
    for g, w in zip(got, want):
        if w is None:
            assert g is None or g.abs().max() == 0
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_dropped_tokens_get_zero_output():
    moe = build(1, capacity_factor=0.25, min_capacity=1)
    x = torch.randn(32, M)
    out, _, counts = moe(x)
    routing = moe.zero_moe.gate(x)
    dropped = ~routing.keep[:, 0]
    assert dropped.sum().item() == 32 - routing.counts.sum().item() > 0
    assert out[dropped].abs().max().item() == 0
    assert out[~dropped].abs().sum(1).min().item() > 0


def test_used_token_zeroes_masked_tokens():
    moe = build(2, capacity_factor=8.0)
    x = torch.randn(2, 6, M)
    used = torch.ones(2, 6)
    used[0, 2] = 0
    used[1, 5] = 0
    out, _, counts = moe(x, used_token=used)
    assert out[0, 2].abs().max() == 0 and out[1, 5].abs().max() == 0
    assert counts.sum().item() == 10 * 2
    full, _, _ = moe(x)
    torch.testing.assert_close(out[used.bool()], full[used.bool()])


def test_residual_moe():
    torch.manual_seed(0)
    expert = make_expert()
    moe = MoE(M, expert, num_experts=E, k=1, capacity_factor=8.0, use_residual=True, use_rts=False)
    randomize_experts(moe, 2)
    x = torch.randn(10, M)
    out, _, _ = moe(x)
    moe_only = dense_reference(moe, x, 1)
    coef = torch.softmax(moe.coefficient(x), dim=-1)
    ref = moe_only * coef[:, :1] + moe.mlp(x) * coef[:, 1:]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert getattr(moe.mlp[0].weight, "allreduce", True) is not False  # the dense MLP is not an expert


def test_eval_capacity_factor_used_in_eval():
    moe = build(1, capacity_factor=0.5, eval_capacity_factor=4.0, min_capacity=0)
    x = torch.randn(40, M)
    moe.train()
    assert moe.zero_moe.gate(x).capacity == 5
    moe.eval()
    assert moe.zero_moe.gate(x).capacity == 40


def test_expert_params_are_tagged():
    moe = build(1)
    expert_params = {id(p) for p in moe.zero_moe.experts.parameters()}
    for p in moe.parameters():
        if id(p) in expert_params:
            assert p.allreduce is False and p.group_name == "ep_size_1"
        else:
            assert not hasattr(p, "allreduce")


def test_use_tutel_warns_and_falls_back():
    with pytest.warns(UserWarning, match="tutel"):
        moe = MoE(M, make_expert(), num_experts=2, use_tutel=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _, _ = moe(torch.randn(4, M))
    assert out.shape == (4, M)


def test_bfloat16_inputs():
    moe = build(2, capacity_factor=8.0).to(torch.bfloat16)
    out, l_aux, _ = moe(torch.randn(6, M, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and l_aux.dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_experts": 3, "ep_size": 2}, "divisible by ep_size"),
        ({"num_experts": 2, "k": 3}, "cannot exceed"),
        ({"capacity_factor": 0}, "capacity_factor"),
        ({"min_capacity": -1}, "min_capacity"),
        ({"noisy_gate_policy": "gaussian"}, "noisy_gate_policy"),
        ({"dropless_impl": "sparse"}, "dropless_impl"),
        ({"hidden_size": 0}, "hidden_size"),
    ],
)
def test_constructor_validation(kwargs, match):
    args = {"hidden_size": M, "expert": make_expert(), **kwargs}
    with pytest.raises((ValueError, RuntimeError), match=match):
        MoE(**args)


def test_expert_parallel_layer_built_before_init_distributed():
    moe = MoE(M, make_expert(), num_experts=2, ep_size=2)
    with pytest.raises(RuntimeError, match="set_zero_parallelism"):
        moe(torch.randn(4, M))
    with pytest.raises(RuntimeError, match="torch.distributed to be initialised"):
        moe.set_zero_parallelism()


def test_forward_validation():
    moe = build(1)
    with pytest.raises(ValueError, match="hidden_size"):
        moe(torch.randn(4, M + 1))
    with pytest.raises(ValueError, match="used_token"):
        moe(torch.randn(2, 3, M), used_token=torch.ones(6))
    with pytest.raises(TypeError, match="nn.Module"):
        MoE(M, lambda t: t)


def test_enable_expert_tensor_parallelism_warns_it_has_no_effect():
    from zero_core.config.no_effect import reset_no_effect_warnings

    reset_no_effect_warnings()  # each key warns once per process
    expert = nn.Linear(8, 8)
    with pytest.warns(UserWarning, match=r"moe.enable_expert_tensor_parallelism is set but has no effect"):
        MoE(8, expert, num_experts=2, enable_expert_tensor_parallelism=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default (False) is silent
        MoE(8, nn.Linear(8, 8), num_experts=2)
