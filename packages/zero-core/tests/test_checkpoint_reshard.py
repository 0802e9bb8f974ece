"""Resharding: a checkpoint saved with 2 ranks at stage 2 continues at another world size and stage."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from zero_core.testing import run_multirank

GLOBAL_BATCH = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 11)
        self.l2 = nn.Linear(11, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.l2(torch.tanh(self.l1(x))), y)


def _engine(stage: int, world: int, seed: int):
    import zero_core

    torch.manual_seed(seed)
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 12, "warmup_max_lr": 5e-3}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40},
    }
    engine, *_ = zero_core.initialize(model=Net(), config=cfg)
    return engine


def _train(engine, first: int, last: int) -> list[float]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    micro = GLOBAL_BATCH // world
    losses = []
    for step in range(first, last):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
        loss = engine(x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        t = torch.tensor([loss.item() / world])
        dist.all_reduce(t)
        losses.append(t.item())
    return losses


def _reference(tmp: str) -> list[float]:
    engine = _engine(2, 2, 0)
    _train(engine, 0, 6)
    engine.save_checkpoint(tmp, tag="saved")
    losses = _train(engine, 6, 12)
    engine.save_checkpoint(tmp, tag="ref", save_latest=False)
    return losses


def _continue(tmp: str, stage: int, out_tag: str) -> list[float]:
    import torch.distributed as dist

    engine = _engine(stage, dist.get_world_size(), 99)
    engine.load_checkpoint(tmp, tag="saved")
    assert engine.global_steps == 6
    losses = _train(engine, 6, 12)
    engine.save_checkpoint(tmp, tag=out_tag, save_latest=False)
    return losses


def test_reshard_matrix(tmp_path):
    from zero_core.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tmp = str(tmp_path)
    ref = run_multirank(_reference, 2, args=(tmp,))[0]
    ref_w = get_fp32_state_dict_from_zero_checkpoint(tmp, tag="ref")
    for world, stage in [(1, 0), (4, 3), (2, 1)]:
        tag = f"n{world}_s{stage}"
        got = run_multirank(_continue, world, args=(tmp, stage, tag))[0]
        assert got == pytest.approx(ref, rel=1e-6), (world, stage)
        w = get_fp32_state_dict_from_zero_checkpoint(tmp, tag=tag)
        for k, v in ref_w.items():
            assert torch.allclose(w[k], v, rtol=1e-6, atol=1e-7), (world, stage, k, (w[k] - v).abs().max())
