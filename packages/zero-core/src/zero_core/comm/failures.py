"""Failed ranks: a process that ends with an error says so in the process group's store.

[Note: failed ranks]
A rank whose script fails must not leave its peers waiting in a collective until the watchdog's
timeout (300 s by default) and then blame the network. So a process that is *ending* with an
error writes a :class:`FailureRecord` (its rank, the error, where it was: engine phase,
collective and source line, its exit status, host and pid) under ``zero_failed/<rank>`` in the
default group's store, and the first one also under ``zero_failed/first``:

* Who records: an exception escaping the script (``sys.excepthook``, installed with the first
  collective watchdog; ``zero run``'s shim, which also records ``sys.exit(n)`` with ``n != 0``
  and ``KeyboardInterrupt``), SIGTERM where zero has a handler (see [Note: cleanup on SIGTERM];
  no handler is installed for this alone: a handler only runs between bytecodes, so it would
  delay the default action of a process blocked in C++), and the exit teardown of a rank that
  leaves while a peer waits in a collective it never issued (``sys.exit(1)`` under plain
  ``python`` or torchrun, whose status Python does not tell an ``atexit`` hook; see [Note:
  process group teardown at exit]). An exception that is caught records nothing: only a process
  that ends does, so a caught error (a failed save, see [Note: collective save outcome]) lets
  training go on.
* Who reads: the collective watchdog's thread checks ``zero_failed/first`` once per poll (one
  store round trip a second per rank, none per collective); a rank waiting in a collective on a
  group with a failed member leaves it within about two polls with ``PeerFailedError`` naming
  the failed rank, what it was doing and its error (see [Note: collective watchdog]). A rank
  that dies without a record (SIGKILL, ``os._exit``, the OOM killer) closes its connections, so
  the transport fails its peers' ops at once; the diagnosis then names the rank that did not
  arrive and, on one host, that its process is gone.
* A rank that only followed (its error is a ``PeerFailedError``) records the rank it followed
  (``cause``), so every message names the rank that failed first.
* Under torchrun (``zero run``) the store lives in the launcher's agent and outlives the ranks.
  With other launchers rank 0 hosts it: a failing rank 0 stays ``LINGER_S`` before it exits, so
  that its peers can read why (they cannot once the store has gone with it).
* Every store access of this module is bounded (``STORE_TIMEOUT_S``): a dead store host never
  holds a failing process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, NoReturn

PREFIX = "zero_failed"
FIRST_KEY = f"{PREFIX}/first"
LINGER_S = 3.0  # a failing store host waits this long for its peers to read its record
STORE_TIMEOUT_S = 2.0  # bound on every store access made while failing
_MAX_ERROR = 400
ENDED_WITHOUT_RECORD = "its process has ended without recording an error (a signal such as SIGKILL or the OOM killer, or os._exit)"
#: engine methods named as the phase a rank failed in (outermost frame wins)
_PHASES = (
    "initialize",
    "forward",
    "backward",
    "step",
    "train_batch",
    "eval_batch",
    "save_checkpoint",
    "load_checkpoint",
)


@dataclasses.dataclass(frozen=True)
class FailureRecord:
    """What a rank that ended with an error left in the store (see [Note: failed ranks])."""

    rank: int
    error: str
    where: str = ""
    code: int = 1
    cause: int | None = None  # the failed rank this one only followed
    host: str = ""
    pid: int = 0
    time: float = 0.0

    def describe(self) -> str:
        where = f" {self.where}" if self.where else ""
        if self.cause is not None:
            return f"rank {self.rank} stopped{where} because rank {self.cause} failed: {self.error}"
        return f"rank {self.rank} failed{where}: {self.error}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: bytes | str) -> FailureRecord | None:
        try:
            raw = json.loads(text.decode() if isinstance(text, bytes) else text)
            fields = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: v for k, v in raw.items() if k in fields})
        except (ValueError, TypeError, AttributeError):
            return None


@dataclasses.dataclass
class _State:
    mine: FailureRecord | None = None  # this process's record, once it is ending with an error
    installed: bool = False
    ending: bool = False  # hard_exit is running: the SIGTERM observer must not record


_STATE = _State()


# -- the store ---------------------------------------------------------------------------
def default_store() -> Any | None:
    """The default process group's store, or None."""
    dist = sys.modules.get("torch.distributed")  # never imported just to find there is no group
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def bounded(fn: Callable[[], Any], timeout_s: float = STORE_TIMEOUT_S) -> Any:
    """``fn()`` on a helper thread, at most ``timeout_s``; None when it fails or takes longer."""
    out: list[Any] = [None]

    def run() -> None:
        with contextlib.suppress(Exception):
            out[0] = fn()

    t = threading.Thread(target=run, name="zero-failure-store", daemon=True)
    t.start()
    t.join(timeout_s)
    return out[0]


