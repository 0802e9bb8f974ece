"""Timing and statistics shared by the ZeRO step-time benchmarks (bench_zero12, bench_zero3).

[Note: interleaved step-time ratios]
On a shared machine a ratio of two medians taken minutes apart measures the load as much as the
code. So every variant of a benchmark is built in the *same* ranks of one launch and the variants
take turns: pass 1 runs a few steps of A, then of B, then of C, pass 2 again A, B, C, and so on
for at least five passes. Each pass yields one ratio per variant (its median step over the
pass's steps and ranks, divided by the baseline's median in that same pass); the figure quoted
is the median of those per-pass ratios with their interquartile range, so a burst of load hits
the variant and its baseline alike or shows up as spread, never as a lucky single ratio.

Every step records wall time (``time.perf_counter``) and CPU time of the rank process
(``time.process_time``: all of its threads, gloo's communication threads included). CPU time
moves much less with the machine's load than wall time (a descheduled rank accrues none), so
its ratio is the steadier figure; wall time is what a user waits for and is reported beside it.
Each step is also split in phases by explicit timers (forward, backward, optimizer step; wall
and the main thread's CPU time, ``time.thread_time``): a phase's wall minus its main-thread CPU
is the time the main thread waited (for a collective or for a core).

``--check`` mode of the scripts re-runs and compares the README's quoted figures (rows of the
README's "Step time" table, see :func:`readme_quotes`) with the new interquartile ranges.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

PHASES = ("forward", "backward", "step")


@dataclass
class StepRecord:
    """One step of one rank: wall and process-CPU seconds, and per phase (wall, main-thread CPU)."""

    wall: float
    cpu: float
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)


class PhaseClock:
    """Times one step and its phases: ``with clock.phase("forward"): ...`` inside ``clock.step()``."""

    def __init__(self) -> None:
        self._phases: dict[str, tuple[float, float]] = {}

    @contextmanager
    def phase(self, name: str):
        w, c = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            dw, dc = time.perf_counter() - w, time.thread_time() - c
            pw, pc = self._phases.get(name, (0.0, 0.0))
            self._phases[name] = (pw + dw, pc + dc)

    def run(self, step: Callable[[PhaseClock], None]) -> StepRecord:
        self._phases = {}
        w, c = time.perf_counter(), time.process_time()
        step(self)
        return StepRecord(time.perf_counter() - w, time.process_time() - c, dict(self._phases))


def interleave(
    variants: dict[str, Callable[[PhaseClock, int], None]],
    passes: int,
    steps: int,
    barrier: Callable[[], None],
    warmup: int = 1,
) -> dict[str, list[list[StepRecord]]]:
    """Run the variants in turn, ``steps`` steps each per pass, ``passes`` times (warm-up first).

    ``variants[name](clock, step_index)`` runs one training step using ``clock.phase``. A
    barrier precedes each step so the ranks start together. Returns, per variant, one list of
    step records per pass. See [Note: interleaved step-time ratios].
    """
    if passes < 1 or steps < 1:
        raise ValueError(f"passes and steps must be >= 1, got passes={passes}, steps={steps}")
    clock = PhaseClock()
    index = dict.fromkeys(variants, 0)
    for name, fn in variants.items():
        for _ in range(warmup):
            barrier()
            clock.run(lambda c, fn=fn, i=index[name]: fn(c, i))
            index[name] += 1
    out: dict[str, list[list[StepRecord]]] = {name: [] for name in variants}
    for _ in range(passes):
        for name, fn in variants.items():
            records = []
            for _ in range(steps):
                barrier()
                records.append(clock.run(lambda c, fn=fn, i=index[name]: fn(c, i)))
                index[name] += 1
            out[name].append(records)
    return out


def merge_ranks(per_rank: Sequence[dict[str, list[list[StepRecord]]]]) -> dict[str, list[list[StepRecord]]]:
    """Pool the ranks' records pass by pass (pass p of every rank goes into pass p)."""
    out: dict[str, list[list[StepRecord]]] = {}
    for res in per_rank:
        for name, passes in res.items():
            dst = out.setdefault(name, [[] for _ in passes])
            for p, records in enumerate(passes):
                dst[p] += records
    return out


