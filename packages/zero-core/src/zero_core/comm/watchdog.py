"""``CollectiveWatchdog``: every blocking collective of the library has a deadline and a culprit.

[Note: collective watchdog]
A rank that never joins a collective (stuck in a data loader, dead, or on another code path)
used to be found only by the process group's own timeout (30 minutes by default) with a
message naming no rank, and a rank whose collective had timed out could then hang at exit
while torch tore down the group under an op that would never finish. The watchdog bounds
every collective issued through ``zero_core.comm`` and names the missing ranks:

* **Deadline.** Synchronous collectives are issued asynchronously and waited on with the
  watchdog's timeout (``Work.wait`` of gloo honours it and raises); ``zero_core.comm.Work``
  waits with the same deadline when its caller gives none. Either failure becomes a
  :class:`CollectiveTimeoutError`. On NCCL the wait is given *no* timeout: there
  ``Work.wait(timeout)`` blocks the host until the op has finished on the GPU (a host sync per
  collective, which would stop the host from queuing compute behind the communication; see
  [Note: stage-3 streams]), while ``Work.wait()`` only makes the current stream wait. Such ops,
  and ops that cannot be issued asynchronously (object collectives, send/recv), are covered by
  the watchdog's thread, which polls what is in flight (``is_completed``, no sync); if an op is
  still pending ``timeout + grace`` seconds after it was issued, the thread prints the same
  diagnosis and ends the process (status 1), as NCCL's own watchdog does.
* **Culprit.** Each rank counts the collectives it issued per group. The thread publishes
  those counts, the op it is in and the last module/parameter it was told about
  (:meth:`CollectiveWatchdog.note`) to the process group's store every ``poll`` seconds. On a
  timeout the waiting rank reads its peers' records: a peer whose count for the group is below
  this rank's did not arrive (it is named with what it was last doing); a peer whose record
  stopped changing for many polls is named as not responding.
* **Exit.** A fired watchdog writes an abort record to the store; the peers' threads read it
  and end their processes too (a stalled peer otherwise sleeps on). At interpreter exit a
  fired watchdog ends the process with status 1 before torch destroys the process group, so
  nothing waits on the op that never finished.
* **Failed peers.** The timeout is for true hangs, where no process has ended. A rank that
  ends with an error leaves a record in the store (see [Note: failed ranks] in
  ``failures.py``), which the thread checks once per poll. The waiting thread therefore waits
  on torch's collectives in slices of one poll (``Work.wait(slice)``: the first slice costs
  what one wait costs, so nothing is added per collective) and, between slices, leaves an op
  whose group has a failed member with :class:`PeerFailedError` naming that rank, its error
  and where it was; the slices also let a SIGTERM handler run within a poll. Point-to-point
  ops, and the gloo direct collectives made of them, are waited on once with the whole
  deadline: a gloo recv whose timed wait expires breaks its connection. They end with the
  transport's error when the failed process ends (a failing process always ends promptly:
  see [Note: process group teardown at exit]), which is explained from the same records. An
  op no thread can leave by itself (object collectives, NCCL's stream-ordered waits; the
  point-to-point ones after ``_FOLLOW_S``) is ended by the thread ``grace_s`` after it saw
  the failure: it prints the same message and ends the process, after the SIGTERM cleanup
  callbacks (swap files, a save's staging directory). A rank gone without a record (SIGKILL,
  the OOM killer) is named as the one whose "process has ended" when it ran on this host,
  else as the one that did not arrive. Such errors do not fire the watchdog: every peer sees
  the record itself. Each record also tells which op a rank is waiting in (``wait``), for the
  exit teardown and the checkpoint agreements, which name a rank waiting elsewhere.

The timeout comes from ``comms_timeout`` in the config (seconds; ``initialize`` applies it),
else the ``ZERO_COLLECTIVE_TIMEOUT`` environment variable, else the ``timeout`` given to
``init_distributed`` explicitly, else 300 s. The stage-3 collective timeout
(``ZERO_STAGE3_COLLECTIVE_TIMEOUT``, ``set_collective_timeout``) is the same setting.
One watchdog exists per default process group (:func:`get_watchdog` starts it on first use);
:meth:`CollectiveWatchdog.close` ends its thread (``destroy_process_group`` does).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist

from zero_core.comm import failures, peer_state
from zero_core.comm.collective_errors import CollectiveTimeoutError, PeerFailedError
from zero_core.comm.failures import FailureRecord
from zero_core.comm.peer_failures import _HOST, FollowsFailedPeers, _completed, _die, _root_rank

DEFAULT_TIMEOUT_S = 300.0
ENV_TIMEOUT = "ZERO_COLLECTIVE_TIMEOUT"
_KEY = peer_state.RECORD_KEY
_STALE_POLLS = 20  # a peer record unchanged this many polls (while we wait) counts as not responding


def timeout_from_env() -> float | None:
    """``ZERO_COLLECTIVE_TIMEOUT`` (or the older ``ZERO_STAGE3_COLLECTIVE_TIMEOUT``) in seconds."""
    for name in (ENV_TIMEOUT, "ZERO_STAGE3_COLLECTIVE_TIMEOUT"):
        raw = os.environ.get(name, "").strip()
        if not raw:
            continue
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{name} must be a positive number of seconds, got {raw!r}") from None
        if not value > 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {raw!r}")
        return value
    return None


def check_timeout(seconds: Any, where: str) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(
            f"{where}: the collective timeout must be a positive number of seconds, got {seconds!r}"
        )
    return float(seconds)


class _InFlight:
    __slots__ = (
        "op",
        "group",
        "seq",
        "start",
        "work",
        "reported",
        "waiting",
        "blocking",
        "release",
        "released",
    )

    def __init__(self, op: str, group: tuple[int, ...], seq: int, work: Any, blocking: bool = False) -> None:
        self.op, self.group, self.seq, self.work = op, group, seq, work
        self.start = time.monotonic()
        self.reported = False
        self.waiting = False  # the issuing thread waits on it in slices (it raises by itself)
        self.blocking = blocking  # issued synchronously, not waitable: only the thread can end it
        self.release: tuple[Any, list[str]] | None = None  # a store wait: its store and keys
        self.released: FailureRecord | None = None  # the failure the thread released it for

    def describe(self) -> str:
        return f"{self.op} (#{self.seq} on the group of global ranks {list(self.group)})"


class CollectiveWatchdog(FollowsFailedPeers):
    """Deadlines and diagnosis for the collectives of one process group. See [Note: collective watchdog]."""

    def __init__(self, timeout_s: float, *, store: Any = None, rank: int = 0, pg: Any = None) -> None:
        self.timeout_s = check_timeout(timeout_s, "CollectiveWatchdog")
        self.rank = rank
        # Weakly: a watchdog kept alive by atexit or a Work must not keep the process group
        # alive past destroy_process_group (see [Note: process group teardown at exit]).
        self._pg = weakref.ref(pg) if pg is not None else None
        self.fired: str | None = None
        self._store = store
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._inflight: dict[int, _InFlight] = {}
        self._seq: dict[str, int] = {}
        self._label = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._published = ""
        self._stream_ordered: bool | None = None
        # Failures of other ranks read from the store by the thread (see [Note: failed ranks]).
        self.failures: dict[int, FailureRecord] = {}
        self._failure_seen: float | None = None

    # -- configuration -------------------------------------------------------------------
    @property
    def pg(self) -> Any:
        """The process group watched (None once it is gone)."""
        return self._pg() if self._pg is not None else None

    @property
    def poll_s(self) -> float:
        return min(1.0, max(0.05, self.timeout_s / 20))

    @property
    def grace_s(self) -> float:
        """How long after the deadline the thread lets the waiting thread raise before ending the process."""
        return max(2.0, 0.1 * self.timeout_s)

    def set_timeout(self, seconds: float) -> None:
        self.timeout_s = check_timeout(seconds, "set_timeout")

    def stream_ordered(self) -> bool:
        """Whether the watched group's backend is NCCL, whose ``Work.wait`` only orders the
        current stream unless given a timeout (then it blocks the host)."""
        if self._stream_ordered is None:
            try:
                backend = str(dist.get_backend(self.pg))
            except Exception:  # no group (unit tests) or one torch does not know
                backend = ""
            self._stream_ordered = "nccl" in backend.lower()
        return self._stream_ordered

    def issued(self) -> dict[str, int]:
        """How many collectives this rank issued per group (keyed by its global ranks, comma-joined)."""
        with self._lock:
            return dict(self._seq)

    def note(self, label: str) -> None:
        """Remember what the library is working on (module, parameter), for the diagnosis."""
        self._label = label

    # -- bracketing ops ------------------------------------------------------------------
    def begin(self, op: str, group: tuple[int, ...], work: Any = None, *, blocking: bool = False) -> int:
        key = _group_key(group)
        with self._lock:
            seq = self._seq.get(key, 0) + 1
            self._seq[key] = seq
            token = next(self._ids)
            self._inflight[token] = _InFlight(op, group, seq, work, blocking)
        return token

    def begin_wait(
        self, op: str, group: tuple[int, ...], store: Any, keys: list[str], seq: int | None = None
    ) -> int:
        """Bracket a wait for ``keys`` in ``store`` that is part of collective ``seq`` on ``group``
        (default: the next one), without counting a collective: the store wait of a stage-3
        agreement before its data collective. It is published as the op this rank waits in,
        diagnosed at the deadline by the thread, and released by the thread when a member of
        ``group`` fails (See [Note: watched store waits])."""
        with self._lock:
            number = self._seq.get(_group_key(group), 0) + 1 if seq is None else seq
            token = next(self._ids)
            entry = _InFlight(op, group, number, None)
            entry.waiting, entry.release = True, (store, list(keys))
            self._inflight[token] = entry
        return token

    def started(self, token: int) -> float:
        """When the op of ``token`` began (``time.monotonic``; now if it is not in flight)."""
        entry = self._inflight.get(token)
        return time.monotonic() if entry is None else entry.start

    def next_seq(self, group: tuple[int, ...]) -> int:
        """The number the next collective on ``group`` will get."""
        with self._lock:
            return self._seq.get(_group_key(group), 0) + 1

    def end(self, token: int) -> None:
        with self._lock:
            self._inflight.pop(token, None)

    @contextlib.contextmanager
    def watch(self, op: str, group: tuple[int, ...]) -> Iterator[None]:
        token = self.begin(op, group, blocking=True)
        try:
            yield
        except Exception as exc:  # the op failed (a peer failed, or its watchdog ended it): say why
            if self.fired:
                raise CollectiveTimeoutError(self.fired) from exc
            self._raise_for(token, exc)
        finally:
            self.end(token)

    def remaining(self, token: int) -> timedelta:
        entry = self._inflight.get(token)
        left = self.timeout_s if entry is None else self.timeout_s - (time.monotonic() - entry.start)
        return timedelta(seconds=max(left, 0.001))

    def wait(self, work: Any, token: int, timeout: timedelta | None = None) -> None:
        """Wait for ``work`` (a torch Work) until the deadline (or ``timeout``); raise the diagnosis on failure.

        On NCCL the current stream waits and the host does not (see the Note); the op stays in
        flight for the thread until it completes on the device. Elsewhere the wait goes in
        slices of one poll, leaving early when a member of the op's group has failed.
        """
        if self.stream_ordered():
            entry = self._inflight.get(token)
            if entry is not None:
                entry.work = work
            try:
                work.wait()
            except Exception as exc:
                try:
                    self._raise_for(token, exc)
                finally:
                    self.end(token)
            return
        try:
            self._wait_in_slices(work, token, timeout)
        finally:
            self.end(token)

    def _wait_in_slices(self, work: Any, token: int, timeout: timedelta | None) -> None:
        entry = self._inflight.get(token)
        total = self.remaining(token) if timeout is None else timeout
        sliced = _resumable(work, entry)
        if entry is not None:
            entry.work, entry.waiting = work, sliced
        if not sliced:
            start = time.monotonic()
            try:
                work.wait(total)
                return
            except Exception as exc:
                self._raise_for(token, exc, time.monotonic() - start >= 0.9 * total.total_seconds())
        deadline = time.monotonic() + total.total_seconds()
        while True:
            start = time.monotonic()
            step = max(min(deadline - start, self.poll_s), 0.001)
            try:
                work.wait(timedelta(seconds=step))
                return
            except Exception as exc:
                now = time.monotonic()
                # The backend's own error (it came before the slice ended, or the op is over), or the deadline.
                if now >= deadline or now - start < 0.9 * step or _completed(work):
                    self._raise_for(token, exc, now >= deadline)
                if entry is not None and (failed := self.failed_member(entry.group)) is not None:
                    raise PeerFailedError(
                        self._peer_failed_message(entry, failed), _root_rank(failed)
                    ) from None

    def raise_for(self, token: int, cause: BaseException, timed_out: bool = False) -> NoReturn:
        """Raise the error of the op of ``token`` that failed with ``cause`` (see ``_raise_for``)."""
        self._raise_for(token, cause, timed_out)

    def _raise_for(self, token: int, cause: BaseException, timed_out: bool = False) -> NoReturn:
        """Raise the error of the failed op ``token``: PeerFailedError when a member of its group
        recorded a failure (read now: the thread may not have polled yet) or, when the backend
        failed before the deadline, ended without one; else the diagnosis. At the deadline a
        member that is gone was ended by the watchdog itself (a true hang), not a failure."""
        entry = self._inflight.get(token)
        failed = None
        if entry is not None:
            failed = self.failed_member(entry.group, fresh=True)
            if failed is None and not timed_out and self.fired is None:
                failed = self._ended_member(entry)
        if entry is not None and failed is not None:
            msg = self._peer_failed_message(entry, failed)
            if failed.error == failures.ENDED_WITHOUT_RECORD:  # the transport's word is all there is
                msg += f" Backend said: {cause}"
            raise PeerFailedError(msg, _root_rank(failed)) from cause
        raise CollectiveTimeoutError(self.fired or self.diagnose(token, cause=cause)) from cause

    # -- diagnosis -----------------------------------------------------------------------
    def diagnose(self, token: int, cause: BaseException | None = None) -> str:
        """The message for the op of ``token`` that failed or ran out of time; marks the watchdog fired."""
        entry = self._inflight.get(token)
        if entry is None:
            msg = f"rank {self.rank}: a collective failed: {cause}"
        else:
            waited = time.monotonic() - entry.start
            how = (
                f"failed after {waited:.1f} s"  # the backend's own error, before the deadline
                if cause is not None and waited < 0.9 * self.timeout_s
                else f"did not complete: waited {waited:.1f} s"
            )
            msg = (
                f"rank {self.rank}: collective {entry.describe()} {how} (timeout {self.timeout_s:g} s, "
                f"set by the config's comms_timeout, {ENV_TIMEOUT} or init_distributed(timeout=)). "
                f"{self._missing(entry)}"
            )
            if self._label:
                msg += f" Last module/parameter on rank {self.rank}: {self._label}."
            if cause is not None:
                msg += f" Backend said: {cause}"
        self._fire(msg)
        return msg

    def _missing(self, entry: _InFlight) -> str:
        records = self._peer_records(entry.group)
        if records is None:
            return "Which rank is missing is unknown (no store to ask)."
        key = _group_key(entry.group)
        absent, silent = [], []
        for r in entry.group:
            if r == self.rank:
                continue
            rec = records.get(r)
            if rec is None:
                silent.append(f"rank {r} (no record: not started or dead)")
                continue
            seq = rec.get("seq", {}).get(key, 0)
            gone = (
                "; its process has ended"
                if failures.process_alive(rec.get("host", ""), rec.get("pid", 0)) is False
                else ""
            )
            if seq < entry.seq:
                doing = f"in {rec['op']}" if rec.get("op") else "outside any collective"
                where = f", last module/parameter {rec['label']}" if rec.get("label") else ""
                absent.append(
                    f"rank {r} (issued {seq} of {entry.seq} collectives on this group, now {doing}{where}{gone})"
                )
            elif gone:
                silent.append(f"rank {r} (arrived{gone})")
            elif time.time() - rec.get("t", 0) > _STALE_POLLS * self.poll_s + self.timeout_s:
                silent.append(f"rank {r} (arrived, then stopped responding)")
        if not absent and not silent:
            return "Every rank of the group reports having issued it (a backend or network failure?)."
        return "Rank(s) that did not arrive: " + "; ".join(absent + silent) + "."

    def _peer_records(self, group: tuple[int, ...]) -> dict[int, dict[str, Any]] | None:
        if self._store is None:
            return None
        self._publish(force=True)
        try:
            return peer_state.peer_records(self._store, group)
        except Exception:  # a dead store host: report what we have
            return {}

    def _fire(self, msg: str) -> None:
        if self.fired is None:
            self.fired = msg
            if self._store is not None:
                try:
                    self._store.set(f"{_KEY}/abort", json.dumps({"rank": self.rank, "msg": msg}))
                except Exception:
                    return
                # This process may host the store and exit right after raising: give the
                # peers' threads a few polls to read the abort record first.
                if failures.hosts_store(self.rank):
                    time.sleep(min(2.0, 3 * self.poll_s))

    # -- the thread ----------------------------------------------------------------------
    def start(self) -> CollectiveWatchdog:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="zero-collective-watchdog", daemon=True)
            self._thread.start()
            atexit.register(self._at_exit)
        return self

    def close(self) -> None:
        """Stop the thread (idempotent); a fired watchdog still ends the process at exit."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            self._inflight.clear()  # drop the Work handles, so nothing outlives the group
        self._store = None

    def _publish(self, force: bool = False) -> None:
        if self._store is None:
            return
        with self._lock:
            entries = list(self._inflight.values())
            first = entries[0] if entries else None
            record: dict[str, Any] = {
                "seq": dict(self._seq),
                "op": first.op if first else "",
                "label": self._label,
            }
            # the op this rank waits in: group and number (exit teardown and checkpoint agreements read it)
            record["wait"] = [_group_key(first.group), first.seq, first.op] if first else None
        text = json.dumps(record, sort_keys=True)
        if text == self._published and not force:
            return
        record.update(t=time.time(), host=_HOST, pid=os.getpid())
        try:
            self._store.set(f"{_KEY}/{self.rank}", json.dumps(record))
            self._published = text
        except Exception:  # the store's host is gone (the end of a job): stop asking it
            self._store = None

    def _peer_abort(self) -> str | None:
        if self._store is None:
            return None
        try:
            if self._store.check([f"{_KEY}/abort"]):
                rec = json.loads(self._store.get(f"{_KEY}/abort").decode())
                if rec.get("rank") != self.rank:
                    return f"rank {rec.get('rank')}'s collective watchdog fired: {rec.get('msg')}"
        except Exception:
            self._store = None
        return None

    def _overdue(self) -> tuple[int, _InFlight] | None:
        now = time.monotonic()
        with self._lock:
            for token, e in list(self._inflight.items()):
                if e.work is not None and _completed(e.work):
                    self._inflight.pop(token, None)
                # a store wait raises by itself at the deadline: see [Note: watched store waits]
                elif now - e.start > self.timeout_s + (self.poll_s if e.release is not None else 0.0):
                    return token, e
        return None

    def _run(self) -> None:
        # host and pid in the store from the start: a peer killed before this thread's first poll
        # is still found ended (``_ended_member`` reads them), not reported as never started
        self._publish(force=True)
        while not self._stop.wait(self.poll_s):
            self._publish()
            peer = self._peer_abort()
            if peer is not None:
                _die(f"[zero] rank {self.rank}: ending this process: {peer}")
            self._poll_failures()
            self._release_store_waits()
            self._follow_failure()
            overdue = self._overdue()
            if overdue is None:
                continue
            token, entry = overdue
            if not entry.reported:
                # Name the culprit and tell the peers now, unless the waiting thread already did.
                entry.reported = True
                if self.fired is None:
                    msg = self.diagnose(token)
                    print(f"[zero] CollectiveTimeoutError: {msg}", file=sys.stderr, flush=True)
            elif time.monotonic() - entry.start > self.timeout_s + self.grace_s:
                _die(f"[zero] rank {self.rank}: ending this process: the collective above is still pending")

    def _at_exit(self) -> None:
        if self.fired is not None:
            # Do not let torch tear down a process group with an op that will never finish.
            time.sleep(min(2.0, 4 * self.poll_s))
            _die(None, self.fired)
        self.close()


