"""new_cpu_locked_tensor / locked_empty: page-aligned, page-locked where allowed, clear fallback."""

from __future__ import annotations

import errno

import pytest
import torch
from zero_ops.aio import AsyncIOHandle, buffers, is_aligned, is_locked, lock_failure, locked_empty


def _vm_locked_kib() -> int:
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith("VmLck:"))
    return int(line.split()[1])


def test_locked_buffer_is_aligned_and_lock_matches_kernel_accounting(tmp_path):
    before = _vm_locked_kib()
    t = locked_empty(3 * 1024 * 1024 // 4 + 7, torch.float32)  # ~3 MiB, odd tail
    assert is_aligned(t) and t.numel() == 3 * 1024 * 1024 // 4 + 7
    grown = _vm_locked_kib() - before
    if is_locked(t):  # the kernel must agree that the pages are locked
        assert grown >= t.numel() * 4 // 1024, (grown, lock_failure())
    else:
        assert grown == 0 and "RLIMIT_MEMLOCK" in lock_failure()
    t.copy_(torch.randn(t.numel()))
    h = AsyncIOHandle(block_size=1 << 16, thread_count=2)
    h.sync_pwrite(t, tmp_path / "locked.bin")
    back = h.new_cpu_locked_tensor(t.numel())
    h.sync_pread(back, tmp_path / "locked.bin")
    assert torch.equal(back, t)
    del t, back
    assert _vm_locked_kib() <= before + 4  # freeing the tensors unmapped (and unlocked) them


def test_refused_lock_warns_once_and_returns_usable_memory(monkeypatch):
    monkeypatch.setattr(buffers, "_mlock", lambda address, nbytes: errno.ENOMEM)
    monkeypatch.setattr(buffers, "_warned_lock", False)
    with pytest.warns(RuntimeWarning, match="could not page-lock.*RLIMIT_MEMLOCK.*ulimit -l"):
        t = locked_empty(1000, torch.bfloat16)
    assert not is_locked(t) and is_aligned(t)
    assert "Cannot allocate memory" in lock_failure() and "errno 12" in lock_failure()
    t.fill_(1.5)
    assert t.float().sum().item() == 1500.0
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second refusal is silent
        locked_empty(10)


def test_locked_empty_validation():
    assert locked_empty(0).numel() == 0
    with pytest.raises(ValueError, match="numel must be an int >= 0"):
        locked_empty(-1)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        locked_empty(4, "float32")
    h = AsyncIOHandle()
    assert h.new_cpu_locked_tensor(torch.empty(12), torch.float16).numel() == 12
