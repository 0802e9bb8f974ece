"""MoE through engine checkpoints: experts saved per global expert, ep_size 2 on 2 ranks -> ep_size 1 on 1."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, not ~4 s in every forked rank)
import torch.nn as nn
import zero_core.engine  # noqa: F401
from zero_core.testing import run_multirank

zero_moe = pytest.importorskip("zero_moe", reason="the MoE checkpoint path needs the zero-moe package")

M, E = 8, 4


class Net(nn.Module):
    def __init__(self, ep_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(M, M)
        self.moe = zero_moe.MoE(M, nn.Linear(M, M), num_experts=E, ep_size=ep_size, k=1, capacity_factor=4.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.moe(self.proj(x))
        return out.pow(2).mean() + 0.01 * l_aux


def _engine(ep_size: int, seed: int):
    import zero_core

    torch.manual_seed(seed)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 0},
    }
    engine, *_ = zero_core.initialize(model=Net(ep_size), config=cfg)
    return engine


def _global(engine) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """{global parameter name: (weight, exp_avg)} of what this rank holds."""
    layer = engine.module.moe
    out = {}
    for name, p in engine.module.named_parameters():
        head, sep, rest = name.partition(".zero_experts.")
        if sep:
            local, _, tail = rest.partition(".")
            name = f"{head}.zero_experts.{layer.global_expert_offset + int(local)}.{tail}"
        state = engine.optimizer.state.get(p, {})
        out[name] = (p.detach().clone(), state["exp_avg"].clone() if "exp_avg" in state else None)
    return out


def _save_ep2(tmp: str) -> dict:
    import torch.distributed as dist

    engine = _engine(2, 0)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + dist.get_rank())
        engine.backward(engine(torch.randn(4, M, generator=g)))
        engine.step()
    engine.save_checkpoint(tmp, tag="ep2")
    return _global(engine)


def _load_ep1(tmp: str) -> dict:
    engine = _engine(1, 7)
    engine.load_checkpoint(tmp, tag="ep2")
    assert engine.global_steps == 3
    got = _global(engine)
    engine.backward(engine(torch.randn(4, M)))  # and it trains on
    engine.step()
    return got


def test_expert_parallel_checkpoint_loads_with_ep1(tmp_path):
    from zero_core.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tmp = str(tmp_path)
    r0, r1 = run_multirank(_save_ep2, 2, args=(tmp,))
    expected = {**r1, **r0}
    experts = {n for n in expected if ".zero_experts." in n}
    assert len(experts) == 2 * E  # weight and bias of each of the 4 global experts, from both ranks
    assert (set(r0) & experts).isdisjoint(set(r1) & experts)  # the ranks held different experts
    for n in set(r0) & set(r1) - experts:  # dense parameters are replicated
        assert torch.equal(r0[n][0], r1[n][0]), n
    got = run_multirank(_load_ep1, 1, args=(tmp,))[0]
    assert set(got) == set(expected)
    for n, (w, avg) in expected.items():
        assert torch.equal(got[n][0], w), n
        assert avg is not None and torch.equal(got[n][1], avg), n
    full = get_fp32_state_dict_from_zero_checkpoint(tmp, tag="ep2")
    assert {n for n in full if ".zero_experts." in n} == experts
    assert all(torch.equal(full[n], expected[n][0]) for n in expected)