def quartiles(xs: Iterable[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); a single value is its own quartiles."""
    v = sorted(xs)
    if not v:
        raise ValueError("quartiles of an empty sample")
    if len(v) == 1:
        return v[0], v[0], v[0]
    q1, med, q3 = statistics.quantiles(v, n=4, method="inclusive")
    return q1, med, q3


def pass_medians(passes: list[list[StepRecord]], key: str) -> list[float]:
    """Median ``wall`` or ``cpu`` of every pass."""
    return [statistics.median(getattr(r, key) for r in records) for records in passes]


def ratio_quartiles(
    passes: list[list[StepRecord]], base: list[list[StepRecord]], key: str
) -> tuple[float, float, float]:
    """Quartiles of the per-pass ratios variant/baseline of median ``key`` (``wall`` or ``cpu``)."""
    return quartiles(a / b for a, b in zip(pass_medians(passes, key), pass_medians(base, key), strict=True))


def step_quartiles(passes: list[list[StepRecord]], key: str) -> tuple[float, float, float]:
    """Quartiles of ``key`` over every step of every pass and rank."""
    return quartiles(getattr(r, key) for records in passes for r in records)


def phase_medians(passes: list[list[StepRecord]]) -> dict[str, tuple[float, float]]:
    """Median (wall, main-thread CPU) of each phase over every step."""
    rows = [r for records in passes for r in records]
    names = [p for p in PHASES if any(p in r.phases for r in rows)]
    return {
        p: (
            statistics.median(r.phases.get(p, (0.0, 0.0))[0] for r in rows),
            statistics.median(r.phases.get(p, (0.0, 0.0))[1] for r in rows),
        )
        for p in names
    }


def fmt_iqr(q: tuple[float, float, float], scale: float = 1.0, digits: int = 2) -> str:
    """``median (q1-q3)``."""
    return f"{q[1] * scale:.{digits}f} ({q[0] * scale:.{digits}f}-{q[2] * scale:.{digits}f})"


class LoadLog:
    """1-, 5- and 15-minute load averages sampled during a run (a shared machine's load is part of a result)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self.sample()

    def sample(self) -> None:
        self.samples.append(os.getloadavg())

    def describe(self) -> str:
        one = [s[0] for s in self.samples]
        last = self.samples[-1]
        return (
            f"1-min load average min {min(one):.2f}, median {statistics.median(one):.2f}, max {max(one):.2f} "
            f"over {len(one)} samples; at the end {last[0]:.2f}/{last[1]:.2f}/{last[2]:.2f} (1/5/15 min), "
            f"on {os.cpu_count()} CPUs"
        )


_QUOTE = re.compile(
    r"^\|\s*(?P<bench>bench_\w+)\s*\|\s*(?P<key>[^|]+?)\s*\|\s*(?P<wall>[\d.]+)\s*\([\d.]+-[\d.]+\)\s*"
    r"\|\s*(?P<cpu>[\d.]+)\s*\([\d.]+-[\d.]+\)\s*\|"
)


def readme_quotes(readme: Path, bench: str) -> dict[str, tuple[float, float]]:
    """The README's quoted (wall, CPU) median ratios of ``bench``, keyed by the comparison.

    Rows of the form ``| bench_zero12 | stage2/ddp fp32 | 1.01 (0.99-1.04) | 1.00 (0.99-1.02) |``.
    """
    out = {}
    for line in readme.read_text().splitlines():
        m = _QUOTE.match(line)
        if m and m["bench"] == bench:
            out[m["key"]] = (float(m["wall"]), float(m["cpu"]))
    return out


def check_lines(
    quotes: dict[str, tuple[float, float]],
    measured: dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]],
) -> tuple[list[str], bool]:
    """Say, per quoted figure, whether it lies in the new run's interquartile range; ok if all do."""
    if not quotes:
        return ["no quoted figures found in the README for this benchmark"], False
    lines, ok = [], True
    for key, (q_wall, q_cpu) in quotes.items():
        if key not in measured:
            lines.append(f"{key}: quoted in the README but not measured by this run")
            ok = False
            continue
        for label, quoted, q in (("wall", q_wall, measured[key][0]), ("cpu", q_cpu, measured[key][1])):
            inside = q[0] <= quoted <= q[2]
            ok &= inside
            verdict = "inside" if inside else "OUTSIDE"
            lines.append(f"{key} {label}: README {quoted:.2f}, new run {fmt_iqr(q)}: {verdict}")
    return lines, ok


#: the legend of the benchmarks' per-phase tables (bench_zero12, bench_zero3): what each column counts
PHASE_LEGEND = (
    "wall = the phase's wall time; cpu = the main thread's CPU time in it; wait = wall - cpu (blocked on a "
    "collective or on a core). reduce / gather = time spent in reduce (all-reduce, reduce-scatter) and "
    "gather (all-gather, broadcast) collectives over one profiled step, overlapped or not: gloo's own "
    "collectives on its thread, zero's direct exchanges on gloo from launch to their last transfer, counted "
    "once while several are in flight (see [Note: gloo direct collectives] in zero_core/comm/gloo_direct.py)."
)


def collective_seconds(step: Callable[[], None]) -> dict[str, float]:
    """Seconds gloo spent running collectives during ``step()``, by kind, from torch's profiler.

    gloo runs a collective on its own thread; the profiler records it as ``gloo:<op>``. "reduce"
    sums all-reduce and reduce-scatter, "gather" all-gather and broadcast. This is the time the
    collectives took, overlapped or not: set it beside the phases' waits to see what was exposed.
    zero's direct exchanges on gloo (a ``gloo_direct:<op>`` range whose ``gloo:send``/``gloo:recv``
    transfers start inside it; see [Note: gloo direct collectives]) count from the range's start
    to the end of their last transfer; several in flight at once count once (the union).
    """
    from torch.profiler import ProfilerActivity, profile

    def kind_of(op: str) -> str | None:
        return "reduce" if "reduce" in op else "gather" if ("gather" in op or "broadcast" in op) else None

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    out = {"reduce": 0.0, "gather": 0.0}
    events = list(prof.events())
    direct = [ev for ev in events if ev.name.startswith("gloo_direct:")]
    transfers = [ev for ev in events if ev.name in ("gloo:send", "gloo:recv")]
    for ev in events:
        if ev.name.startswith("gloo:") and ev.name not in ("gloo:send", "gloo:recv"):
            kind = kind_of(ev.name[len("gloo:") :])
            if kind:
                out[kind] += ev.cpu_time_total / 1e6
    spans: dict[str, list[tuple[float, float]]] = {"reduce": [], "gather": []}
    for rng in direct:
        kind = kind_of(rng.name[len("gloo_direct:") :])
        start, end = rng.time_range.start, rng.time_range.end
        ends = [t.time_range.end for t in transfers if start <= t.time_range.start <= end]
        if kind and ends:
            spans[kind].append((start, max(ends)))
    for kind, intervals in spans.items():
        out[kind] += union_seconds(intervals)
    return out


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by (start, end) intervals in microseconds (the profiler's unit): ops in
    flight together count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e6
