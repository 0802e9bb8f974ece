"""Resharding: a checkpoint saved with 2 ranks at stage 2 continues at another world size and stage.

RNG semantics (documented in ``loader.py``): generator states are per rank, so they are
restored only when the world size is unchanged; a resharded run keeps its own generators.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, not ~4 s in every forked rank)
import torch.nn as nn
import torch.nn.functional as F
import zero_core.engine  # noqa: F401
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


def _train(engine, first: int, last: int, batch: int = GLOBAL_BATCH, classes: int = 4) -> list[float]:
    """Steps ``first..last-1`` on seeded global batches split over the ranks; the mean loss per step."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    micro = batch // world
    losses = []
    for step in range(first, last):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(batch, 6, generator=g), torch.randint(0, classes, (batch,), generator=g)
        loss = engine(x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        t = torch.tensor([loss.item() / world])
        dist.all_reduce(t)
        losses.append(t.item())
    return losses


def _reference(tmp: str) -> tuple[list[float], torch.Tensor]:
    engine = _engine(2, 2, 0)
    _train(engine, 0, 6)
    saved_rng = torch.get_rng_state()
    engine.save_checkpoint(tmp, tag="saved")
    losses = _train(engine, 6, 12)
    engine.save_checkpoint(tmp, tag="ref", save_latest=False)
    return losses, saved_rng


def _continue(tmp: str, stages: tuple[int, ...]) -> dict[int, tuple[list[float], bool]]:
    """Every target stage at this world size, each from a fresh engine; also reports RNG restoring."""
    import torch.distributed as dist

    out = {}
    for stage in stages:
        engine = _engine(stage, dist.get_world_size(), 99)
        before = torch.get_rng_state()
        engine.load_checkpoint(tmp, tag="saved")
        rng_kept = torch.equal(torch.get_rng_state(), before)
        assert engine.global_steps == 6
        losses = _train(engine, 6, 12)
        engine.save_checkpoint(tmp, tag=f"n{dist.get_world_size()}_s{stage}", save_latest=False)
        out[stage] = (losses, rng_kept)
    return out


def _reference_then_continue(tmp: str, stages: tuple[int, ...]) -> tuple:
    ref, saved_rng = _reference(tmp)
    got = _continue(tmp, stages)
    return ref, saved_rng, got


def test_reshard_matrix(tmp_path):
    """Saved at N=2 stage 2; continued at N=1 stages 0 and 3, N=4 stages 3 and 1, N=2 stage 1."""
    from zero_core.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tmp = str(tmp_path)
    # one launch per world size; the N=2 targets run in the launch that saved the checkpoint
    ref, saved_rng, same_world = run_multirank(_reference_then_continue, 2, args=(tmp, (1,)))[0]
    results = {(2, s): r for s, r in same_world.items()}
    for world, stages in [(1, (0, 3)), (4, (3, 1))]:
        results.update(
            {(world, s): r for s, r in run_multirank(_continue, world, args=(tmp, stages))[0].items()}
        )
    ref_w = get_fp32_state_dict_from_zero_checkpoint(tmp, tag="ref")
    for (world, stage), (got, rng_kept) in results.items():
        assert got == pytest.approx(ref, rel=1e-6), (world, stage)
        # same world size: rank r's generators come back; another world size: each rank keeps its own
        assert rng_kept == (world != 2), (world, stage)
        w = get_fp32_state_dict_from_zero_checkpoint(tmp, tag=f"n{world}_s{stage}")
        for k, v in ref_w.items():
            assert torch.allclose(w[k], v, rtol=1e-6, atol=1e-7), (world, stage, k, (w[k] - v).abs().max())
    assert len(results) == 5 and not torch.equal(saved_rng, torch.get_rng_state())


def test_scalar_state_of_a_one_element_shard_is_per_parameter():
    """A 0-dim state (Adam's ``step``) is not a range even where the shard holds one element."""
    from zero_core.checkpoint.fragments import optimizer_state_fragments

    state = {"step": torch.tensor(5.0), "exp_avg": torch.tensor([0.5])}
    frags = {f.kind: f for f in optimizer_state_fragments("b", (3,), state, [(0, 2, 1)], elementwise_numel=1)}
    assert not frags["optim.step"].elementwise and frags["optim.step"].shape == ()
    assert frags["optim.exp_avg"].elementwise and (
        frags["optim.exp_avg"].start,
        frags["optim.exp_avg"].end,
    ) == (2, 3)


class Tiny(nn.Module):
    """Parameters of 3 elements or fewer: one-element (or empty) stage-3 shards at 3 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.l1(x) * self.scale, y % 3)


def _tiny_engine(world: int):
    import zero_core

    torch.manual_seed(0)
    cfg = {
        "train_batch_size": 12,
        "train_micro_batch_size_per_gpu": 12 // world,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zero_core.initialize(model=Tiny(), config=cfg)
    return engine


def _tiny_train(engine, first: int, last: int) -> list[float]:
    return _train(engine, first, last, batch=12, classes=3)


def _tiny_save(tmp: str) -> list[float]:
    engine = _tiny_engine(3)
    _tiny_train(engine, 0, 3)
    engine.save_checkpoint(tmp)
    return _tiny_train(engine, 3, 6)


def _tiny_continue(tmp: str) -> list[float]:
    engine = _tiny_engine(2)
    engine.load_checkpoint(tmp)
    return _tiny_train(engine, 3, 6)


def test_one_element_shards_reshard(tmp_path):
    """Stage 3 at 3 ranks shards the bias into one element a rank: Adam's step came back as 2 elements at 2."""
    ref = run_multirank(_tiny_save, 3, args=(str(tmp_path),))[0]
    assert run_multirank(_tiny_continue, 2, args=(str(tmp_path),))[0] == pytest.approx(ref, rel=1e-6)
