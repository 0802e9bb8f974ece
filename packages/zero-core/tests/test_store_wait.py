"""Watched store waits ([Note: watched store waits]): a wait for peers' keys in the store (the
stage-3 agreement's) is left within seconds when a member recorded a failure, names it, and is
published as the op this rank waits in; a wait for a key another rank released names the same
failure at once; keys already there cost one ``multi_get``."""

from __future__ import annotations

import time

from zero_core.testing import run_multirank

TIMEOUT_S = 60.0  # far above what the test waits: only the failure may end the wait


def _failed_peer_rank() -> dict:
    import torch.distributed as dist
    from zero_core import comm
    from zero_core.comm import failures, peer_state, watchdog
    from zero_core.comm.collective_errors import PeerFailedError
    from zero_core.comm.store_wait import wait_for_keys

    watchdog.set_collective_timeout(TIMEOUT_S)
    comm.barrier()  # starts the watchdogs: both ranks publish records
    store = dist.distributed_c10d._get_default_store().clone()
    rank = comm.get_rank()
    # keys already there: no wait, nothing left in flight
    store.set(f"t/ready/{rank}", str(rank))
    got = wait_for_keys(store, [f"t/ready/{1 - rank}"], (0, 1), "the ready exchange")
    assert got == [str(1 - rank).encode()] and not watchdog.get_watchdog()._inflight
    comm.barrier()
    if rank == 1:
        time.sleep(2.5)  # rank 0 is waiting by now, and its record (published once a poll) says so
        records = peer_state.peer_records(store, [0])
        failures.record("RuntimeError: injected failure on rank 1", "in backward at train.py:7")
        time.sleep(6.0)  # alive: only its record can release rank 0
        return {"published": records[0].get("wait")}
    start = time.monotonic()
    try:
        wait_for_keys(store, ["t/never/1"], (0, 1), "the test's exchange")
    except PeerFailedError as exc:
        out = {"text": str(exc), "failed_rank": exc.failed_rank, "s": time.monotonic() - start}
    else:
        return {"text": "no error"}
    # another wait for the released key (as a third rank waiting for it would) reads the failure
    # from the marker, not from its own thread: it is named at once
    start = time.monotonic()
    try:
        wait_for_keys(store, ["t/never/1"], (0, 1), "a second exchange")
    except PeerFailedError as exc:
        out.update(again=str(exc), again_s=time.monotonic() - start)
    return out


def test_a_failed_member_releases_the_store_wait_and_is_named() -> None:
    r0, r1 = run_multirank(_failed_peer_rank, 2, timeout=120)
    assert r0["failed_rank"] == 1, r0
    assert "collective the test's exchange (#" in r0["text"], r0
    assert "cannot complete: rank 1 failed in backward at train.py:7: RuntimeError: injected" in r0["text"]
    assert r0["s"] < 2.5 + 8.0, r0  # about two watchdog polls after the record, not the 60 s timeout
    assert "collective a second exchange (#" in r0["again"] and "rank 1 failed in backward" in r0["again"], r0
    assert r0["again_s"] < 1.0, r0
    # while it waited, rank 0's record said where (what the exit teardown and checkpoints read)
    assert r1["published"] is not None and r1["published"][0] == "0,1", r1
    assert r1["published"][2] == "the test's exchange", r1
