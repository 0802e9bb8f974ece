"""Ranks about to run different stage-3 collectives get a named error, with no device read.

[Note: stage 3 collective agreement]
Gloo aborts the process on a collective whose sizes differ across ranks (an uncatchable
``gloo::EnforceNotMet`` in its transport thread), every backend hangs on a collective that one
rank skipped, and a same-sized collective over different parameters silently mixes them. Ranks
diverge when data-dependent control flow differs (see [Note: stage 3 parameter coordinator]).
So before each stage-3 data collective (a gathered bucket, a gradient bucket, a broadcast,
an all-reduce fetch) every rank states a *header*: kind, first parameter id, parameter count,
payload bytes, numbered per process group; the ranks compare headers of the same number, and
a difference is a :class:`Stage3CollectiveError` naming what each rank was about to run.

The headers are host integers, so they travel as bytes through the process group's store
(through clones of its client, one per thread: the TCP store serialises the operations of one
client, and a blocked read here must never stall the collective watchdog's thread, which uses
the original): no tensor, no device read, nothing for ``zero_core.testing.host_syncs`` to
count. One exchange is three store round trips (post mine, drop my key of two exchanges ago,
read the peers'), about 0.15 ms on one host, against about 0.7 ms for the 32-byte gloo
all-gather of the headers this replaced (300 of each, 2 ranks of the loaded 2-core development
machine). Dropping key ``seq - 2`` is safe because a rank posts ``seq`` only after it has read
every peer's ``seq - 1``, which each peer posted only after reading everyone's ``seq - 2``.

When the comparison happens depends on the backend (mode ``True``, the default):

* **host backends (gloo)**: before the data collective is launched. A mismatch there would
  abort the process, and a gloo collective blocks the host anyway.
* **stream-ordered backends (NCCL)**: on a side thread, while the host goes on queuing work;
  nothing waits for it inside a micro-step. Its verdict (a Python attribute) is read at every
  later stage-3 collective, and the accumulation boundary (the strategy's ``after_backward``)
  waits for every header posted so far to be compared: ranks that disagree get the named error
  there at the latest, before the optimizer step applies anything. A mismatched collective
  meanwhile stalls only the device stream, and every later stage-3 wait raises the verdict
  instead of waiting. A host blocked behind it elsewhere (a host read of a result) is ended by
  the collective watchdog's deadline, whose diagnosis then names the disagreement (the verdict
  is noted to the watchdog); a failed or timed-out stage-3 wait reports the verdict too
  (:func:`wait_bounded`).

``set_collective_checks`` / ``ZERO_STAGE3_COLLECTIVE_CHECKS`` select the mode: ``True``/``1``
(the above), ``"deferred"`` (the side thread on every backend: NCCL's behaviour, testable on
gloo with divergences that keep sizes, since a size mismatch aborts gloo before the verdict),
``"collective"`` (the debug switch: a 32-byte all-gather of the headers on the backend's device
before each collective, compared on the host, so one host sync per collective; it needs no
store), ``False``/``0`` (off). Every wait is bounded by the collective watchdog's timeout
(``collective_timeout``). The read of the peers' headers is a watched store wait (see [Note:
watched store waits] in ``zero_core.comm.store_wait``): part of the data collective it
precedes for the watchdog, left with ``PeerFailedError`` when a rank failed, and at the
deadline the watchdog's diagnosis naming the rank that did not arrive, every process ending.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from zero_core import comm
from zero_core.comm import watchdog as _watchdog
from zero_core.comm.collective_errors import CollectiveTimeoutError, PeerFailedError
from zero_core.comm.store_wait import wait_for_keys
from zero_core.zero.stage3.param_records import RECORDS_BY_ID as _BY_ID
from zero_core.zero.stage3.runtime_context import stage3_context

KINDS = {0: "all-gather", 1: "reduce-scatter", 2: "broadcast", 3: "all-reduce fetch"}
MODES = (True, False, "deferred", "collective")
_ENV = "ZERO_STAGE3_COLLECTIVE_CHECKS"
_KEY = "zero_s3agree"

Header = tuple[int, int, int, int]  # kind, first parameter id, parameter count, payload bytes


class Stage3CollectiveError(RuntimeError):
    """Ranks disagreed on (or did not join) a stage-3 collective."""


def set_collective_checks(mode: bool | str) -> None:
    """Select the agreement check of [Note: stage 3 collective agreement] (process-wide):
    ``True`` (default), ``"deferred"``, ``"collective"`` (debug) or ``False`` (off)."""
    if not (isinstance(mode, bool) or (isinstance(mode, str) and mode in MODES)):
        raise TypeError(
            f"set_collective_checks: mode must be a bool, 'deferred' or 'collective', got {mode!r}"
        )
    stage3_context().collective_checks = mode


def collective_check_mode() -> bool | str:
    """The mode in force: :func:`set_collective_checks`' value, else ``ZERO_STAGE3_COLLECTIVE_CHECKS``."""
    mode = stage3_context().collective_checks
    if mode is not None:
        return mode
    env = os.environ.get(_ENV, "1").strip().lower()
    if env in ("deferred", "collective"):
        return env
    if env not in ("0", "1", "true", "false", "yes", "no", "on", "off", ""):
        raise ValueError(f"{_ENV} must be 0, 1, deferred or collective, got {env!r}")
    return env not in ("0", "false", "no", "off")


