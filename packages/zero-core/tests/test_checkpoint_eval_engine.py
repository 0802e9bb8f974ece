"""Checkpoints of an engine built without an optimizer (DeepSpeed's evaluation engine).

DeepSpeed's ``initialize`` without an optimizer returns an engine that can still
``save_checkpoint`` and ``load_checkpoint`` its module (its sparse-checkpoint tests save
such engines and load them non-strictly into others). Here, at every stage and on 1 and 2
ranks: an evaluation engine loads a training checkpoint, saves its own, another evaluation
engine loads that one, and a training engine loads it with ``load_optimizer_states=False``
(asking for the optimizer states it does not hold is a clear error that changes nothing).
See [Note: engine without an optimizer].
"""

from __future__ import annotations

import copy

import pytest
import torch
from zero_core.testing import run_multirank

DIM = 6


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(DIM, 8)
        self.l2 = torch.nn.Linear(8, 3)
        self.register_buffer("shift", torch.zeros(3))

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x))) + self.shift


def _cfg(stage: int, world: int, optimizer: bool) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2 * world,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if optimizer:
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    return cfg


def _rank(root: str) -> dict:
    import zero_core
    from zero_core import comm
    from zero_core.checkpoint.format import CheckpointError

    world, rank = comm.get_world_size(), comm.get_rank()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * world, DIM, generator=g)
    mine = x[2 * rank : 2 * rank + 2]
    torch.manual_seed(0)
    base = _Net()
    out = {}
    for stage in range(4):
        d = f"{root}/stage{stage}"
        train, *_ = zero_core.initialize(model=copy.deepcopy(base), config=_cfg(stage, world, True))
        for _ in range(2):
            train.backward(train(mine).pow(2).mean())
            train.step()
        with torch.no_grad():
            want = train(x).float()
            train.module.shift.fill_(0.5)  # a buffer travels with the module
            want = want + 0.5
        train.save_checkpoint(d, tag="trained")

        evaluator, opt, _, _ = zero_core.initialize(
            model=copy.deepcopy(base), config=_cfg(stage, world, False)
        )
        assert opt is None and evaluator.optimizer is None
        path, client = evaluator.load_checkpoint(d, tag="trained")
        assert path.endswith("trained") and client == {}
        with torch.no_grad():
            torch.testing.assert_close(evaluator(x).float(), want, rtol=1e-6, atol=1e-6)
        assert evaluator.global_steps == 2  # the counters come back too
        assert evaluator.save_checkpoint(d, tag="evaluated", client_state={"note": "eval"})

        again, *_ = zero_core.initialize(model=copy.deepcopy(base), config=_cfg(stage, world, False))
        _, client = again.load_checkpoint(d)  # ``latest`` names the evaluation engine's tag
        assert client == {"note": "eval"}
        with torch.no_grad():
            torch.testing.assert_close(again(x).float(), want, rtol=1e-6, atol=1e-6)

        resumed, *_ = zero_core.initialize(model=copy.deepcopy(base), config=_cfg(stage, world, True))
        with pytest.raises(CheckpointError, match="without an optimizer.*load_optimizer_states=False"):
            resumed.load_checkpoint(d, tag="evaluated")
        resumed.load_checkpoint(d, tag="evaluated", load_optimizer_states=False)
        with torch.no_grad():
            torch.testing.assert_close(resumed(x).float(), want, rtol=1e-6, atol=1e-6)
        resumed.backward(resumed(mine).pow(2).mean())  # and it trains on from there
        resumed.step()
        out[stage] = resumed.global_steps
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_engine_without_optimizer_saves_and_loads_its_module(tmp_path, world):
    for r in run_multirank(_rank, world, args=(str(tmp_path),), timeout=240):
        assert r == {stage: 3 for stage in range(4)}
