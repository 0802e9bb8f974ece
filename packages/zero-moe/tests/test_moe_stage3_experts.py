"""Stage-3 expert partitions outside training: ``GatheredParameters(modifier_rank=...)`` and saving.

With ``ep_size=2`` on 4 ranks the expert-data-parallel groups are ``{0, 2}`` and ``{1, 3}``
(zero-moe's [Note: expert parallel groups]); a modifier rank belongs to only one of them, so the
other group takes the value of the modifier's expert-parallel peer (zero_core's
[Note: stage 3 expert parameters]).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from zero_core.testing import run_multirank

M, E = 4, 4


def _model(ep_size: int) -> nn.Module:
    import zero_moe
    from zero_core.zero.stage3 import Init

    torch.manual_seed(0)
    with Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}):
        return zero_moe.MoE(M, nn.Linear(M, M), num_experts=E, ep_size=ep_size, k=1)


def _modifier_worker(modifier: int, ep_size: int) -> dict[int, float]:
    from zero_core.zero.stage3 import GatheredParameters

    rank = dist.get_rank()
    layer = _model(ep_size)
    experts = layer.zero_moe.experts.zero_experts
    params = list(experts.parameters())
    with GatheredParameters(params, modifier_rank=modifier):
        for i, expert in enumerate(experts):
            for p in expert.parameters():
                p.data.fill_(100.0 * rank + layer.global_expert_offset + i)  # differs on every rank
    seen = {}
    with GatheredParameters(params):
        for i, expert in enumerate(experts):
            values = torch.cat([p.detach().reshape(-1) for p in expert.parameters()])
            assert bool((values == values[0]).all())
            seen[layer.global_expert_offset + i] = float(values[0])
    return seen


@pytest.mark.parametrize("modifier", [0, 3])
def test_modifier_rank_value_reaches_every_replica_of_every_expert(modifier):
    ep = 2
    results = run_multirank(_modifier_worker, 4, args=(modifier, ep), timeout=120)
    for rank, seen in enumerate(results):
        # the member of the modifier's expert-parallel group holding this rank's experts
        source = (modifier // ep) * ep + rank % ep
        assert seen == {g: 100.0 * source + g for g in seen}, (rank, seen)
    assert {g for seen in results for g in seen} == set(range(E))


def _save_16bit_worker(tmp: str) -> list[str]:
    import zero_core

    refused = []
    # stage 3 (its own saver) and stages 0-2 (the engine's): no rank holds every expert
    for stage, error, match in [
        (3, ValueError, "ep_size=2: rank 0 holds only its own experts"),
        (0, NotImplementedError, "no single rank holds every expert"),
        (2, NotImplementedError, "no single rank holds every expert"),
    ]:
        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "gather_16bit_weights_on_model_save": True},
        }
        engine, *_ = zero_core.initialize(model=_model(2), config=cfg)
        with pytest.raises(error, match=match):
            engine.save_16bit_model(tmp)
        refused.append(f"stage {stage}")
    return refused


def test_save_16bit_model_refuses_expert_parallel_layers(tmp_path):
    want = ["stage 3", "stage 0", "stage 2"]
    assert run_multirank(_save_16bit_worker, 2, args=(str(tmp_path),), timeout=120) == [want] * 2
    assert list(tmp_path.iterdir()) == []
