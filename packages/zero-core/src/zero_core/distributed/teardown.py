"""The process group ``init_distributed`` formed, torn down at interpreter exit.

[Note: process group teardown at exit]
Left to interpreter shutdown, gloo's worker threads can still be finishing an op while their
owner is destroyed, and the process dies with SIGABRT ("terminate called without an active
exception") after a run that succeeded - measured in about one of 2-3 four-rank runs at stages
1-3. So at exit the ranks meet, then ``destroy_process_group`` joins the threads while Python
is still intact. Nothing of ours may keep the group alive past ``destroy_process_group``
(``init_distributed``'s record of the world and the watchdog hold it through weak references,
the watchdog drops its Work handles when closed, and a garbage-collection pass frees cycles
afterwards): a group object that survives into interpreter teardown is destroyed there, which
is the abort this avoids (a full fault run with the group still referenced showed 1 abort in 20).

A rank that fails must never wait for a peer at exit (issue 37: a barrier here held a failed
rank for the whole watchdog timeout, and its peers with it). Hence:

* **Failed.** A process ending with an error (see [Note: failed ranks]: an uncaught exception,
  ``zero run``'s shim seeing ``sys.exit(n)``, SIGTERM) skips the meeting. ``destroy_process_group``
  itself waits for any op still in flight (a collective the peers never joined: measured, both
  it and torch's abort blocked until the peer process ended), so it runs on a helper thread for
  at most ``DESTROY_WAIT_S``; if it has not returned by then the process ends with
  ``os._exit(status)`` after the SIGTERM cleanup callbacks (``failures.hard_exit``). A failing
  rank 0 that hosts the store first lingers so its peers can read why (``failures.LINGER_S``).
* **The meeting** is over the store before it is a barrier: each rank sets ``zero_exit/<rank>``
  and waits for every rank's key (checked every 0.1 s at most), bounded by the collective
  timeout.
  Only when all have arrived does it issue the gloo barrier, which then cannot be mismatched
  with a peer's training collective. Between slices it reads the store: a failure recorded by
  a peer ends the wait (nothing of ours is in flight, so the group is destroyed at once), and
  a peer *waiting in a collective on a group with this rank, numbered beyond what this rank
  issued* means this rank left in the middle of the job. Python does not tell an ``atexit``
  hook the exit status, so that is how ``sys.exit(1)`` under plain ``python`` or torchrun is
  told apart from the end of a script: the rank records it as its failure (its peers leave
  that collective naming it) and leaves as a failed rank, with its own exit status.
* Under ``mpiexec`` a failing rank ends with ``os._exit(status)`` after the teardown: mpi4py
  runs ``MPI_Finalize`` after the interpreter, and it waits for every rank.
* A fired watchdog ends the process before this runs (see [Note: collective watchdog]).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from zero_core.comm import failures, peer_state

logger = logging.getLogger(__name__)

DESTROY_WAIT_S = 5.0
_EXIT_KEY = "zero_exit"
_SLICE_S = 1.0


def destroy_at_exit(group_ref: Any) -> None:
    """The ``atexit`` hook ``init_distributed`` registers (see the Note)."""
    try:
        if not dist.is_initialized() or dist.group.WORLD is not group_ref():
            return  # destroyed already, or replaced by someone else's group
        failed = failures.this_process_failed()
        if failed is None and getattr(sys, "last_value", None) is not None:
            failed = failures.record_exception(sys.last_value)  # an excepthook other than ours ran
        if failed is None:
            failed = _meet()
        if failed is not None:
            failures.linger_if_store_host()
        _destroy(failed)
        if failed is not None and _mpi_active():
            # MPI_Finalize, which mpi4py runs after the interpreter, waits for every rank: a
            # failing rank would wait there for its peers (measured: 10 s under mpiexec).
            failures.hard_exit(failed.code)
    except Exception as exc:  # never turn a finished job into a failed exit
        logger.warning("init_distributed: destroying the process group at exit failed: %s", exc)


def _mpi_active() -> bool:
    """Whether mpi4py initialised MPI in this process and has not finalised it."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        return mpi is not None and bool(mpi.Is_initialized()) and not bool(mpi.Is_finalized())
    except Exception:
        return False


