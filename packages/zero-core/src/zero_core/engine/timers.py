"""Wall-clock timers for ``wall_clock_breakdown`` (forward, backward, step, communication)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable


class Timers:
    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self._sync = synchronize or (lambda: None)
        self._start: dict[str, float] = {}
        self.elapsed: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def start(self, name: str) -> None:
        self._sync()
        self._start[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        self._sync()
        begun = self._start.pop(name, None)
        if begun is not None:
            self.elapsed[name] += time.perf_counter() - begun
            self.counts[name] += 1

    def means_ms(self, reset: bool = True) -> dict[str, float]:
        out = {k: 1000.0 * v / max(self.counts[k], 1) for k, v in self.elapsed.items()}
        if reset:
            self.elapsed.clear()
            self.counts.clear()
        return out
