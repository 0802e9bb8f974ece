"""On NCCL, waiting on a collective orders the stream and never blocks the host.

``Work.wait(timeout)`` of NCCL blocks the host until the op has finished on the GPU, a host sync
per collective; ``Work.wait()`` only makes the current stream wait. The collective watchdog
therefore waits without a timeout on NCCL and keeps the op in flight for its thread (which polls
``is_completed``) until the device finishes it; gloo keeps its bounded wait. See
[Note: collective watchdog].
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from zero_core.comm import watchdog as wd_mod


class _FakeWork:
    def __init__(self) -> None:
        self.waits: list = []
        self.completed = False

    def wait(self, *args) -> bool:
        self.waits.append(args)
        return True

    def is_completed(self) -> bool:
        return self.completed


@pytest.mark.parametrize(
    "backend, host_blocks", [("nccl", False), ("cpu:gloo,cuda:nccl", False), ("gloo", True)]
)
def test_watchdog_waits_without_timeout_on_nccl(monkeypatch, backend, host_blocks):
    monkeypatch.setattr(wd_mod.dist, "get_backend", lambda group=None: backend)
    wd = wd_mod.CollectiveWatchdog(30.0)
    assert wd.stream_ordered() is (not host_blocks)
    work = _FakeWork()
    token = wd.begin("all_gather_into_tensor", (0, 1))
    wd.wait(work, token)
    if host_blocks:
        assert len(work.waits) == 1 and isinstance(work.waits[0][0], timedelta)
        assert wd._overdue() is None and token not in wd._inflight
    else:
        assert work.waits == [()]  # stream-ordered: no timeout, the host goes on
        assert token in wd._inflight  # the thread watches it until the device is done
        work.completed = True
        assert wd._overdue() is None and token not in wd._inflight


def test_stream_ordered_wait_still_times_out_through_the_thread(monkeypatch):
    monkeypatch.setattr(wd_mod.dist, "get_backend", lambda group=None: "nccl")
    wd = wd_mod.CollectiveWatchdog(0.05)
    work = _FakeWork()
    token = wd.begin("all_reduce", (0, 1))
    wd.wait(work, token)
    wd._inflight[token].start -= 1.0  # issued a second ago, never completed
    overdue = wd._overdue()
    assert overdue is not None and overdue[0] == token


def test_stream_ordered_wait_failure_is_diagnosed(monkeypatch):
    monkeypatch.setattr(wd_mod.dist, "get_backend", lambda group=None: "nccl")
    wd = wd_mod.CollectiveWatchdog(30.0)

    class _Failing(_FakeWork):
        def wait(self, *args) -> bool:
            raise RuntimeError("NCCL communicator was aborted")

    token = wd.begin("reduce_scatter_tensor", (0, 1))
    with pytest.raises(wd_mod.CollectiveTimeoutError, match="reduce_scatter_tensor.*aborted"):
        wd.wait(_Failing(), token)
    assert token not in wd._inflight