def collective_checks() -> bool:
    """Whether any agreement check is on."""
    return collective_check_mode() is not False


def collective_timeout() -> float:
    return _watchdog.collective_timeout()


def _name(pid: int) -> str:
    return stage3_context().param_names.get(pid, f"param#{pid}")


def describe(header: Sequence[int]) -> str:
    """``all-gather of ['a.weight', 'a.bias'] (80 bytes)``: a header in words."""
    kind, pid, count, size = (int(x) for x in header)
    names = [_name(pid + i) for i in range(min(count, 4))]
    more = f" and {count - 4} more" if count > 4 else ""
    return f"{KINDS.get(kind, kind)} of {names}{more} ({size} bytes)"


def mismatch_error(
    rows: Sequence[Sequence[int] | None], ranks: Sequence[int], me: int, what: str, seq: int | None = None
) -> str:
    """The message naming what each rank of the group (global ``ranks``, row by row) was about to
    run; ``me`` is this process's global rank."""
    number = f" (#{seq} on its group)" if seq is not None else ""
    lines = [f"  rank {r}: {describe(h) if h is not None else '(no header)'}" for r, h in zip(ranks, rows)]
    return (
        f"ZeRO stage 3: ranks disagree on the next collective{number} (this is rank {me}, running {what}).\n"
        + "\n".join(lines)
        + "\nEvery rank must run the same modules in the same order (data-dependent control flow must agree)."
        + _leaf_hint([_name(int(h[1])) for h in rows if h is not None and int(h[2]) > 0])
    )


def _leaf_hint(names: list[str]) -> str:
    """What to mark when ranks ran different submodules: See [Note: z3 leaf modules]."""
    parts = [n.split(".")[:-1] for n in names]  # module paths of each rank's first parameter
    common: list[str] = []
    for level in zip(*parts) if parts else ():
        if len(set(level)) != 1:
            break
        common.append(level[0])
    where = f" inside '{'.'.join(common)}'" if common else ""
    return (
        f"\nThe ranks ran different submodules{where}. A block whose forward picks submodules by its "
        "data (a mixture-of-experts layer routing tokens to experts) must be marked a ZeRO-3 leaf "
        "module before initialize: zero.utils.set_z3_leaf_modules(model, [BlockClass]) gathers it "
        "whole and reduces its gradients as one unit."
    )


