"""The data loader ``initialize`` builds from ``training_data``: disjoint DistributedSampler shards,
``dataloader_drop_last`` (DeepSpeed's default false pads and keeps a short last batch), a reshuffle
per epoch seeded with ``seed + epoch``, the client's ``collate_fn``, and ``RepeatingLoader`` moving
to the next epoch."""

from __future__ import annotations

import pytest
import torch
from zero_core.testing import run_multirank

N, MICRO, WORLD = 27, 4, 2  # 27 items: 13 per rank after drop_last, 3 full micro-batches


class Indices(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def collate(items: list[int]) -> dict[str, object]:
    return {"ids": list(items), "tag": "collated"}


def _epochs() -> dict:
    import zero_core
    from zero_core.utils import RepeatingLoader

    model = torch.nn.Linear(2, 2)
    engine, _, loader, _ = zero_core.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        training_data=Indices(),
        collate_fn=collate,
        config={"train_micro_batch_size_per_gpu": MICRO, "dataloader_drop_last": True},
    )
    assert engine.training_dataloader is loader
    epochs = []
    for _ in range(2):
        batches = list(loader)
        assert all(b["tag"] == "collated" for b in batches)
        epochs.append([b["ids"] for b in batches])
    repeating = RepeatingLoader(loader)  # continues with the third epoch
    third = [next(repeating)["ids"] for _ in range(len(loader))]
    fourth_first = next(repeating)["ids"]
    return {"len": len(loader), "epochs": epochs, "third": third, "fourth_first": fourth_first}


def _expected(epoch: int, rank: int) -> list[list[int]]:
    """DistributedSampler's documented order: randperm seeded with seed + epoch, truncated to a
    multiple of the world size (drop_last), every world-th index from the rank; then whole batches."""
    order = torch.randperm(N, generator=torch.Generator().manual_seed(0 + epoch)).tolist()
    per_rank = N // WORLD
    mine = order[: per_rank * WORLD][rank::WORLD]
    return [mine[i : i + MICRO] for i in range(0, per_rank - per_rank % MICRO, MICRO)]


def test_sharded_reshuffled_collated_loader():
    results = run_multirank(_epochs, WORLD)
    for rank, out in enumerate(results):
        assert out["len"] == (N // WORLD) // MICRO == 3
        for epoch in range(2):
            assert out["epochs"][epoch] == _expected(epoch, rank)
            assert all(len(b) == MICRO for b in out["epochs"][epoch])  # drop_last: no short batch
        assert out["epochs"][0] != out["epochs"][1]  # reshuffled
        assert out["third"] == _expected(2, rank)
        assert out["fourth_first"] == _expected(3, rank)[0]
    for epoch in range(2):
        shards = [{i for b in out["epochs"][epoch] for i in b} for out in results]
        assert not shards[0] & shards[1]  # disjoint across ranks
        assert len(shards[0]) == len(shards[1]) == 3 * MICRO


def _default_epoch() -> dict:
    import zero_core

    model = torch.nn.Linear(2, 2)
    _, _, loader, _ = zero_core.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        training_data=Indices(),
        config={"train_micro_batch_size_per_gpu": MICRO},
    )
    return {"len": len(loader), "batches": [b.tolist() for b in loader]}


def test_default_keeps_every_sample_like_deepspeed():
    """Without ``dataloader_drop_last`` no sample is lost: 27 items pad to 14 per rank, 4 batches."""
    results = run_multirank(_default_epoch, WORLD)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(0)).tolist()
    padded = order + order[: WORLD * -(-N // WORLD) - N]
    for rank, out in enumerate(results):
        mine = padded[rank::WORLD]
        assert out["len"] == 4
        assert out["batches"] == [mine[i : i + MICRO] for i in range(0, len(mine), MICRO)]
        assert [len(b) for b in out["batches"]] == [4, 4, 4, 2]
    assert {i for out in results for b in out["batches"] for i in b} == set(range(N))


def test_bad_micro_batch_for_loader():
    from zero_core.engine.data import ZeroDataLoader

    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu must be >= 1, got 0"):
        ZeroDataLoader(Indices(), 0, rank=0, world_size=1)
