"""AsyncIOHandle: round trips at odd sizes/offsets, concurrency, O_DIRECT and buffered, failures."""

from __future__ import annotations

import os

import pytest
import torch
from zero_ops import _native, op_report
from zero_ops.aio import AsyncIOHandle, aligned_empty, is_aligned
from zero_ops.aio._threadpool import ThreadPoolEngine


def _engines():
    """Every backend that can run here: both native ones when kernel AIO works, and the fallback."""
    C = _native.native()
    engines = []
    if C is not None:
        engines.append("threads")
        if C.libaio_compiled() and not C.libaio_probe():
            engines.append("libaio")
    return engines + ["python"]


def _handle(engine: str, **kw) -> AsyncIOHandle:
    h = AsyncIOHandle(**kw, engine="threads" if engine == "python" else engine)
    assert engine == "python" or h.get_engine() == engine
    if engine == "python":  # the fallback engine, exercised even when the native one is built
        h._engine = ThreadPoolEngine(
            h.get_block_size(),
            h.get_queue_depth(),
            h.get_single_submit(),
            h.get_overlap_events(),
            h.get_thread_count(),
            kw.get("o_direct", True),
        )
    return h


@pytest.fixture(params=_engines())
def engine(request):
    return request.param


@pytest.mark.parametrize("single_submit,overlap_events", [(False, True), (True, True), (False, False)])
def test_round_trip_odd_sizes_and_offsets(engine, tmp_path, single_submit, overlap_events):
    h = _handle(
        engine,
        block_size=4096,
        queue_depth=3,
        single_submit=single_submit,
        overlap_events=overlap_events,
        thread_count=2,
    )
    path = tmp_path / "swap.bin"
    pieces = [(torch.randn(n), off) for n, off in [(1, 0), (1001, 7), (4097, 12345), (33_333, 200_003)]]
    for t, off in pieces:
        assert h.async_pwrite(t, path, off) == 0
    assert h.wait() == len(pieces)
    back = [torch.empty_like(t) for t, _ in pieces]
    for b, (_, off) in zip(back, pieces):
        h.async_pread(b, str(path), off)
    assert h.pending() == len(pieces)
    assert h.wait() == len(pieces)
    for b, (t, _) in zip(back, pieces):
        assert torch.equal(b, t)
    raw = path.read_bytes()  # the bytes really are at the offsets
    assert len(raw) == max(off + t.numel() * 4 for t, off in pieces)  # no over-reservation
    t, off = pieces[2]
    assert raw[off : off + 16] == bytes(t[:4].view(torch.uint8).tolist())


def test_concurrent_requests_many_files(engine, tmp_path):
    h = _handle(engine, block_size=8192, thread_count=4)
    tensors = [torch.randint(0, 2**15, (n,), dtype=torch.int16) for n in range(5000, 5030)]
    for i, t in enumerate(tensors):
        h.async_pwrite(t, tmp_path / f"f{i}", 0)
    assert h.wait() == 30
    outs = [torch.empty_like(t) for t in tensors]
    for i, o in enumerate(outs):
        h.async_pread(o, tmp_path / f"f{i}", 0)
    h.wait()
    assert all(torch.equal(a, b) for a, b in zip(outs, tensors))


@pytest.mark.parametrize("native_engine", [e for e in _engines() if e != "python"] or ["threads"])
@pytest.mark.parametrize("queue_depth,overlap_events", [(1, True), (8, True), (8, False)])
def test_o_direct_used_for_aligned_buffers(native_engine, tmp_path, queue_depth, overlap_events):
    if _native.native() is None:
        pytest.fail("native extension not built")
    engine = native_engine
    h = _handle(
        engine, block_size=1 << 14, queue_depth=queue_depth, overlap_events=overlap_events, thread_count=2
    )
    t = h.new_cpu_locked_tensor(3 * (1 << 14) + 5, torch.float32)  # aligned start, unaligned tail
    assert is_aligned(t)
    t.copy_(torch.randn(t.numel()))
    path = tmp_path / "direct.bin"
    assert h.sync_pwrite(t, path, 4096) == 1  # requests completed, as DeepSpeed's
    written_direct = h.direct_bytes()
    back = h.new_cpu_locked_tensor(t.numel(), torch.float32)
    h.sync_pread(back, path, 4096)
    assert torch.equal(back, t)
    if h.direct_bytes() == 0:
        pytest.fail(f"O_DIRECT was not used on {tmp_path} (file system refused it?)")
    assert written_direct > 0