class StoreAgreement:
    """Header exchanges through the store, inline or on a side thread; see the Note above."""

    def __init__(self, store: Any) -> None:
        self.store = store  # the main thread's client; the side thread clones its own
        self._seq: dict[tuple[int, ...], int] = {}
        self._pending: deque[tuple[tuple[int, ...], int, int, Header, str, int | None]] = deque()
        self._cond = threading.Condition()
        self._posted = 0
        self._done = 0
        self._thread: threading.Thread | None = None
        self.error: str | None = None  # the first disagreement found (kept: later ones follow from it)
        self.peer_failed: PeerFailedError | None = None  # the side thread's wait left for a failed peer

    def check(self, ranks: tuple[int, ...], me: int, header: Header, what: str, inline: bool) -> None:
        """Number ``header`` on the group of global ``ranks`` and compare it with the peers'
        (``inline``: now); ``me`` is this process's global rank."""
        self.raise_if_failed()
        seq = self._seq.get(ranks, 0) + 1
        self._seq[ranks] = seq
        wd = _watchdog.get_watchdog()
        number = wd.next_seq(ranks) if wd is not None else None  # the data collective's number
        if inline:
            try:
                message = self._exchange(self.store, ranks, me, seq, header, what, number)
            except PeerFailedError:
                raise  # a rank failed: no disagreement to report (See [Note: failed ranks])
            except CollectiveTimeoutError as exc:
                raise Stage3CollectiveError(f"ZeRO stage 3: {exc}") from exc
            if message is not None:
                self.error = self.error or message
                raise Stage3CollectiveError(message)
            return
        with self._cond:
            self._pending.append((ranks, me, seq, header, what, number))
            self._posted += 1
            self._cond.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="zero-stage3-agreement", daemon=True)
            self._thread.start()

    def raise_if_failed(self) -> None:
        if self.peer_failed is not None:
            raise PeerFailedError(str(self.peer_failed), self.peer_failed.failed_rank)
        if self.error is not None:
            raise Stage3CollectiveError(self.error)

    def drain(self) -> None:
        """Wait until every header posted so far has been compared; raise a disagreement."""
        with self._cond:
            deadline = collective_timeout() + 5.0
            if not self._cond.wait_for(lambda: self._done >= self._posted or self.error, deadline):
                raise Stage3CollectiveError(
                    f"ZeRO stage 3: the agreement check of {self._posted - self._done} collective(s) did not "
                    f"finish within {deadline:g} s: a peer stopped posting headers (see the collective watchdog)"
                )
        self.raise_if_failed()

    def _run(self) -> None:
        store = self.store.clone()  # never queued behind the main thread's exchanges
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending))
                ranks, me, seq, header, what, number = self._pending[0]
            try:
                message = self._exchange(store, ranks, me, seq, header, what, number)
            except PeerFailedError as exc:
                self.peer_failed, message = exc, str(exc)
            except Exception as exc:  # the watchdog's diagnosis, or the store is gone (the end of a job)
                message = f"ZeRO stage 3: the agreement check before {what} failed: {exc}"
            with self._cond:
                self._pending.popleft()
                self._done += 1
                if message is not None and self.error is None:
                    self.error = message
                    wd = _watchdog.get_watchdog()
                    if wd is not None:  # a host stuck behind the mismatched collective: name it
                        wd.note(message.splitlines()[0])
                self._cond.notify_all()
                if self.error is not None:
                    self._pending.clear()
                    self._done = self._posted
                    return

    def _exchange(
        self,
        store: Any,
        ranks: tuple[int, ...],
        me: int,
        seq: int,
        header: Header,
        what: str,
        number: int | None,
    ) -> str | None:
        """Post ``header`` as exchange ``seq`` of the group, read the peers'; the mismatch message
        or None. The read is a watched store wait, part of collective ``number`` of the
        watchdog's count (See [Note: watched store waits]): a failed peer raises
        ``PeerFailedError``, the deadline the watchdog's diagnosis."""
        group = ",".join(map(str, ranks))
        store.set(f"{_KEY}/{group}/{me}/{seq}", " ".join(map(str, header)))
        if seq > 2:
            store.delete_key(f"{_KEY}/{group}/{me}/{seq - 2}")
        keys = [f"{_KEY}/{group}/{r}/{seq}" for r in ranks if r != me]
        values = wait_for_keys(store, keys, ranks, f"{what} (its stage-3 agreement check)", number)
        theirs = iter(tuple(int(x) for x in v.decode().split()) for v in values)
        rows = [header if r == me else next(theirs) for r in ranks]
        if all(row == header for row in rows):
            return None
        return mismatch_error(rows, ranks, me, what, seq)


