"""``fp16.auto_cast``: the engine casts floating-point inputs to fp16 (token ids stay integers)."""

from __future__ import annotations

import collections

import pytest
import torch
from zero_core.engine.data import cast_floating, move_to_device
from zero_core.testing import run_multirank


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor, features: torch.Tensor, extra: dict) -> torch.Tensor:
        return self.proj(self.emb(ids) * features + extra["shift"]).float().pow(2).mean()


def _train(auto_cast: bool) -> list[float]:
    import zero_core

    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "fp16": {"enabled": True, "auto_cast": auto_cast, "initial_scale_power": 8},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = zero_core.initialize(model=Scaled(), config=cfg)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    features = torch.full((2, 3, 1), 0.5)  # fp32, as a data pipeline produces them
    losses = []
    for _ in range(3):
        loss = engine(ids, features, extra={"shift": torch.ones(4)})
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_auto_cast_feeds_fp32_inputs_to_an_fp16_model():
    results = run_multirank(_train, 2, args=(True,))
    assert results[0] == results[1] and results[0][2] < results[0][0]


def test_without_auto_cast_fp32_inputs_reach_the_fp16_model():
    with pytest.raises(Exception, match="dtype"):
        run_multirank(_train, 1, args=(False,))


def test_cast_floating_leaves_integers_and_structure():
    batch = {"ids": torch.tensor([1, 2]), "x": [torch.ones(2), (torch.zeros(1, dtype=torch.float64), 3)]}
    out = cast_floating(batch, torch.float16)
    assert out["ids"].dtype == torch.int64
    assert (
        out["x"][0].dtype == torch.float16 and out["x"][1][0].dtype == torch.float16 and out["x"][1][1] == 3
    )


Pair = collections.namedtuple("Pair", ["ids", "features"])


class TakesPair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 1)

    def forward(self, batch: Pair) -> torch.Tensor:
        return self.proj(self.emb(batch.ids) * batch.features).float().pow(2).mean()


def _train_on_namedtuple() -> float:
    import zero_core

    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = zero_core.initialize(model=TakesPair(), config=cfg)
    loss = engine(Pair(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.full((2, 3, 1), 0.5)))
    engine.backward(loss)
    engine.step()
    return loss.item()


def test_auto_cast_reaches_into_a_namedtuple_batch():
    # The fp32 features inside the namedtuple must be cast too, or the fp16 Linear rejects them.
    (loss,) = run_multirank(_train_on_namedtuple, 1)
    assert loss > 0


def test_cast_and_move_keep_namedtuples():
    batch = [Pair(torch.tensor([1, 2]), torch.ones(2)), collections.OrderedDict(p=Pair(torch.ones(1), 3))]
    out = cast_floating(batch, torch.float16)
    assert type(out[0]) is Pair and out[0].ids.dtype == torch.int64 and out[0].features.dtype == torch.float16
    assert type(out[1]) is collections.OrderedDict and out[1]["p"].ids.dtype == torch.float16
    assert out[1]["p"].features == 3
    moved = move_to_device(batch, torch.device("cpu"))
    assert type(moved[0]) is Pair and torch.equal(moved[0].features, batch[0].features)
    assert type(moved[1]["p"]) is Pair and moved[1]["p"].features == 3
