"""Swap files are checksummed (see [Note: swap checksums]): bytes changed on disk between a write and
its read are an error naming the file and range, on every NVMe path (the optimizer's tile pipeline
and its range reads/writes, ``NvmeOffloadBackend``); a partial write keeps the tile's checksum
right; the checks can be turned off; a killed process's job folder is swept by the next one.
The stage-3 parameter path is exercised end to end by tools/faults/failfast_cases.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from zero_offload.backends import NvmeOffloadBackend
from zero_offload.nvme_swapper import BufferPool, StateSwapper
from zero_offload.swap_files import SwapDirectory, SwapFileError
from zero_ops.aio import AsyncIOHandle

TILE = 1024


def _swapper(tmp_path, numel: int = 3 * TILE + 100) -> StateSwapper:
    d = SwapDirectory(tmp_path, 0, what="test")
    return StateSwapper(
        d,
        "g",
        numel,
        ("exp_avg", "exp_avg_sq"),
        tile_numel=TILE,
        pool=BufferPool(3, 2 * TILE),
        read_handle=AsyncIOHandle(),
        write_handle=AsyncIOHandle(),
        pipeline_read=True,
        pipeline_write=True,
        fast_init=True,
    )


def _bump(lo: int, hi: int, states: dict) -> None:
    for v in states.values():
        v.add_(torch.arange(lo, hi, dtype=torch.float32))


def _corrupt(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(os.urandom(64))


def test_tile_pipeline_detects_changed_bytes_naming_file_and_range(tmp_path):
    sw = _swapper(tmp_path)
    sw.run(_bump)
    sw.run(_bump)  # reads back what the first pass wrote: verified
    path = sw.dir.path / sw.files["exp_avg_sq"]
    _corrupt(path, 4 * TILE + 8)  # inside the second tile
    with pytest.raises(SwapFileError) as info:
        sw.run(_bump)
    msg = str(info.value)
    assert (
        f"swap file {path}: bytes [{4 * TILE}, {8 * TILE})" in msg
        and "restart from the last checkpoint" in msg
    )
    sw.dir.close()


def test_range_writes_keep_checksums_and_range_reads_verify(tmp_path):
    sw = _swapper(tmp_path)
    sw.run(_bump)
    values = torch.randn(TILE + 10)
    sw.write_range("exp_avg", TILE - 5, values)  # two tiles in part: read, patched, rewritten
    assert torch.equal(sw.read_range("exp_avg", TILE - 5, 2 * TILE + 5), values)
    sw.run(_bump)  # the pipeline verifies the rewritten tiles
    expected = values + torch.arange(TILE - 5, 2 * TILE + 5, dtype=torch.float32)
    assert torch.equal(sw.read_range("exp_avg", TILE - 5, 2 * TILE + 5), expected)
    _corrupt(sw.dir.path / sw.files["exp_avg"], 0)
    with pytest.raises(SwapFileError, match="g.exp_avg.swp: bytes \\[0, 4096\\)"):
        sw.read_range("exp_avg", 3, 5)
    sw.dir.close()


def test_checksums_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_SWAP_CHECKSUMS", "0")
    sw = _swapper(tmp_path)
    sw.run(_bump)
    _corrupt(sw.dir.path / sw.files["exp_avg"], 0)
    sw.run(_bump)  # not checked: trains on what the file holds
    monkeypatch.setenv("ZERO_SWAP_CHECKSUMS", "maybe")
    with pytest.raises(ValueError, match="ZERO_SWAP_CHECKSUMS must be 1 or 0"):
        _swapper(tmp_path / "other")
    sw.dir.close()


@pytest.mark.parametrize("async_op", [False, True])
def test_backend_swap_in_detects_changed_bytes(tmp_path, async_op):
    be = NvmeOffloadBackend(tmp_path, rank=0)
    t = torch.randn(3000)
    be.swap_out("w", t)
    out = torch.empty_like(t)
    be.swap_in("w", out)
    assert torch.equal(out, t)
    _corrupt(be._dir.path / "w.swp", 100)
    with pytest.raises(SwapFileError, match="w.swp: bytes \\[0, 12000\\)"):
        be.swap_in("w", out, async_op=async_op)
        be.wait()
    be.close()


def test_killed_process_job_folder_is_swept_by_the_next(tmp_path):
    code = (
        "import os, sys; from zero_offload.swap_files import SwapDirectory; "
        f"d = SwapDirectory({str(tmp_path)!r}, 0); d.allocate('x.swp', 4096); os._exit(0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=120)
    assert proc.returncode == 0
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith("job-")
    d = SwapDirectory(tmp_path, 0)
    assert [p.name for p in tmp_path.iterdir()] == [d.job_dir.name]  # the dead process's folder is gone
    d.close()
    assert list(tmp_path.iterdir()) == []


def _crc_in_child(queue) -> None:  # noqa: ANN001
    from zero_offload.swap_checksums import SwapChecksums

    queue.put(SwapChecksums._crc(torch.ones(3 * 2**20)))


def test_checksum_threads_work_in_a_forked_child():
    """A child forked after the parent checksummed inherits the thread pool but not its threads."""
    import multiprocessing

    from zero_offload.swap_checksums import SwapChecksums

    want = SwapChecksums._crc(torch.ones(3 * 2**20))  # the parent's pool is up
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_crc_in_child, args=(queue,))
    child.start()
    child.join(60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and queue.get(timeout=5) == want
