"""Native aio engine: runs of blocks moved per call, O_DIRECT/buffered split, readahead hints.

See [Note: runs of blocks] and [Note: buffered read readahead] in csrc/aio_engine.h.
"""

from __future__ import annotations

import os

import pytest
import torch
from zero_ops import _native
from zero_ops.aio import AsyncIOHandle, aligned_empty


def _native_engines() -> list[str]:
    C = _native.native()
    if C is None:
        return ["threads"]  # the test then fails loudly below: the build is broken
    return ["threads"] + (["libaio"] if C.libaio_compiled() and not C.libaio_probe() else [])


@pytest.fixture(params=_native_engines())
def engine(request):
    if _native.native() is None:
        pytest.fail("native extension not built")
    return request.param


def _counts(h: AsyncIOHandle) -> tuple[int, int]:
    return h._engine.direct_bytes(), h._engine.buffered_bytes()


@pytest.mark.parametrize(
    "thread_count,queue_depth,single_submit", [(1, 8, False), (2, 3, False), (1, 4, True)]
)
def test_direct_runs_and_buffered_tail(engine, tmp_path, thread_count, queue_depth, single_submit):
    # 21 aligned 4 KiB blocks and a 100-byte tail: O_DIRECT runs of up to queue_depth blocks,
    # then one buffered block; every byte is accounted to exactly one of the two.
    h = AsyncIOHandle(
        block_size=4096,
        queue_depth=queue_depth,
        thread_count=thread_count,
        single_submit=single_submit,
        engine=engine,
    )
    nbytes = 21 * 4096 + 100
    src = h.new_cpu_locked_tensor(nbytes, torch.uint8)
    src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    path = tmp_path / "runs.bin"
    h.sync_pwrite(src, path, 8192)
    d, b = _counts(h)
    assert d + b == nbytes
    if d == 0:
        pytest.fail(f"O_DIRECT was not used on {tmp_path} (file system refused it?)")
    assert d == 21 * 4096 and b == 100
    back = h.new_cpu_locked_tensor(nbytes, torch.uint8)
    h.sync_pread(back, path, 8192)
    assert torch.equal(back, src)
    assert _counts(h) == (2 * d, 2 * b)
    assert os.path.getsize(path) == 8192 + nbytes


@pytest.mark.parametrize("thread_count", [1, 2])
def test_buffered_runs_round_trip(engine, tmp_path, thread_count):
    # o_direct off: every block is buffered and moved in runs of queue_depth blocks, on both
    # backends (libaio moves buffered runs itself instead of through io_submit).
    h = AsyncIOHandle(
        block_size=3000, queue_depth=5, thread_count=thread_count, o_direct=False, engine=engine
    )
    src = torch.randn(50_001, dtype=torch.float64)  # 400_008 bytes: 134 blocks, last one short
    path = tmp_path / "buffered_runs.bin"
    h.sync_pwrite(src, path, 777)
    back = torch.empty_like(src)
    h.sync_pread(back, path, 777)
    assert torch.equal(back, src)
    assert _counts(h) == (0, 2 * src.numel() * 8)


def test_runs_of_concurrent_requests_stay_separate(engine, tmp_path):
    # Adjacent file ranges written by separate requests at once: runs never cross requests.
    h = AsyncIOHandle(block_size=4096, queue_depth=8, thread_count=2, engine=engine)
    parts = [aligned_empty(4096 * k + 4, torch.uint8) for k in (1, 3, 9)]
    offset = 0
    offsets = []
    for i, p in enumerate(parts):
        p.fill_(i + 1)
        offsets.append(offset)
        h.async_pwrite(p, tmp_path / "adjacent.bin", offset)
        offset += p.numel()
    assert h.wait() == len(parts)
    raw = (tmp_path / "adjacent.bin").read_bytes()
    for i, (p, off) in enumerate(zip(parts, offsets)):
        assert raw[off : off + p.numel()] == bytes([i + 1]) * p.numel()
    outs = [aligned_empty(p.numel(), torch.uint8) for p in parts]
    for o, off in zip(outs, offsets):
        h.async_pread(o, tmp_path / "adjacent.bin", off)
    h.wait()
    assert all(torch.equal(o, p) for o, p in zip(outs, parts))


def test_read_from_character_device_ignores_readahead_hint(engine):
    # posix_fadvise fails on a character device (it has no page cache); the read must not.
    if not os.path.exists("/dev/zero"):
        pytest.fail("/dev/zero missing on a Linux test machine")
    h = AsyncIOHandle(block_size=4096, queue_depth=4, thread_count=2, o_direct=False, engine=engine)
    out = torch.full((30_000,), 7, dtype=torch.uint8)
    h.sync_pread(out, "/dev/zero")
    assert int(out.count_nonzero()) == 0
