"""Following a failed peer: what the collective watchdog does once another rank has failed.

The records and the reasons are in [Note: failed ranks] (``failures.py``); how a waiting rank
leaves its collective is in [Note: collective watchdog]. This is the watchdog's part of it:
its thread reads the failures of other ranks once per poll, the waiting thread asks which
member of an op's group failed (or ended without a record), and an op no thread can leave by
itself ends the process after a grace.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Sequence
from typing import Any

from zero_core.comm import failures
from zero_core.comm.collective_errors import PeerFailedError
from zero_core.comm.failures import FailureRecord

_HOST = socket.gethostname()
RELEASED = b"\x00zero-released:"  # + the failure record (JSON): a released store wait's key
_ASK_ENDED_AFTER_S = 2.0  # a store wait this old is checked for members ended without a record
_FOLLOW_S = 10.0  # after a peer's failure, how long an op no thread can leave by itself may wait


class FollowsFailedPeers:
    """The failed-peer half of ``CollectiveWatchdog`` (a mixin: it uses the watchdog's store,
    rank, lock, ops in flight and peer records)."""

    failures: dict[int, FailureRecord]
    _failure_seen: float | None
    _store: Any
    rank: int
    _lock: Any
    _inflight: dict[int, Any]

    def failed_member(self, group: tuple[int, ...], *, fresh: bool = False) -> FailureRecord | None:
        """The failure record of a member of ``group`` other than this rank (the one to name),
        from the thread's last poll, or read from the store now when ``fresh``."""
        found = dict(self.failures)
        if fresh and self._store is not None:
            store = self._store
            others = [r for r in group if r != self.rank]
            found.update(failures.bounded(lambda: failures.read_ranks(store, others)) or {})
        return failures.root_failure([rec for r, rec in found.items() if r in group and r != self.rank])

    def _ended_member(self, entry: Any, patience_s: float = 1.0) -> FailureRecord | None:
        """A member of ``entry``'s group whose process ended without a failure record (on this
        host). Asked right after a transport error: a dying process closes its connections
        before the kernel marks it ended, so it is asked again for up to ``patience_s``."""
        records = self._peer_records(entry.group) or {}
        deadline = time.monotonic() + patience_s
        while True:
            for r, rec in sorted(records.items()):
                alive = failures.process_alive(rec.get("host", ""), rec.get("pid", 0))
                if r != self.rank and alive is False:
                    error = failures.ENDED_WITHOUT_RECORD
                    return FailureRecord(rank=r, error=error, host=rec.get("host", ""), pid=rec.get("pid", 0))
            local = [r for r, rec in records.items() if r != self.rank and rec.get("host") == _HOST]
            if not local or time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _release_store_waits(self) -> None:
        """Release the store waits (see [Note: watched store waits]) whose group has a member
        that recorded a failure or, on this host, ended without one: the keys still missing are
        written with ``RELEASED`` and the failure record, so the blocked ``multi_get`` returns at
        once and the waiting thread raises :class:`PeerFailedError` naming it. Other ranks
        waiting for the same keys read the record from the marker (their own thread may not
        have seen the failure yet)."""
        with self._lock:
            entries = [e for e in self._inflight.values() if e.release is not None and e.released is None]
        for e in entries:
            failed = self.failed_member(e.group)
            # a process gone without a record, asked only of a wait that lasts (it reads every
            # member's record: nothing for the waits of a normal step, which take milliseconds)
            if failed is None and time.monotonic() - e.start > _ASK_ENDED_AFTER_S:
                failed = self._ended_member(e, patience_s=0.0)
            if failed is None:
                continue
            e.released = failed
            store, keys = e.release
            with contextlib.suppress(Exception):  # the waiting thread's own client is blocked
                client = store.clone()
                for key in keys:
                    if not client.check([key]):
                        client.set(key, RELEASED + failed.to_json().encode())

    def released_error(self, token: int, values: Sequence[bytes] = ()) -> PeerFailedError | None:
        """The error of a store wait released by this rank's thread or, through a marker among
        ``values``, by another rank's (None: not released)."""
        entry = self._inflight.get(token)
        if entry is None:
            return None
        failed = entry.released
        for value in values if failed is None else ():
            if value.startswith(RELEASED):
                failed = FailureRecord.from_json(value[len(RELEASED) :])
                if failed is not None:
                    break
        if failed is None:
            return None
        return PeerFailedError(self._peer_failed_message(entry, failed), _root_rank(failed))

    def _peer_failed_message(self, entry: Any, failed: FailureRecord) -> str:
        msg = f"rank {self.rank}: collective {entry.describe()} cannot complete: {failed.describe()}."
        root = self.failures.get(failed.cause) if failed.cause is not None else None
        if root is not None:
            msg += f" ({root.describe()}.)"
        return msg

    def _poll_failures(self) -> None:
        """Read the failures of other ranks: the first-failure key each poll, then the records of
        the ranks this rank waits on (see [Note: failed ranks])."""
        store = self._store
        if store is None:
            return
        try:
            if self._failure_seen is None:
                first = failures.read_first(store)
                if first is None or first.rank == self.rank:
                    return
                self._failure_seen = time.monotonic()
                self.failures = {**self.failures, first.rank: first}
            with self._lock:
                members = {r for e in self._inflight.values() for r in e.group} - {self.rank}
            wanted = sorted(members - set(self.failures))
            if wanted:
                self.failures = {**self.failures, **failures.read_ranks(store, wanted)}
        except Exception:  # the store's host is gone: the transport tells the waiting thread
            self._store = None

    def _follow_failure(self) -> None:
        """End the process when an op no thread will leave by itself (object collectives, NCCL's
        stream-ordered ops) waits on a failed rank for ``grace_s`` after the failure was seen."""
        now = time.monotonic()
        if self._failure_seen is None or now - self._failure_seen < self.grace_s:
            return
        with self._lock:
            entries = list(self._inflight.values())
        for e in entries:
            if e.waiting or (e.work is not None and _completed(e.work)):
                continue
            # The thread waiting on a gloo op leaves when the failed process ends (its connections
            # close); give that longer, but not unbounded.
            if not (e.blocking or self.stream_ordered()) and now - self._failure_seen < _FOLLOW_S:
                continue
            failed = self.failed_member(e.group)
            if failed is not None:
                msg = self._peer_failed_message(e, failed)
                _die(f"[zero] rank {self.rank}: ending this process: {msg}", msg, _root_rank(failed))


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:
        return True


def _die(message: str | None, error: str = "", cause: int | None = None) -> None:
    """End the process (status 1) after the SIGTERM cleanup callbacks: see ``failures.hard_exit``.
    ``error`` (default: the message) is recorded as this rank's failure, ``cause`` the rank it followed."""
    with contextlib.suppress(Exception):
        text = error or (message or "").split("ending this process: ", 1)[-1] or "collective watchdog fired"
        failures.record(f"CollectiveTimeoutError: {text}", code=1, cause=cause)
    failures.hard_exit(1, message)


def _root_rank(failed: FailureRecord) -> int:
    return failed.cause if failed.cause is not None else failed.rank