def test_buffered_when_o_direct_off_or_unaligned(engine, tmp_path):
    path = tmp_path / "buffered.bin"
    off = _handle(engine, block_size=4096, o_direct=False)
    t = aligned_empty(10_000, torch.float64)
    t.copy_(torch.randn(10_000, dtype=torch.float64))
    off.sync_pwrite(t, path)
    back = aligned_empty(10_000, torch.float64)
    off.sync_pread(back, path)
    assert torch.equal(back, t) and off.direct_bytes() == 0
    # O_DIRECT allowed, but the buffer starts 4 bytes past a page boundary: buffered it is.
    on = _handle(engine, block_size=4096)
    raw = aligned_empty(10_001, torch.float32)
    unaligned = raw[1:]
    on.sync_pread(unaligned, path)
    assert torch.equal(unaligned.view(torch.int32), t.view(torch.int32)[:10_000]) and on.direct_bytes() == 0


def test_read_missing_file_raises_with_path(engine, tmp_path):
    h = _handle(engine)
    missing = tmp_path / "nope.bin"
    with pytest.raises(FileNotFoundError, match="nope.bin") as info:
        h.async_pread(torch.empty(10), missing)
    assert info.value.filename == str(missing)


def test_write_into_missing_directory_raises(engine, tmp_path):
    h = _handle(engine)
    with pytest.raises(FileNotFoundError, match="no_dir"):
        h.sync_pwrite(torch.randn(10), tmp_path / "no_dir" / "x.bin")


def test_short_read_raises(engine, tmp_path):
    h = _handle(engine)
    path = tmp_path / "short.bin"
    h.sync_pwrite(torch.randn(100), path)
    with pytest.raises(OSError, match="short read.*short.bin"):
        h.sync_pread(torch.empty(101), path)
    with pytest.raises(OSError, match="short read"):
        h.async_pread(torch.empty(10), path, offset=380)
    assert h.wait() == 0  # nothing was queued by the failed submissions


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to simulate a full disk")
def test_disk_full_raises_from_wait(engine):
    h = _handle(engine, block_size=4096, thread_count=2)
    h.async_pwrite(torch.randn(50_000), "/dev/full")
    with pytest.raises(OSError, match="/dev/full") as info:
        h.wait()
    assert "space" in str(info.value).lower()
    h.sync_pwrite(torch.randn(0), "/dev/full")  # the handle stays usable; empty writes are fine


def test_argument_validation(tmp_path):
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        AsyncIOHandle(block_size=0)
    with pytest.raises(TypeError, match="single_submit must be a bool"):
        AsyncIOHandle(single_submit=1)
    h = AsyncIOHandle(
        block_size=4096, queue_depth=4, single_submit=True, overlap_events=False, thread_count=3
    )
    assert (
        h.get_block_size(),
        h.get_queue_depth(),
        h.get_single_submit(),
        h.get_overlap_events(),
        h.get_thread_count(),
    ) == (4096, 4, True, False, 3)
    with pytest.raises(ValueError, match="contiguous"):
        h.async_pwrite(torch.randn(4, 4).t(), tmp_path / "x")
    with pytest.raises(ValueError, match="file_offset must be an int >= 0"):
        h.async_pwrite(torch.randn(4), tmp_path / "x", -1)
    with pytest.raises(TypeError, match="filename must be a str"):
        h.async_pwrite(torch.randn(4), 3.5)  # an int is DeepSpeed's file-descriptor overload
    with pytest.raises(ValueError, match="alignment must be a power of two"):
        aligned_empty(4, torch.float32, alignment=3000)


def test_engine_selection_and_report():
    C = _native.native()
    if C is None:
        pytest.fail("native extension not built")
    report = next(r for r in op_report() if r["name"] == "async_io")
    auto = AsyncIOHandle().get_engine()
    if C.libaio_compiled() and not C.libaio_probe():
        assert auto == "libaio" and report["isa"].startswith("libaio")
    else:
        assert auto == "threads" and report["isa"].startswith("threads")
        with pytest.raises(OSError, match="libaio"):
            AsyncIOHandle(engine="libaio")
    assert AsyncIOHandle(engine="threads").get_engine() == "threads"
    with pytest.raises(ValueError, match="engine must be 'auto', 'libaio' or 'threads'"):
        AsyncIOHandle(engine="uring")