class _Slot:
    """The exchange of the current default process group (a new group gets a new one)."""

    pg: Any = None
    agreement: StoreAgreement | None = None


_SLOT = _Slot()


def store_agreement() -> StoreAgreement | None:
    """The process's :class:`StoreAgreement` for the current default group (None: no store)."""
    import torch.distributed as dist

    pg = dist.group.WORLD
    if _SLOT.agreement is not None and _SLOT.pg is pg:
        return _SLOT.agreement
    try:
        store = dist.distributed_c10d._get_default_store().clone()
    except Exception:  # no store (a fake or single-process group): fall back to the device check
        return None
    _SLOT.pg, _SLOT.agreement = pg, StoreAgreement(store)
    return _SLOT.agreement


def confirm_agreement() -> None:
    """At an accumulation boundary: every header posted so far compared, disagreements raised."""
    agreement = _SLOT.agreement
    if agreement is not None and _SLOT.pg is not None:
        agreement.drain()


def check_agreement(
    kind: int, params: Sequence[torch.nn.Parameter], nbytes: int, group: Any, what: str
) -> None:
    """All ranks must be about to run the same collective (see [Note: stage 3 collective agreement])."""
    mode = collective_check_mode()
    if mode is False or comm.get_world_size(group) == 1:
        return
    header: Header = (kind, _BY_ID[id(params[0])].id if params else -1, len(params), int(nbytes))
    agreement = store_agreement() if mode != "collective" else None
    if agreement is None:
        _device_check(header, group, what)
        return
    inline = mode is True and "nccl" not in comm.get_backend(group).lower()
    agreement.check(comm.group_ranks(group), comm.get_rank(), header, what, inline)


def _device_check(header: Header, group: Any, what: str) -> None:
    """The debug mode: the headers all-gathered on the backend's device and compared on the host."""
    from zero_core.accelerator import get_accelerator

    world = comm.get_world_size(group)
    device = get_accelerator().current_device_name()  # the backend's device (NCCL: the GPU)
    mine = torch.tensor(header, dtype=torch.int64, device=device)
    every = torch.empty(4 * world, dtype=torch.int64, device=device)
    work = comm.all_gather_into_tensor(every, mine, group=group, async_op=True)
    wait_bounded(work, f"the agreement check before {what}")
    rows = every.view(world, 4)
    if bool((rows == mine).all()):  # the one host read per collective of this mode
        return
    raise Stage3CollectiveError(mismatch_error(rows.tolist(), comm.group_ranks(group), comm.get_rank(), what))


def wait_bounded(work: Any, what: str) -> None:
    """Wait for a stage-3 collective within the watchdog's deadline; a failure becomes a
    :class:`Stage3CollectiveError` naming ``what`` (and a disagreement already found)."""
    agreement = _SLOT.agreement
    if agreement is not None:
        agreement.raise_if_failed()  # the verdict is in: waiting on a mismatched collective is pointless
    wd = _watchdog.get_watchdog()
    if wd is not None:
        wd.note(what)  # the parameters of this collective, for the watchdog's diagnosis
    try:
        work.wait(timeout=datetime.timedelta(seconds=collective_timeout()))
    except PeerFailedError as exc:  # a rank failed: no disagreement to report (See [Note: failed ranks])
        raise PeerFailedError(f"{exc} (ZeRO stage 3: {what})", exc.failed_rank) from exc
    except Exception as exc:
        found = agreement.error if agreement is not None else None
        if found is not None:
            raise Stage3CollectiveError(found) from exc
        raise Stage3CollectiveError(
            f"ZeRO stage 3: {what} failed or did not complete within {collective_timeout():g} s on rank "
            f"{comm.get_rank()}: another rank did not join or failed (ranks took different paths through "
            f"the model?). Backend said: {exc}"
        ) from exc
