"""MoE through engine checkpoints: experts stored per global expert at ZeRO stages 0-3.

Saved with ep_size 2 on 2 ranks (each rank holds 2 of the 4 experts), loaded with ep_size 1
on 1 rank and with ep_size 2 at another stage: weights and Adam states of every expert land
on the rank now holding it, and the fp32 conversion holds every global expert once. Stage 3
partitions experts over their expert-data-parallel group (zero_core's
[Note: stage 3 expert parameters]), so it saves and loads with ep_size 2 like stages 1-2.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, not ~4 s in every forked rank)
import torch.nn as nn
import zero_core.engine  # noqa: F401
import zero_moe
from zero_core.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from zero_core.testing import run_multirank
from zero_core.zero.stage3.param_records import partition_state

M, E = 8, 4


class Net(nn.Module):
    def __init__(self, ep_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(M, M)
        self.moe = zero_moe.MoE(M, nn.Linear(M, M), num_experts=E, ep_size=ep_size, k=1, capacity_factor=4.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.moe(self.proj(x))
        return out.pow(2).mean() + 0.01 * l_aux


def _engine(ep_size: int, seed: int, stage: int):
    import zero_core

    torch.manual_seed(seed)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = zero_core.initialize(model=Net(ep_size), config=cfg)
    return engine


def _global(engine, stage: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{global parameter name: (fp32 weight, exp_avg)} of what this rank holds (collective at stages 1-2)."""
    from zero_core.zero.debug_access import safe_get_full_fp32_param, safe_get_full_optimizer_state

    layer = engine.module.moe
    out = {}
    for name, p in engine.module.named_parameters():
        head, sep, rest = name.partition(".zero_experts.")
        if sep:
            local, _, tail = rest.partition(".")
            name = f"{head}.zero_experts.{layer.global_expert_offset + int(local)}.{tail}"
        if stage == 0:
            out[name] = (p.detach().clone(), engine.optimizer.state[p]["exp_avg"].clone())
        else:
            out[name] = (safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg"))
    return out


def _save_ep2(tmp: str, stage: int) -> dict:
    import torch.distributed as dist

    engine = _engine(2, 0, stage)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + dist.get_rank())
        engine.backward(engine(torch.randn(4, M, generator=g)))
        engine.step()
    engine.save_checkpoint(tmp, tag="ep2")
    return _global(engine, stage)


def _load(tmp: str, ep_size: int, stage: int) -> dict:
    import torch.distributed as dist

    engine = _engine(ep_size, 7, stage)
    engine.load_checkpoint(tmp, tag="ep2")
    assert engine.global_steps == 3
    got = _global(engine, stage)
    g = torch.Generator().manual_seed(99 + dist.get_rank())
    engine.backward(engine(torch.randn(4, M, generator=g)))  # and it trains on
    engine.step()
    return got


def _check(got: dict, expected: dict) -> None:
    for n, (w, avg) in got.items():
        assert torch.equal(w, expected[n][0]), n
        assert torch.equal(avg, expected[n][1]), n


@pytest.mark.parametrize("save_stage,load_stage", [(0, 2), (1, 0), (2, 1), (3, 0), (3, 2), (1, 3)])
def test_expert_parallel_checkpoint_reloads_at_other_ep_size_and_stage(tmp_path, save_stage, load_stage):
    tmp = str(tmp_path)
    r0, r1 = run_multirank(_save_ep2, 2, args=(tmp, save_stage))
    expected = {**r1, **r0}
    experts = {n for n in expected if ".zero_experts." in n}
    assert len(experts) == 2 * E  # weight and bias of each of the 4 global experts, from both ranks
    assert (set(r0) & experts).isdisjoint(set(r1) & experts)  # the ranks held different experts
    for n in set(r0) & set(r1) - experts:  # dense parameters are replicated
        assert torch.equal(r0[n][0], r1[n][0]), n

    # ep_size 1 on one rank: every expert on it
    got = run_multirank(_load, 1, args=(tmp, 1, load_stage))[0]
    assert set(got) == set(expected)
    _check(got, expected)
    # ep_size 2 on two ranks at another stage: each rank gets back the experts it holds
    g0, g1 = run_multirank(_load, 2, args=(tmp, 2, load_stage))
    assert set(g0) | set(g1) == set(expected)
    _check(g0, expected)
    _check(g1, expected)

    full = get_fp32_state_dict_from_zero_checkpoint(tmp, tag="ep2")
    assert {n for n in full if ".zero_experts." in n} == experts
    assert all(torch.equal(full[n], expected[n][0]) for n in expected)


def _load_stage3_and_resave(tmp: str) -> dict:
    engine = _engine(1, 7, 3)
    engine.load_checkpoint(tmp, tag="ep2")
    assert engine.global_steps == 3
    got = _global(engine, 3)
    engine.save_checkpoint(tmp, tag="s3")
    return got


def _load_s3_tag(tmp: str) -> dict:
    engine = _engine(1, 7, 0)
    engine.load_checkpoint(tmp, tag="s3")
    return _global(engine, 0)


def test_stage3_loads_an_expert_parallel_checkpoint_and_saves_it_back(tmp_path):
    # ZeRO-3 partitions experts like dense parameters (no expert parallelism at stage 3), so it
    # runs MoE with ep_size 1: it must read every global expert of an ep_size-2 checkpoint.
    tmp = str(tmp_path)
    r0, r1 = run_multirank(_save_ep2, 2, args=(tmp, 1))
    expected = {**r1, **r0}
    g0, g1 = run_multirank(_load_stage3_and_resave, 2, args=(tmp,))
    assert set(g0) == set(g1) == set(expected)
    _check(g0, expected)
    _check(g1, expected)
    full = get_fp32_state_dict_from_zero_checkpoint(tmp, tag="s3")
    assert set(full) == set(expected)
    assert all(torch.equal(full[n], expected[n][0]) for n in expected)
    _check(run_multirank(_load_s3_tag, 1, args=(tmp,))[0], expected)  # back to stage 0, Adam states intact


def _experts_partitioned_per_group(tmp: str) -> list[int]:
    engine = _engine(2, 0, 3)
    return [partition_state(p).world for n, p in engine.module.named_parameters() if ".zero_experts." in n]


def test_stage3_keeps_each_rank_experts_in_its_own_partition():
    # ep_size 2 on 2 ranks: each expert-data-parallel group is one rank, so experts are whole
    worlds = run_multirank(_experts_partitioned_per_group, 2, args=("",))
    assert worlds == [[1] * E, [1] * E]  # 2 local experts x (weight, bias) per rank
