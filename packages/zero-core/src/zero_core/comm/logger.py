"""The communication logger: count, bytes and time of every collective, per op and per group.

``zero_core.comm.comms_logger`` is the process-wide instance; every function of
``zero_core.comm`` reports to it, and it records only while enabled (config section
``comms_logger``: ``enabled``, ``verbose``, ``prof_all``, ``prof_ops``, ``debug``).

[Note: what the comms logger counts]
Records are keyed by ``(op_name, group_ranks)`` where ``group_ranks`` is the tuple of
global ranks of the process group (the whole world for ``group=None``). ``bytes`` is the
size in bytes of:

* ``all_reduce``, ``reduce``, ``broadcast``: the tensor;
* ``reduce_scatter_tensor``: the full *input* (world_size x the output);
* ``all_gather_into_tensor``: the full *output* (world_size x the input);
* ``all_gather`` (list): the sum of the output list's tensors;
* ``all_to_all_single``: the input;
* ``compressed_all_reduce``: the compressed tensor (packed sign bits plus scales; see
  [Note: compressed all-reduce] in ``compressed.py``), once per call for both of its phases;
* ``send``/``recv``/``isend``/``irecv``: the tensor; ``batch_isend_irecv``: the sum over its ops;
* ``broadcast_object_list``, ``all_gather_object``, ``barrier``, ``monitored_barrier``: 0
  (objects are pickled inside torch; only count and time are recorded).

Each record also splits the bytes this rank *sends* by link class, inside a node or across
nodes, with the direct-exchange model of [Note: bytes by link class] (``link_bytes.py``);
:meth:`CommsLogger.bytes_by_link` sums them.

So a ZeRO step over Ψ fp32 elements shows ``4Ψ`` bytes of ``reduce_scatter_tensor`` and
``4Ψ`` of ``all_gather_into_tensor``, whatever the world size. Bytes are the logical sizes the
caller asked for, before any padding or dtype workaround of [Note: backend workarounds].

Time is wall-clock from issue to completion: for ``async_op=True`` the count and bytes are
recorded at issue and the time when ``wait()`` on the returned handle first returns (a handle
never waited on contributes no time). On a GPU the device is synchronized before the clock is
read, which serializes work: enable the logger for diagnosis, not in production runs.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Every op name the comm layer reports (valid entries of ``prof_ops``).
OP_NAMES: tuple[str, ...] = (
    "all_reduce",
    "reduce",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "all_gather",
    "broadcast",
    "broadcast_object_list",
    "all_gather_object",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
    "monitored_barrier",
    "compressed_all_reduce",
)

_CONFIG_KEYS = ("enabled", "verbose", "prof_all", "prof_ops", "debug")

GroupKey = tuple[int, ...]


@dataclass
class Stats:
    """Totals of one (op, group): number of calls, bytes moved, seconds spent."""

    count: int = 0
    bytes: int = 0
    total_time_s: float = 0.0
    # this rank's bytes sent by link class (See [Note: bytes by link class] in link_bytes.py);
    # outside equality, so a Stats compares by what every op records
    intra_node_bytes: int = field(default=0, compare=False)
    inter_node_bytes: int = field(default=0, compare=False)


def bus_bandwidth_factor(op: str, world_size: int) -> float:
    """busbw / algbw, as in nccl-tests: the fraction of the data each link really carries."""
    n = max(world_size, 1)
    base = op.split(" ", 1)[0]
    if base in ("all_reduce", "compressed_all_reduce"):
        return 2.0 * (n - 1) / n
    if base in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "all_to_all_single"):
        return (n - 1) / n
    return 1.0


def _check_op_names(ops: Iterable[Any], where: str) -> frozenset[str]:
    if isinstance(ops, str):
        raise TypeError(f"{where}: prof_ops must be a list of op names, got the string {ops!r}")
    names = list(ops)
    for name in names:
        if name not in OP_NAMES:
            raise ValueError(f"{where}: unknown op {name!r} in prof_ops; allowed: {', '.join(OP_NAMES)}")
    return frozenset(names)


class PendingRecord:
    """An issued op whose count/bytes are recorded and whose time is added on completion.

    ``pending`` is the number of handles that must complete first (``batch_isend_irecv``
    returns several).
    """

    __slots__ = ("logger", "key", "nbytes", "start", "pending", "sync")

    def __init__(
        self, logger: CommsLogger, key: tuple[str, GroupKey], nbytes: int, sync: Callable[[], None] | None
    ):
        self.logger = logger
        self.key = key
        self.nbytes = nbytes
        self.sync = sync
        self.pending = 1
        self.start = time.perf_counter()

    def finish(self) -> None:
        self.pending -= 1
        if self.pending > 0:
            return
        if self.sync is not None:
            self.sync()
        self.logger._add_time(self.key, self.nbytes, time.perf_counter() - self.start)


class CommsLogger:
    """Per-process record of communication; see [Note: what the comms logger counts]."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[tuple[str, GroupKey], Stats] = {}
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.prof_ops: frozenset[str] = frozenset()
        self.debug = False
        self.print_fn: Callable[[str], Any] = print

    # -- configuration -------------------------------------------------------------------
    def enable(
        self, prof_ops: Iterable[str] | None = None, verbose: bool = False, debug: bool = False
    ) -> None:
        """Start recording: every op when ``prof_ops`` is None, else only the named ops."""
        if prof_ops is None:
            self.prof_all, self.prof_ops = True, frozenset()
        else:
            self.prof_all, self.prof_ops = False, _check_op_names(prof_ops, "comms_logger.enable")
        self.verbose = bool(verbose)
        self.debug = bool(debug)
        self.enabled = True

    def disable(self) -> None:
        """Stop recording (what was recorded is kept until ``reset()``)."""
        self.enabled = False

    def reset(self) -> None:
        """Forget every record."""
        with self._lock:
            self._stats.clear()

    def configure(self, config: Mapping[str, Any] | Any) -> None:
        """Apply a ``comms_logger`` config section (a mapping or an object with those attributes).

        Keys: ``enabled`` (bool), ``verbose`` (bool, print each op), ``prof_all`` (bool, record
        every op), ``prof_ops`` (list of op names, recorded when ``prof_all`` is false),
        ``debug`` (bool, append the calling function to each op name).
        """
        if isinstance(config, Mapping):
            unknown = sorted(set(config) - set(_CONFIG_KEYS))
            if unknown:
                raise ValueError(
                    f"comms_logger config: unknown key(s) {unknown}; allowed: {list(_CONFIG_KEYS)}"
                )
            get = config.get
        else:

            def get(key: str, default: Any = None) -> Any:
                return getattr(config, key, default)

        for key in ("enabled", "verbose", "prof_all", "debug"):
            value = get(key, None)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"comms_logger config: '{key}' must be a bool, got {value!r}")
        prof_ops = get("prof_ops", None)
        self.prof_ops = _check_op_names(prof_ops or [], "comms_logger config")
        self.prof_all = bool(get("prof_all", True))
        self.verbose = bool(get("verbose", False))
        self.debug = bool(get("debug", False))
        self.enabled = bool(get("enabled", False))

    # -- recording (called by zero_core.comm) --------------------------------------------
    def should_log(self, op: str) -> bool:
        return self.enabled and (self.prof_all or op in self.prof_ops)

    def begin(
        self,
        op: str,
        group_ranks: GroupKey,
        nbytes: int,
        sync: Callable[[], None] | None = None,
        links: tuple[int, int] = (0, 0),
    ) -> PendingRecord:
        """Record one call of ``op`` now (count, bytes, ``links`` = this rank's (intra-node,
        inter-node) bytes sent; see [Note: bytes by link class]) and start its clock."""
        name = f"{op} [{_caller()}]" if self.debug else op
        key = (name, group_ranks)
        with self._lock:
            stats = self._stats.setdefault(key, Stats())
            stats.count += 1
            stats.bytes += nbytes
            stats.intra_node_bytes += links[0]
            stats.inter_node_bytes += links[1]
        return PendingRecord(self, key, nbytes, sync)

    def add_links(self, key: tuple[str, GroupKey], intra: int, inter: int) -> None:
        """Add link-class bytes to an existing record (``batch_isend_irecv``'s sends)."""
        with self._lock:
            stats = self._stats.setdefault(key, Stats())
            stats.intra_node_bytes += intra
            stats.inter_node_bytes += inter

    def _add_time(self, key: tuple[str, GroupKey], nbytes: int, seconds: float) -> None:
        with self._lock:
            self._stats.setdefault(key, Stats()).total_time_s += seconds
        if self.verbose:
            n = len(key[1])
            algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
            self.print_fn(
                f"comm op: {key[0]} | group: {key[1]} | msg size: {_fmt_size(nbytes)} | "
                f"time (ms): {seconds * 1e3:.3f} | algbw (GB/s): {algbw:.3f} | "
                f"busbw (GB/s): {algbw * bus_bandwidth_factor(key[0], n):.3f}"
            )

    # -- reading -------------------------------------------------------------------------
    def summary(self) -> dict[tuple[str, GroupKey], Stats]:
        """A snapshot: ``{(op, group_ranks): Stats}``."""
        with self._lock:
            return {
                k: Stats(v.count, v.bytes, v.total_time_s, v.intra_node_bytes, v.inter_node_bytes)
                for k, v in self._stats.items()
            }

    def bytes_by_link(self, op: str | None = None, group: GroupKey | None = None) -> dict[str, int]:
        """Bytes this rank sent, ``{"intra_node": .., "inter_node": ..}``, over every op (or only
        ``op``) and group (or only ``group``'s ranks tuple). See [Note: bytes by link class]."""
        intra = inter = 0
        for (name, ranks), s in self.summary().items():
            if (op is None and group is None) or _match(name, ranks, op or name.split(" [", 1)[0], group):
                intra += s.intra_node_bytes
                inter += s.inter_node_bytes
        return {"intra_node": intra, "inter_node": inter}

    def bytes_for(self, op: str, group: GroupKey | None = None) -> int:
        """Total bytes recorded for ``op`` (over every group, or only ``group``'s ranks tuple)."""
        return sum(s.bytes for (name, ranks), s in self.summary().items() if _match(name, ranks, op, group))

    def count_for(self, op: str, group: GroupKey | None = None) -> int:
        """Number of calls recorded for ``op`` (over every group, or only ``group``'s ranks tuple)."""
        return sum(s.count for (name, ranks), s in self.summary().items() if _match(name, ranks, op, group))

    def log_summary(self, print_fn: Callable[[str], Any] = print) -> None:
        """Print a table: op, group, count, total MB, avg latency, algbw and busbw."""
        header = (
            f"{'Comm. Op':<28}{'Group':<20}{'Count':>8}{'Total MB':>12}{'Avg Lat(ms)':>13}"
            f"{'algbw(GB/s)':>13}{'busbw(GB/s)':>13}"
        )
        lines = [header, "-" * len(header)]
        for (name, ranks), s in sorted(self.summary().items()):
            avg = s.total_time_s / s.count if s.count else 0.0
            algbw = s.bytes / s.total_time_s / 1e9 if s.total_time_s > 0 else 0.0
            busbw = algbw * bus_bandwidth_factor(name, len(ranks))
            group = _fmt_group(ranks)
            lines.append(
                f"{name:<28}{group:<20}{s.count:>8}{s.bytes / 2**20:>12.3f}{avg * 1e3:>13.3f}{algbw:>13.3f}{busbw:>13.3f}"
            )
        print_fn("\n".join(lines))


def _match(name: str, ranks: GroupKey, op: str, group: GroupKey | None) -> bool:
    return (name == op or name.startswith(op + " [")) and (group is None or tuple(group) == ranks)


def _fmt_group(ranks: GroupKey) -> str:
    text = ",".join(map(str, ranks))
    return f"({text})" if len(text) <= 16 else f"({ranks[0]}..{ranks[-1]}; {len(ranks)})"


def _fmt_size(nbytes: int) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _caller() -> str:
    """``module.function`` of the first frame outside the comm layer."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("zero_core.comm"):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_globals.get('__name__', '?')}.{frame.f_code.co_name}"


#: The process-wide logger every ``zero_core.comm`` function reports to.
comms_logger = CommsLogger()
