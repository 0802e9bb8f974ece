"""Waiting for the peers' keys in the store as a collective waits: bounded, named, left early.

[Note: watched store waits]
Some exchanges between ranks go through the process group's store instead of a collective
(the stage-3 agreement's headers: see [Note: stage 3 collective agreement]). A plain
``store.multi_get`` blocks until the store's own timeout and then says only which key is
missing; a peer that failed, or died without a word, costs the whole timeout, and a peer that
hangs is not named, nor do the other ranks end. So a wait for peers' keys is treated as part
of the collective it precedes:

* it is bracketed in the collective watchdog (``CollectiveWatchdog.begin_wait``: numbered as
  the next collective on its group, not counted as one), so the watchdog's record says this
  rank waits there (what the exit teardown and the checkpoint agreements read), and its
  thread's deadline covers it as any op in flight;
* it is one ``multi_get`` with the whole deadline (no polling, nothing added to the fast
  path). When a member of the group records a failure or, on this host, ends without one
  (see [Note: failed ranks]), the watchdog's thread, which checks that once per poll, writes
  the keys still missing with a marker (``peer_failures.RELEASED`` and the failure record):
  the wait returns within about a poll and raises :class:`PeerFailedError` naming that rank;
  every other rank waiting for the same keys is released by the same marker. (Slices of a short store
  timeout would do it too, but every timed-out store wait logs a c10d socket warning.)
* at the deadline the error is the watchdog's diagnosis (the collective, the ranks that did
  not arrive and what they are doing) and the watchdog fires: the abort record ends the peers'
  processes, as for a collective that never completed (see [Note: collective watchdog]).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from zero_core.comm import watchdog as _watchdog
from zero_core.comm.collective_errors import CollectiveTimeoutError
from zero_core.comm.peer_failures import RELEASED


def wait_for_keys(
    store: Any, keys: list[str], group: tuple[int, ...], op: str, seq: int | None = None
) -> list[bytes]:
    """The values of ``keys`` once every one is in ``store``; the wait belongs to collective
    ``seq`` (default: the next) on the group of global ranks ``group`` and is named ``op``.

    Raises ``PeerFailedError`` when a member of ``group`` failed, ``CollectiveTimeoutError``
    (the watchdog's diagnosis) at the collective timeout. See [Note: watched store waits].
    """
    timeout = _watchdog.collective_timeout()
    store.set_timeout(timedelta(seconds=timeout))
    wd = _watchdog.get_watchdog()
    if wd is None:  # no process group to watch (a store used on its own)
        return store.multi_get(keys)
    token = wd.begin_wait(op, group, store, keys, seq)
    try:
        try:
            values = store.multi_get(keys)
        except Exception as exc:
            released = wd.released_error(token)
            if released is not None:
                raise released from None
            if wd.fired:  # the thread reached the deadline first (or another op fired it)
                raise CollectiveTimeoutError(wd.fired) from None
            # before the deadline the store itself failed (its host ended): a failed member is named
            wd.raise_for(token, exc, timed_out=time.monotonic() - wd.started(token) >= 0.9 * timeout)
        if any(v.startswith(RELEASED) for v in values):
            released = wd.released_error(token, values)
            if released is not None:
                raise released
            raise CollectiveTimeoutError(
                f"rank {wd.rank}: {op}: released by a peer that saw a member of the group fail "
                "(its failure record could not be read)"
            )
        return values
    finally:
        wd.end(token)