#: point-to-point ops: on gloo, a recv whose timed wait expires breaks its connection
#: ("Application timeout caused pair closure"), so they are waited on once, with the deadline
_P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv"})


def _resumable(work: Any, entry: _InFlight | None) -> bool:
    """Whether a timed-out ``wait`` of ``work`` leaves it intact, so it can be waited on in
    slices: torch's collective Works, not point-to-point ones nor the gloo direct collectives
    (made of them; see [Note: gloo direct collectives])."""
    return getattr(work, "resumable_wait", True) and (entry is None or entry.op not in _P2P_OPS)


def _group_key(group: tuple[int, ...]) -> str:
    return ",".join(map(str, group))


@dataclasses.dataclass
class _WatchdogSlot:
    """The watchdog of the current default process group (one per group, like torch's default
    group) and the timeout ``set_collective_timeout`` asked for before it started."""

    current: CollectiveWatchdog | None = None
    pending_timeout: float | None = None
    init_timeout: float | None = None  # given to init_distributed explicitly


_SLOT = _WatchdogSlot()


def get_watchdog() -> CollectiveWatchdog | None:
    """The running watchdog of the default process group (started on first use), or None when
    torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    wd = _SLOT.current
    pg = dist.group.WORLD
    if wd is not None and wd.pg is pg and pg is not None:
        return wd
    if wd is not None:
        wd.close()
    store = None
    with contextlib.suppress(Exception):
        store = dist.distributed_c10d._get_default_store()
    wd = CollectiveWatchdog(_resolved_timeout(), store=store, rank=dist.get_rank(), pg=pg).start()
    _SLOT.current = wd
    failures.install()  # a process ending with an error says so: See [Note: failed ranks]
    return wd


def _resolved_timeout() -> float:
    """comms_timeout / set_collective_timeout, else the environment, else init_distributed's, else 300 s."""
    return _SLOT.pending_timeout or timeout_from_env() or _SLOT.init_timeout or DEFAULT_TIMEOUT_S


def set_init_timeout(seconds: float) -> None:
    """The timeout given to ``init_distributed`` explicitly: it bounds collectives unless the
    config's ``comms_timeout`` or the environment says otherwise (see [Note: collective watchdog])."""
    _SLOT.init_timeout = check_timeout(seconds, "init_distributed")
    if _SLOT.current is not None:
        _SLOT.current.set_timeout(_resolved_timeout())


def set_collective_timeout(seconds: float) -> None:
    """Bound every collective of the library to ``seconds`` (see [Note: collective watchdog])."""
    seconds = check_timeout(seconds, "set_collective_timeout")
    _SLOT.pending_timeout = seconds
    if _SLOT.current is not None:
        _SLOT.current.set_timeout(seconds)


def collective_timeout() -> float:
    """The timeout in force, in seconds."""
    if _SLOT.current is not None:
        return _SLOT.current.timeout_s
    return _resolved_timeout()


def close_watchdog() -> None:
    """Stop the current watchdog's thread (before the process group is destroyed)."""
    wd, _SLOT.current = _SLOT.current, None
    if wd is not None:
        wd.close()
