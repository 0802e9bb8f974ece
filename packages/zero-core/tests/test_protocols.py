"""The shared protocols: concrete implementations satisfy them and behave per contract (the
flat optimizer kernels are zero-ops'; the optimizer offload is checked in zero-offload's tests)."""

from __future__ import annotations

import pytest
import torch
import zero_core.comm
from zero_core.accelerator import CpuAccelerator, CudaAccelerator
from zero_core.offload_memory import MemoryOffloadBackend
from zero_core.protocols import (
    Accelerator,
    CommBackend,
    FlatOptimizerKernel,
    Monitor,
    OffloadBackend,
)


class _ListMonitor:
    def __init__(self) -> None:
        self.enabled = True
        self.events: list[tuple[str, float, int]] = []

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        self.events.extend(events)

    def close(self) -> None:
        self.enabled = False


def test_concrete_implementations_satisfy_protocols():
    assert isinstance(CpuAccelerator(), Accelerator)
    assert isinstance(CudaAccelerator(), Accelerator)
    assert isinstance(zero_core.comm, CommBackend)
    assert isinstance(MemoryOffloadBackend(), OffloadBackend)
    assert isinstance(_ListMonitor(), Monitor)


def test_unrelated_objects_do_not_satisfy_protocols():
    for proto in (Accelerator, CommBackend, OffloadBackend, FlatOptimizerKernel, Monitor):
        assert not isinstance(object(), proto)
    assert not isinstance(MemoryOffloadBackend(), Accelerator)


def test_monitor_protocol_usage():
    m = _ListMonitor()
    m.write_events([("Train/loss", 0.5, 10), ("Train/lr", 1e-3, 10)])
    assert m.events == [("Train/loss", 0.5, 10), ("Train/lr", 1e-3, 10)]


# -- MemoryOffloadBackend ----------------------------------------------------------------------


def test_memory_offload_round_trip_sync_and_async():
    store = MemoryOffloadBackend()
    src = torch.randn(4, 5)
    original = src.clone()
    store.swap_out("a", src)
    src.add_(1.0)  # the store holds the values at swap-out time
    assert store.contains("a") and not store.contains("b")
    out = torch.empty(4, 5)
    store.swap_in("a", out)
    assert torch.equal(out, original)

    bf = torch.randn(7).to(torch.bfloat16)
    store.swap_out("b", bf, async_op=True)
    store.wait()
    out_bf = torch.empty(7, dtype=torch.bfloat16)
    store.swap_in("b", out_bf, async_op=True)
    store.wait()
    assert torch.equal(out_bf, bf)
    assert store.nbytes() == 4 * 5 * 4 + 7 * 2


def test_memory_offload_overwrite_remove_close():
    store = MemoryOffloadBackend()
    store.swap_out("k", torch.ones(3))
    store.swap_out("k", torch.full((3,), 2.0))
    out = torch.empty(3)
    store.swap_in("k", out)
    assert out.tolist() == [2.0, 2.0, 2.0]
    store.swap_out("k", torch.zeros(2, dtype=torch.int64))  # new shape/dtype replaces the buffer
    out_i = torch.empty(2, dtype=torch.int64)
    store.swap_in("k", out_i)
    assert out_i.tolist() == [0, 0]
    store.remove("k")
    assert not store.contains("k")
    with pytest.raises(KeyError, match="nothing is stored under key 'k'"):
        store.remove("k")
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.swap_out("k", torch.ones(1))


def test_memory_offload_validation():
    store = MemoryOffloadBackend()
    with pytest.raises(ValueError, match="non-empty str"):
        store.swap_out("", torch.ones(1))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        store.swap_out("x", [1.0])
    with pytest.raises(KeyError, match="missing"):
        store.swap_in("missing", torch.empty(1))
    store.swap_out("x", torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"holds \(2, 2\) torch.float32, but out is \(4,\)"):
        store.swap_in("x", torch.empty(4))
