"""Loads read into the live state, and verification reads ahead.

See [Note: loading into the live state] (checkpoint/inplace.py) and [Note: verification
reads ahead] (checkpoint/integrity.py).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, not ~4 s in every forked rank)
import torch.nn as nn
import zero_core.engine  # noqa: F401
from zero_core.checkpoint import integrity
from zero_core.checkpoint.fragments import CheckpointReader
from zero_core.checkpoint.inplace import state_buffer, zero_uncovered
from zero_core.checkpoint.integrity import file_sum64, sum64_reference
from zero_core.checkpoint.tensor_file import TensorEntry, write_tensor_file
from zero_core.testing import run_multirank

# -- helpers ----------------------------------------------------------------------------


def test_state_buffer_reuses_only_a_matching_tensor():
    live = torch.randn(3, 4)
    buf = state_buffer(live, 12, torch.float32, "cpu")
    assert buf.data_ptr() == live.data_ptr() and buf.shape == (12,)
    for other in (
        torch.randn(13),  # size
        torch.randn(12, dtype=torch.float64),  # dtype
        torch.randn(4, 3).t(),  # not contiguous
        torch.randn(12, requires_grad=True),  # a leaf the caller trains: never overwritten
        None,
        1.5,
    ):
        got = state_buffer(other, 12, torch.float32, "cpu")
        assert got.shape == (12,) and got.dtype == torch.float32
        assert not torch.is_tensor(other) or got.data_ptr() != other.data_ptr()
    with pytest.raises(ValueError, match="numel must be a non-negative int"):
        state_buffer(None, -1, torch.float32, "cpu")
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        state_buffer(None, 3, "float32", "cpu")


def test_zero_uncovered_zeroes_exactly_the_gaps():
    buf = torch.full((10,), float("nan"))
    zero_uncovered(buf, [(6, 8), (1, 3), (2, 4)])  # unsorted and overlapping
    nan = buf.isnan()
    assert nan.tolist() == [i in (1, 2, 3, 6, 7) for i in range(10)]
    assert (buf[~nan] == 0).all()
    full = torch.full((4,), 7.0)
    zero_uncovered(full, [(0, 4)])
    assert full.tolist() == [7.0] * 4
    empty = torch.full((3,), 7.0)
    zero_uncovered(empty, [])
    assert empty.tolist() == [0.0] * 3
    with pytest.raises(ValueError, match=r"range \[2, 11\) is outside a tensor of 10"):
        zero_uncovered(buf, [(2, 11)])
    with pytest.raises(ValueError, match="expected a flat"):
        zero_uncovered(torch.zeros(2, 2), [])


def test_fp32_module_value_is_master_only_without_two_fp32_sources(tmp_path):
    def reader(kinds: dict[str, torch.dtype]) -> CheckpointReader:
        frags, entries = [], []
        for kind, dtype in kinds.items():
            key = f"{kind}:w:0"
            frags.append(
                {"name": "w", "kind": kind, "shape": [4], "dtype": str(dtype).split(".")[1], "start": 0}
                | {"end": 4, "key": key, "elementwise": True, "python_scalar": False}
            )
            entries.append(TensorEntry(key, (4,), dtype, lambda d=dtype: torch.ones(4, dtype=d)))
        name = f"r_{len(os.listdir(tmp_path))}.safetensors"
        rec = write_tensor_file(str(tmp_path / name), entries)
        return CheckpointReader(str(tmp_path), [{"file": name, "file_record": rec, "fragments": frags}])

    assert reader({"fp32": torch.float32}).fp32_module_value_is_master("w")
    assert reader({"param": torch.float32}).fp32_module_value_is_master("w")
    assert reader({"param": torch.bfloat16, "fp32": torch.float32}).fp32_module_value_is_master("w")
    assert not reader({"param": torch.float32, "fp32": torch.float32}).fp32_module_value_is_master("w")


# -- verification reads ahead -------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 64 * 5 + 9, 64 * 40])
def test_read_ahead_checksum_equals_the_definition(tmp_path, monkeypatch, size):
    monkeypatch.setattr(integrity, "_CHUNK", 64)  # small pieces: many reads, the buffer reused
    monkeypatch.setattr(integrity, "_WINDOW", 256)
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert file_sum64(str(path)) == (size, sum64_reference(data))


def test_verification_queues_readahead_before_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "_CHUNK", 64)
    monkeypatch.setattr(integrity, "_WINDOW", 256)
    path = tmp_path / "f"
    path.write_bytes(os.urandom(64 * 20 + 5))
    events = []
    real_advise, real_preadv = os.posix_fadvise, os.preadv

    def advise(fd, offset, length, how):
        if how == os.POSIX_FADV_WILLNEED:
            events.append(("willneed", offset, offset + length))
        return real_advise(fd, offset, length, how)

    def preadv(fd, bufs, offset):
        events.append(("read", offset, offset + len(bufs[0])))
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(integrity.os, "posix_fadvise", advise)
    monkeypatch.setattr(integrity.os, "preadv", preadv)
    assert file_sum64(str(path))[0] == 64 * 20 + 5
    queued = 0
    for kind, lo, hi in events:
        if kind == "willneed":
            assert lo == queued
            queued = hi
        elif lo < 64 * 20 + 5:  # every byte read was queued for readahead first, a window ahead
            assert queued >= min(64 * 20 + 5, lo + 256), (lo, queued)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_verification_errors_propagate_and_close_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "_CHUNK", 64)
    path = tmp_path / "f"
    path.write_bytes(os.urandom(64 * 50))
    before = _open_fds()
    seen = []

    def fold(view: memoryview) -> None:
        seen.append(len(view))
        if len(seen) == 3:
            raise RuntimeError("fold failed")

    with pytest.raises(RuntimeError, match="fold failed"):
        integrity._stream(str(path), fold)
    assert _open_fds() == before

    real = os.preadv

    def failing_preadv(fd, bufs, offset):
        if offset >= 64 * 4:
            raise OSError(5, "Input/output error")
        return real(fd, bufs, offset)

    monkeypatch.setattr(integrity.os, "preadv", failing_preadv)
    with pytest.raises(OSError, match="Input/output error"):
        file_sum64(str(path))
    assert _open_fds() == before


# -- loading into the live optimizer state ------------------------------------------------

D = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(D, 13)  # 13-element bias: the stage-3 shards of 2 ranks have padding
        self.l2 = nn.Linear(13, 5)  # 187 parameters: the stage-1/2 flat shards of 2 ranks have padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x))).pow(2).mean()


def _train(engine, first: int, last: int) -> list[float]:
    import torch.distributed as dist

    out = []
    for step in range(first, last):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        loss = engine(torch.randn(2, D, generator=g))
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def _elementwise(engine) -> dict[tuple[int, str], torch.Tensor]:
    """The live elementwise optimizer state tensors, keyed by (position of the master, state key)."""
    opt = engine.strategy.optimizer
    masters = [p for g in opt.param_groups for p in g["params"]]
    return {
        (i, k): v
        for i, m in enumerate(masters)
        for k, v in opt.state.get(m, {}).items()
        if torch.is_tensor(v) and v.numel() == m.numel() and v.numel() > 1
    }


def _load_into_trained_engine(stage: int, tmp: str) -> tuple[list[float], list[float]]:
    import zero_core

    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 1000},
    }
    engine, *_ = zero_core.initialize(model=Net(), config=cfg)
    _train(engine, 0, 3)
    engine.save_checkpoint(tmp, tag="a")
    saved = {k: v.clone() for k, v in _elementwise(engine).items()}
    after_save = _train(engine, 3, 6)
    live = _elementwise(engine)
    assert live and live.keys() == saved.keys()
    assert any(not torch.equal(live[k], saved[k]) for k in saved), "training did not change the states"
    for v in live.values():  # garbage where no checkpoint range lands: the load must zero it
        v.view(-1)[-1] = float("nan")
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    engine.load_checkpoint(tmp, tag="a")
    loaded = _elementwise(engine)
    assert {k: v.data_ptr() for k, v in loaded.items()} == ptrs, "the live state tensors were not reused"
    for k, v in loaded.items():
        assert torch.equal(v, saved[k]), (stage, k)
    return after_save, _train(engine, 3, 6)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_load_reads_into_the_live_optimizer_state(tmp_path, stage):
    """A trained engine loads an earlier checkpoint into its own state tensors, padding zeroed, and
    then trains exactly as it did from that point."""
    for after_save, after_load in run_multirank(_load_into_trained_engine, 2, args=(stage, str(tmp_path))):
        assert after_load == after_save