def hosts_store(rank: int) -> bool:
    """Whether this process hosts the store (rank 0, unless torchrun's agent hosts it)."""
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    raw = os.environ.get("RANK", "")
    return int(raw) if raw.isdigit() else 0


def read_first(store: Any) -> FailureRecord | None:
    """The first failure recorded in ``store`` (unbounded: call from a watchdog thread or via :func:`bounded`)."""
    if store is None or not store.check([FIRST_KEY]):
        return None
    return FailureRecord.from_json(store.get(FIRST_KEY))


def read_ranks(store: Any, ranks: list[int] | tuple[int, ...]) -> dict[int, FailureRecord]:
    """The failures recorded by ``ranks`` (unbounded, like :func:`read_first`)."""
    out: dict[int, FailureRecord] = {}
    for r in ranks:
        key = f"{PREFIX}/{r}"
        if store.check([key]):
            rec = FailureRecord.from_json(store.get(key))
            if rec is not None:
                out[r] = rec
    return out


def root_failure(records: list[FailureRecord]) -> FailureRecord | None:
    """The record to name: the earliest of those that failed on their own, else the earliest."""
    if not records:
        return None
    own = [r for r in records if r.cause is None]
    return min(own or records, key=lambda r: (r.time, r.rank))


# -- recording ---------------------------------------------------------------------------
def where_of(tb: TracebackType | FrameType | None) -> str:
    """``in <engine phase> in <collective> at <file>:<line>``: where a traceback (or frame) was."""
    if isinstance(tb, FrameType):
        frames = list(traceback.extract_stack(tb))
    else:
        frames = list(traceback.extract_tb(tb)) if tb is not None else []
    phase = collective = None
    for fr in frames:
        path = fr.filename.replace("\\", "/")
        if phase is None and "/engine" in path and "/zero_" in path and fr.name in _PHASES:
            phase = fr.name
        if path.endswith(("/zero_core/comm/collectives.py", "/zero_core/comm/p2p.py")):
            collective = collective or fr.name
    user = [f for f in frames if "/zero_" not in f.filename.replace("\\", "/") and "runpy" not in f.filename]
    last = (user or frames)[-1] if frames else None
    parts = [f"in {phase}"] if phase else []
    if collective:
        parts.append(f"in {collective}")
    if last is not None:
        parts.append(f"at {os.path.basename(last.filename)}:{last.lineno}")
    return " ".join(parts)


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _MAX_ERROR else text[: _MAX_ERROR - 3] + "..."


def record(error: str, where: str = "", code: int = 1, cause: int | None = None) -> FailureRecord:
    """Record that this process is ending with ``error`` (the first call wins; later ones return it)."""
    if _STATE.mine is not None:
        return _STATE.mine
    rec = FailureRecord(
        rank=_rank(),
        error=_short(error),
        where=where,
        code=int(code),
        cause=cause,
        host=socket.gethostname(),
        pid=os.getpid(),
        time=time.time(),
    )
    _STATE.mine = rec
    store = default_store()
    if store is not None:
        text = rec.to_json()

        def write() -> bool:
            store.set(f"{PREFIX}/{rec.rank}", text)
            store.compare_set(FIRST_KEY, "", text)
            return True

        bounded(write)
    return rec


