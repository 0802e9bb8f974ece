"""A forked child that drops an inherited AsyncIOHandle exits instead of hanging.

See [Note: aio engines across fork] in zero_ops/aio/handle.py.
"""

from __future__ import annotations

import gc
import os
import time

from zero_ops.aio import AsyncIOHandle


def test_forked_child_can_drop_an_inherited_handle(tmp_path):
    handle = AsyncIOHandle(thread_count=2)
    pid = os.fork()
    if pid == 0:  # child: drop the inherited handle, then exit
        try:
            del handle
            gc.collect()
        finally:
            os._exit(0)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise AssertionError("the forked child hung while destroying an inherited aio handle")
    # the parent's handle still works
    path = str(tmp_path / "f.bin")
    import torch

    data = torch.arange(1024, dtype=torch.float32)
    handle.sync_pwrite(data, path, 0)
    back = torch.empty_like(data)
    handle.sync_pread(back, path, 0)
    assert torch.equal(back, data)
