"""The "host syncs per step" column of the step-time benchmarks (bench_zero12, bench_zero3).

A host sync is a read of a device value on the host (``.item()``, ``float(t)``, ``bool(t)``,
``.tolist()``, ``.cpu()``, a device-to-host copy): on a GPU each one waits for every queued
kernel. A CPU run cannot feel those stalls but can count them, with the dispatch-mode counter
of ``zero_core.testing.host_syncs`` (see [Note: scalars stay on the device in the step]). The
count runs on extra steps after the timed ones, so it never inflates a step time, and the same
rule applies to every framework (reads inside ``torch.optim``, which keeps its step counters on
the host on purpose, are not counted for anyone). In an environment without zero-core (a
DeepSpeed venv) the counter module is loaded from this checkout by path: it needs torch only.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

_COUNTER = Path(__file__).resolve().parents[2] / "packages/zero-core/src/zero_core/testing/host_syncs.py"


def _count_host_syncs():
    try:
        from zero_core.testing.host_syncs import count_host_syncs
    except ImportError:  # no zero-core here, or one from before the counter existed
        spec = importlib.util.spec_from_file_location("bench_host_syncs_counter", _COUNTER)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        count_host_syncs = mod.count_host_syncs
    return count_host_syncs


def host_syncs_per_step(step_fn: Callable[[int], None], first_step: int, steps: int = 2) -> int:
    """Run ``step_fn(first_step) ... step_fn(first_step + steps - 1)`` under the counter and
    return the most syncs one step made (steps of a warmed-up run make the same reads)."""
    count = _count_host_syncs()
    most = 0
    for s in range(first_step, first_step + steps):
        with count() as c:
            step_fn(s)
        most = max(most, c.total)
    return most


def syncs_cell(row: dict) -> str:
    """The table cell of a result row (``"syncs"``: per-rank counts; "-" when not measured)."""
    syncs = row.get("syncs")
    if not syncs:
        return "-"
    return str(max(syncs))
