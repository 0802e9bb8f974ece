"""Pipelines with Mixture-of-Experts layers (zero-pipe + zero-moe).

Supported with one pipeline stage: the ranks are data- and expert-parallel, and a checkpoint
saved at expert-parallel size 2 on 2 ranks (ZeRO stage 1) continues exactly on 1 rank (every
expert local, ZeRO stage 0), losses and weights equal to the uninterrupted run (fp32, 1e-5);
zero_to_fp32 gives every global expert. With more stages the engine refuses the model on every
rank (zero-moe's expert groups span the world), rather than hanging in a reduction.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn
from zero_core.testing import run_multirank

DIM, VOCAB, MB, MICRO = 8, 11, 2, 4


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, DIM) * 0.5)

    def forward(self, ids):
        return self.weight[ids]


class MoEBlock(nn.Module):
    def __init__(self, ep_size: int) -> None:
        super().__init__()
        from zero_moe import MoE

        # dropless and deterministic routing: the same tokens reach the same experts at any ep_size
        self.moe = MoE(
            DIM, nn.Linear(DIM, DIM), num_experts=2, ep_size=ep_size, drop_tokens=False, use_rts=False
        )

    def forward(self, x):
        return torch.tanh(self.moe(x)[0])


def _logits(embed, x):
    return x @ embed.weight.t()


def _specs(ep_size: int) -> list:
    from zero_pipe import LayerSpec, TiedLayerSpec

    return [
        TiedLayerSpec("embed", Embed),
        LayerSpec(nn.Linear, DIM, DIM),
        LayerSpec(MoEBlock, ep_size),
        LayerSpec(nn.Linear, DIM, DIM),
        TiedLayerSpec("embed", Embed, forward_fn=_logits),
    ]


def _engine(ep_size: int, zero_stage: int, seed: int, stages: int = 1):
    import zero_core
    from zero_pipe import PipelineModule

    torch.manual_seed(seed)
    model = PipelineModule(
        _specs(ep_size), num_stages=stages, loss_fn=nn.functional.cross_entropy, partition_method="uniform"
    )
    cfg = {
        "train_batch_size": MB * MICRO,
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "Adam", "params": {"lr": 0.02}},
        "zero_optimization": {"stage": zero_stage},
    }
    return zero_core.initialize(model=model, config=cfg)[0]


def _train(engine, first: int, count: int) -> list[float]:
    dp, per = engine.grid.data_parallel_id, engine.gradient_accumulation_steps()
    losses = []
    for b in range(first, first + count):
        g = torch.Generator().manual_seed(100 + b)
        batch = [
            (torch.randint(0, VOCAB, (MB,), generator=g), torch.randint(0, VOCAB, (MB,), generator=g))
            for _ in range(MICRO)
        ]
        losses.append(engine.train_batch(iter(batch[dp * per : (dp + 1) * per])).item())
    return losses


def _global_weights(engine) -> dict[str, torch.Tensor]:
    """Every tensor this rank holds, experts under their global names (as the checkpoint names them)."""
    from zero_core.checkpoint.experts import global_expert_names

    renamed = global_expert_names(engine.module)
    return {renamed.get(k, k): v.detach().clone() for k, v in engine.module.state_dict().items()}


def _save(root: str):
    engine = _engine(2, 1, seed=1)
    _train(engine, 0, 2)
    engine.save_checkpoint(root)
    at_save = _global_weights(engine)
    return _train(engine, 2, 2), _global_weights(engine), at_save


def _load(root: str):
    engine = _engine(1, 0, seed=2)
    engine.load_checkpoint(root)
    return _train(engine, 2, 2), _global_weights(engine)


def test_one_stage_pipeline_with_experts_reshards_over_expert_parallel_sizes(tmp_path):
    from zero_core.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root = str(tmp_path / "ckpt")
    saved = run_multirank(_save, 2, args=(root,))
    ref_weights, at_save = {}, {}
    for _, w, a in saved:
        ref_weights.update(w)
        at_save.update(a)
    assert len([n for n in ref_weights if ".zero_experts." in n]) == 4  # 2 global experts: weight, bias
    [(losses, weights)] = run_multirank(_load, 1, args=(root,))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(saved[0][0]), rtol=1e-5, atol=1e-6)
    assert sorted(weights) == sorted(ref_weights)
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)
    record = json.load(open(os.path.join(root, "global_step2", "checkpoint.json")))
    listed = [name for name, _, _ in record["parameters"]]
    assert sorted(listed) == sorted(at_save) and len(set(listed)) == len(listed)  # every expert listed once
    converted = get_fp32_state_dict_from_zero_checkpoint(root)
    assert sorted(converted) == sorted(at_save)
    assert all(torch.equal(converted[n], v) for n, v in at_save.items())


def _refused() -> str:
    from zero_moe import groups
    from zero_pipe import PipelineConfigError

    groups.create_expert_and_data_parallel(1)  # on every rank, so that the stage-1 layer builds
    with pytest.raises(PipelineConfigError, match="Mixture-of-Experts layers in a pipeline of 2 stages") as e:
        _engine(1, 0, seed=1, stages=2)
    return str(e.value)


def test_experts_in_a_pipeline_of_several_stages_are_refused_on_every_rank():
    assert len(run_multirank(_refused, 2)) == 2
