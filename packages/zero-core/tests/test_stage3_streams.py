"""Stage 3 orders its side streams as a GPU needs, checked on CPU (see [Note: stage-3 streams]).

A ``RecordingAccelerator`` logs every stream wait, event and aten op with its stream; replaying
the log as a GPU orders it finds any op that uses a storage written on another stream without
waiting for it, and any storage used on a stream other than its own without ``record_stream``.
The training run itself must still match plain PyTorch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank
from zero_core.testing.streams import RecordingAccelerator

WORLD, BATCH, DIM, LAYERS, STEPS = 2, 4, 12, 4, 3


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return nn.functional.mse_loss(x, y)


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


def _reference() -> list[float]:
    torch.manual_seed(0)
    model = _Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        for rank in range(WORLD):
            loss = model(*_data(step, rank))
            (loss / WORLD).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _train(break_wait: bool) -> tuple[list[float], list[str], set[str], int]:
    import zero_core
    from zero_core import comm
    from zero_core.accelerator import set_accelerator
    from zero_core.zero.stage3 import streams

    if break_wait:  # the side streams no longer wait for compute: the checker must see it
        original = streams.Stage3Streams._side

        def _no_wait(self, stream, crossing):
            stream.wait_stream = lambda other: None
            return original(self, stream, crossing)

        streams.Stage3Streams._side = _no_wait
    acc = RecordingAccelerator()
    set_accelerator(acc)
    rank = comm.get_rank()
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "param_persistence_threshold": 0,  # every parameter is gathered and released
            "prefetch_bucket_size": 2 * DIM * DIM,  # prefetches from the second step on
            "reduce_bucket_size": DIM * DIM,  # several buckets in flight during backward
        },
    }
    engine, *_ = zero_core.initialize(
        model=_Stack(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), config=cfg
    )
    losses = []
    for step in range(STEPS):
        x, y = _data(step, rank)
        if step == 0:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        else:
            with acc.recording():
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
        losses.append(loss.item())
    prefetched = engine.strategy.coordinator.prefetched
    engine.destroy()
    return losses, acc.races(), acc.streams_used(), prefetched


def test_stage3_side_streams_are_ordered_and_training_matches_pytorch() -> None:
    ref = _reference()
    got = run_multirank(_train, WORLD, args=(False,), timeout=240)
    for rank, (losses, races, used, prefetched) in enumerate(got):
        assert races == [], f"rank {rank}: " + "\n".join(races[:10])
        # compute plus both side streams ran ops, and prefetching happened
        assert len(used) == 3 and "compute" in used, used
        assert prefetched > 0
        assert losses == pytest.approx(ref[rank::WORLD], rel=1e-5)


def test_stage3_stream_checker_sees_a_missing_wait() -> None:
    got = run_multirank(_train, WORLD, args=(True,), timeout=240)
    for rank, (_losses, races, _used, _p) in enumerate(got):
        assert any("without waiting" in r for r in races), f"rank {rank}: {races[:3]}"


def test_recording_accelerator_finds_races_and_missing_record_stream() -> None:
    acc = RecordingAccelerator()
    side = acc.Stream()
    with acc.recording():
        a = torch.ones(4)  # on compute
        with acc.stream(side):
            b = a * 2  # reads a without waiting for compute
        c = b + 1  # compute reads b (made on side) without waiting, no record_stream
    races = acc.races()
    assert any("mul" in r and "without waiting" in r for r in races), races
    assert any("add" in r and "without waiting" in r for r in races), races
    assert any("no record_stream for compute" in r for r in races), races

    acc = RecordingAccelerator()
    side = acc.Stream()
    with acc.recording():
        a = torch.ones(4)
        side.wait_stream(acc.current_stream())
        acc.record_stream(a, side)
        with acc.stream(side):
            b = a * 2
            done = side.record_event()
        acc.current_stream().wait_event(done)
        acc.record_stream(b, acc.current_stream())
        c = b + 1
    assert acc.races() == []
    assert torch.equal(c, torch.full((4,), 3.0))