def record_exception(exc: BaseException, code: int = 1) -> FailureRecord:
    """Record the exception that ends this process (a ``PeerFailedError`` names the rank it followed)."""
    cause = getattr(exc, "failed_rank", None)
    message = str(exc).strip().splitlines()
    error = f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__
    return record(error, where_of(exc.__traceback__), code, cause if isinstance(cause, int) else None)


def record_exit(code: int, exc: BaseException | None = None) -> FailureRecord:
    """Record ``sys.exit(code)`` (``code != 0``) ending this process."""
    return record(f"sys.exit({code})", where_of(exc.__traceback__ if exc is not None else None), code)


def this_process_failed() -> FailureRecord | None:
    """This process's failure record, once it is ending with an error."""
    return _STATE.mine


# -- hooks ------------------------------------------------------------------------------
def install() -> None:
    """Record an exception that ends the process (``sys.excepthook``) and SIGTERM where zero
    handles it (see the Note); idempotent."""
    if _STATE.installed:
        return
    _STATE.installed = True
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        with contextlib.suppress(Exception):
            record_exception(value, 130 if issubclass(kind, KeyboardInterrupt) else 1)
        previous(kind, value, tb)

    sys.excepthook = excepthook
    from zero_core.utils import termination

    termination.observe(_on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (where zero handles it): a follower of a failed peer says so, else record it."""
    if _STATE.ending or _STATE.mine is not None:
        return
    store = default_store()
    first = bounded(lambda: read_first(store) or _ended_peer(store)) if store is not None else None
    if first is not None and first.rank != _rank():
        rec = record("SIGTERM (stopped by the launcher)", where_of(frame), 128 + signum, cause=first.rank)
        print(
            f"[zero] rank {rec.rank}: ended by SIGTERM {rec.where}; {first.describe()}",
            file=sys.stderr,
            flush=True,
        )
        return
    record("SIGTERM", where_of(frame), 128 + signum)


def _ended_peer(store: Any) -> FailureRecord | None:
    """A peer whose process has ended without a record (on this host), from the watchdog records."""
    from zero_core.comm import peer_state

    dist = sys.modules["torch.distributed"]
    me = _rank()
    for r, rec in sorted(peer_state.peer_records(store, range(dist.get_world_size())).items()):
        if r != me and process_alive(rec.get("host", ""), rec.get("pid", 0)) is False:
            return FailureRecord(
                rank=r, error=ENDED_WITHOUT_RECORD, host=rec.get("host", ""), pid=rec.get("pid", 0)
            )
    return None


def linger_if_store_host() -> None:
    """A failing rank that hosts the store waits up to ``LINGER_S`` so its peers can read its
    record; it stops as soon as every other rank has a record of its own (they know)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() == 1 or not hosts_store(_rank()):
        return
    store, others = default_store(), [r for r in range(dist.get_world_size()) if r != _rank()]
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline:
        known = bounded(lambda: len(read_ranks(store, others)), 0.5) if store is not None else None
        if known == len(others):
            return
        time.sleep(0.1)


def hard_exit(code: int, message: str | None = None) -> NoReturn:
    """End this process now: ``os._exit`` after what must not outlive it.

    For a process whose process group may still have an op in flight, which no teardown can
    end (``destroy_process_group`` waits for it). Runs the SIGTERM cleanup callbacks (swap
    files, a save's staging directory: see [Note: cleanup on SIGTERM]), flushes logging and
    stdio. ``atexit`` hooks registered before zero's are skipped.
    """
    _STATE.ending = True
    if message:
        print(message, file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        from zero_core.utils import termination

        termination.run_callbacks()
    with contextlib.suppress(Exception):
        logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def process_alive(host: str, pid: int) -> bool | None:
    """Whether the process ``pid`` on ``host`` still runs; None when it is on another host."""
    if not pid or host != socket.gethostname():
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")  # a zombie has ended, its parent just has not reaped it
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
