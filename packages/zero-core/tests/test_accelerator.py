"""CpuAccelerator behaviour and accelerator selection (get_accelerator / set_accelerator)."""

from __future__ import annotations

import time

import pytest
import torch
import zero_core.accelerator as acc_mod
from zero_core.accelerator import (
    CpuAccelerator,
    CpuEvent,
    CpuStream,
    CudaAccelerator,
    get_accelerator,
    set_accelerator,
)
from zero_core.protocols import Accelerator, Event, Stream


@pytest.fixture
def fresh_accelerator(monkeypatch):
    """Clear the cached accelerator before and after the test."""
    set_accelerator(None)
    yield monkeypatch
    set_accelerator(None)


def test_get_accelerator_detects_cpu_and_caches(fresh_accelerator):
    fresh_accelerator.delenv(acc_mod.ENV_VAR, raising=False)
    a = get_accelerator()
    expected = CudaAccelerator if torch.cuda.is_available() else CpuAccelerator
    assert isinstance(a, expected) and isinstance(a, Accelerator)
    assert get_accelerator() is a


def test_env_override(fresh_accelerator):
    fresh_accelerator.setenv(acc_mod.ENV_VAR, "CPU")
    assert isinstance(get_accelerator(), CpuAccelerator)
    set_accelerator(None)
    fresh_accelerator.setenv(acc_mod.ENV_VAR, "tpu")
    with pytest.raises(
        ValueError, match="ZERO_ACCELERATOR='tpu' is not a known accelerator; allowed: cpu, cuda"
    ):
        get_accelerator()
    if not torch.cuda.is_available():
        fresh_accelerator.setenv(acc_mod.ENV_VAR, "cuda")
        with pytest.raises(RuntimeError, match="torch.cuda.is_available\\(\\) is False"):
            get_accelerator()


def test_set_accelerator_validates(fresh_accelerator):
    mine = CpuAccelerator()
    set_accelerator(mine)
    assert get_accelerator() is mine
    with pytest.raises(TypeError, match="does not implement the Accelerator protocol"):
        set_accelerator(object())


def test_cpu_devices():
    a = CpuAccelerator()
    assert a.device_type == "cpu" and a.is_available()
    assert a.device() == torch.device("cpu") and a.device(3) == torch.device("cpu")
    assert a.device_name() == "cpu" and a.current_device_name() == "cpu"
    assert a.current_device() == 0 and a.device_count() == 1
    assert a.communication_backend_name() == "gloo"
    a.set_device(1)  # every rank of a host calls set_device(local_rank): accepted
    with pytest.raises(ValueError, match="non-negative int"):
        a.set_device(-1)
    with pytest.raises(ValueError, match="non-negative int"):
        a.device("0")
    assert a.is_bf16_supported() and a.is_fp16_supported()


def test_cuda_accelerator_static_parts():
    c = CudaAccelerator()
    assert c.device_type == "cuda" and c.communication_backend_name() == "nccl"
    assert c.device_name() == "cuda" and c.device_name(2) == "cuda:2"
    assert c.Stream is torch.cuda.Stream and c.Event is torch.cuda.Event
    assert c.is_available() == torch.cuda.is_available()


def test_cpu_streams_and_events():
    a = CpuAccelerator()
    s = a.Stream()
    assert isinstance(s, CpuStream) and isinstance(s, Stream)
    default = a.current_stream()
    with a.stream(s) as entered:
        assert entered is s and a.current_stream() is s
    assert a.current_stream() is default
    with a.stream(None):
        assert a.current_stream() is default
    with pytest.raises(TypeError, match="expected a CpuStream"):
        with a.stream("s"):
            pass

    start, end = a.Event(enable_timing=True), a.Event(enable_timing=True)
    assert isinstance(start, CpuEvent) and isinstance(start, Event)
    start.record()
    time.sleep(0.02)
    end.record(s)
    end.synchronize()
    assert end.query() and start.query()
    assert 15.0 <= start.elapsed_time(end) < 2000.0
    ev = s.record_event()
    assert isinstance(ev, CpuEvent) and ev.query()
    s.wait_event(ev)
    s.wait_stream(default)
    s.synchronize()
    a.synchronize()
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        a.Event().elapsed_time(a.Event())
    with pytest.raises(RuntimeError, match="recorded"):
        a.Event(enable_timing=True).elapsed_time(a.Event(enable_timing=True))


def test_cpu_memory_stats_track_rss():
    a = CpuAccelerator()
    a.reset_peak_memory_stats()
    before = a.memory_allocated()
    assert before > 0
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    during = a.memory_allocated()
    assert during - before > 48 * 2**20
    peak = a.max_memory_allocated()
    assert peak >= during
    del big
    stats = a.memory_stats()
    assert set(stats) >= {"allocated_bytes.all.current", "allocated_bytes.all.peak"}
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"]
    assert stats["allocated_bytes.all.peak"] >= during
    a.empty_cache()


def test_cpu_pinning_and_rng():
    a = CpuAccelerator()
    t = torch.ones(4)
    pinned = a.pin_memory(t)
    if not torch.cuda.is_available():
        assert pinned is t and not a.is_pinned(t)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        a.pin_memory([1, 2])

    a.manual_seed(123)
    state = a.get_rng_state()
    x = torch.rand(5)
    a.set_rng_state(state)
    assert torch.equal(torch.rand(5), x)
    a.manual_seed_all(123)
    assert torch.equal(torch.rand(5), x)
    with pytest.raises(TypeError, match="seed must be an int"):
        a.manual_seed(1.5)
    with pytest.raises(TypeError, match="uint8"):
        a.set_rng_state(torch.zeros(3))
