"""The GPU lane's choices, checked on CPU with a faked device count (see [Note: GPU test lane]):
NCCL with one GPU per rank where CUDA has enough devices, gloo otherwise, and a visible
"needs CUDA" skip reason where there is none."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist
from zero_core.testing import gpu_lane, run_multirank

multirank = importlib.import_module(
    "zero_core.testing.multirank"
)  # the package exports a decorator by that name


def _fake_cuda(monkeypatch, count: int, built: bool = True) -> None:
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: built)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    def _no_init() -> bool:  # the lane must never initialise CUDA in the forking process
        raise AssertionError("torch.cuda.is_available() called: it initialises CUDA before the fork")

    monkeypatch.setattr(torch.cuda, "is_available", _no_init)


@pytest.mark.parametrize(
    "count, world, backend, lane_world",
    [
        (0, 1, "gloo", 1),
        (1, 1, "nccl", 1),
        (1, 2, "gloo", 1),
        (2, 2, "nccl", 2),
        (8, 2, "nccl", 2),
        (8, 4, "nccl", 2),
    ],
)
def test_backend_and_world_size_follow_the_device_count(monkeypatch, count, world, backend, lane_world):
    _fake_cuda(monkeypatch, count)
    assert gpu_lane.choose_backend(world) == backend
    assert multirank._resolve_backend("auto", world) == backend
    assert gpu_lane.lane_world_size() == lane_world
    assert (gpu_lane.why_no_cuda(world) is None) is (count >= world)


def test_no_cuda_build_is_named_in_the_skip_reason(monkeypatch):
    _fake_cuda(monkeypatch, 0, built=False)
    reason = gpu_lane.why_no_cuda()
    assert reason.startswith("needs CUDA: 1 GPU(s) wanted") and "CPU-only build" in reason
    marks = gpu_lane.needs_cuda()
    assert [m.name for m in marks] == ["gpu", "skipif"]
    assert marks[1].args == (True,) and marks[1].kwargs["reason"] == reason
    _fake_cuda(monkeypatch, 2)
    assert gpu_lane.needs_cuda(2)[1].args == (False,)


def test_nccl_without_enough_gpus_is_a_clear_error(monkeypatch):
    _fake_cuda(monkeypatch, 1)
    with pytest.raises(ValueError, match="needs one CUDA device per rank \\(2\\), this machine has 1"):
        run_multirank(lambda: None, 2, backend="nccl")
    with pytest.raises(ValueError, match="'auto'"):
        run_multirank(lambda: None, 2, backend="cuda")
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        gpu_lane.choose_backend(0)


def test_each_nccl_rank_takes_its_own_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for rank in range(3):
        multirank._set_rank_device("nccl", rank)
    multirank._set_rank_device("gloo", 5)
    assert calls == [0, 1, 2]


def test_auto_runs_the_chosen_backend():  # gloo here; NCCL on a machine with 2 GPUs
    want = gpu_lane.choose_backend(2)
    assert run_multirank(lambda: dist.get_backend(), 2, backend="auto") == [want, want]
