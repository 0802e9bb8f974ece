"""Peak resident memory (RSS) of each phase of a run, per rank: what "fits in memory" means.

A phase (construction, ``initialize``, a step, a checkpoint save ...) runs inside
``meter.phase(name)``. Its peak is the kernel's high-water mark (``VmHWM`` in
``/proc/self/status``), reset at the phase start by writing ``5`` to ``/proc/self/clear_refs``,
and also the largest RSS a sampling thread saw every 20 ms (the kernel folds per-thread counters
into ``VmHWM`` lazily, so either may lag the other). RSS counts everything the process holds:
the interpreter, torch, buffers, and every tensor, so it is the number the kernel's OOM killer
goes by. ``base`` is the RSS when the meter was made (before the model exists): growth above it
is what the run itself added. Linux only (``/proc``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

_PAGE = 4096


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not permitted: VmHWM stays the lifetime peak (an overestimate, never an underestimate)


@dataclass
class Phase:
    name: str
    seconds: float
    peak: int  # bytes of RSS at the phase's highest point
    end: int  # bytes of RSS when it ended


class PhaseMeter:
    """Wall time and peak RSS of named phases (see the module docstring)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.base = rss_bytes()
        self.phases: list[Phase] = []
        self._interval = interval
        self._seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            self._seen = max(self._seen, rss_bytes())

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        _reset_hwm()
        self._seen = rss_bytes()
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            end = rss_bytes()
            peak = max(_hwm_bytes(), self._seen, end)
            self.phases.append(Phase(name, seconds, peak, end))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