def _destroy(failed: failures.FailureRecord | None) -> None:
    """``destroy_process_group`` on a helper thread, bounded; a stuck one ends the process."""
    from zero_core import comm

    done = threading.Event()

    def run() -> None:
        with contextlib.suppress(Exception):
            comm.destroy_process_group()
        done.set()

    threading.Thread(target=run, name="zero-destroy-process-group", daemon=True).start()
    if not done.wait(DESTROY_WAIT_S):
        code = failed.code if failed is not None else 1
        failures.hard_exit(
            code,
            f"[zero] rank {failed.rank if failed else '?'}: the process group still has an op in flight "
            f"at exit (a peer never joined it); ending the process with status {code}",
        )
    # Free what only reference cycles still hold (Work handles, engines) while Python is intact.
    gc.collect()


def _issued() -> dict[str, int]:
    """Collectives this rank issued per group (the watchdog's counts)."""
    from zero_core.comm import watchdog

    wd = watchdog._SLOT.current
    return wd.issued() if wd is not None else {}


def _left_mid_job(store: Any, rank: int, mine: dict[str, int], absent: list[int]) -> str | None:
    """A peer waits in a collective on a group with this rank that this rank never issued: say which."""
    waiting = peer_state.waiting_on(store, rank, mine, absent)
    if not waiting:
        return None
    r, op, seq, members = waiting[0]
    key = ",".join(map(str, members))
    return (
        f"left the job (its script ended or called sys.exit) while {peer_state.describe_waiting(waiting)}; "
        f"rank {rank} issued {mine.get(key, 0)} collectives on that group"
    )


def _arrived(store: Any, keys: list[str]) -> bool:
    """Whether every key is set, checked for up to ``_SLICE_S`` (``check`` polls: a timed-out
    ``store.wait`` prints c10d socket warnings)."""
    end, pause = time.monotonic() + _SLICE_S, 0.005
    while not store.check(keys):
        if time.monotonic() >= end:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.1)
    return True


def _meet() -> failures.FailureRecord | None:
    """Meet the other ranks at exit (see the Note); returns this rank's failure if it left mid-job."""
    from zero_core.comm import watchdog

    store, rank, world = failures.default_store(), dist.get_rank(), dist.get_world_size()
    if world == 1:
        return None
    if store is None:  # no store to meet over: the barrier alone, bounded
        _barrier(watchdog.collective_timeout())
        return None
    mine = _issued()
    keys = [f"{_EXIT_KEY}/{r}" for r in range(world)]
    deadline = time.monotonic() + watchdog.collective_timeout()
    try:
        store.set(keys[rank], json.dumps(mine))
        met = _wait_for_all(store, rank, world, keys, mine, deadline)
    except Exception:  # the store's host has gone: so has a peer, and the barrier would fail
        return None
    if isinstance(met, failures.FailureRecord) or not met:
        return met or None
    _barrier(max(deadline - time.monotonic(), 1.0))
    return None


def _wait_for_all(
    store: Any, rank: int, world: int, keys: list[str], mine: dict[str, int], deadline: float
) -> bool | failures.FailureRecord:
    """True once every rank is at exit; False when a peer failed or the deadline passed; this
    rank's failure record when it left in the middle of the job."""
    while not _arrived(store, keys):
        first = failures.read_first(store)
        if first is not None and first.rank != rank:
            return False  # a peer failed: nothing of ours is in flight, destroy at once
        absent = [r for r in range(world) if r != rank and not store.check([keys[r]])]
        why = _left_mid_job(store, rank, mine, absent)
        if why is not None:
            rec = failures.record(why, code=1)
            print(f"[zero] rank {rank} {why}", file=sys.stderr, flush=True)
            return rec
        if time.monotonic() > deadline:
            logger.warning("init_distributed: ranks %s did not reach the end of the job; not waiting", absent)
            return False
    return True


def _barrier(timeout_s: float) -> None:
    """The gloo barrier once every rank is at exit (bounded; an error means a peer has gone)."""
    with contextlib.suppress(Exception):
        work = dist.barrier(async_op=True)
        work.wait(timedelta(seconds=timeout_s))
