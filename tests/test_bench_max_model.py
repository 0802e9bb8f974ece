"""bench_max_model's pure logic: the largest-model search (tools/bench/_limit_search.py) on simulated
jobs, and the memory watcher (tools/bench/_memwatch.py) killing a real process past its ceiling."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


search = _load("_limit_search")
memwatch = _load("_memwatch")
MB = 2**20


def _simulated(base: float, per_layer: float, ceiling: float, fail_at: int | None = None):
    """A job whose peak is base + per_layer * n, killed at the ceiling; records the sizes tried."""
    tried: list[int] = []

    def run(n: int):
        tried.append(n)
        if fail_at is not None and n >= fail_at:
            return search.Trial(n, "failed", None, reason="simulated failure")
        peak = base + per_layer * n
        return search.Trial(n, "ok" if peak <= ceiling else "over", int(min(peak, ceiling + 1)))

    return run, tried


@pytest.mark.parametrize("estimate_factor", [1.0, 0.5, 2.0, 0.1])
def test_search_finds_the_exact_limit_even_with_a_wrong_estimate(estimate_factor: float) -> None:
    base, per_layer, ceiling = 700 * MB, 37 * MB, 3500 * MB
    truth = int((ceiling - base) // per_layer)  # 75
    run, tried = _simulated(base, per_layer, ceiling)
    res = search.search_limit(
        run,
        ceiling=int(ceiling),
        estimate_bytes=lambda n: estimate_factor * per_layer * n,
        max_layers=1000,
        log=lambda _: None,
    )
    assert res.limit == truth and res.bound == "memory"
    assert truth in tried and truth + 1 in tried  # the limit is verified from both sides
    assert res.best().layers == truth and res.best().peak <= ceiling
    assert len(tried) <= 6  # 1-block trial + prediction + a line through the peaks: a handful of runs
    if estimate_factor == 1.0:
        assert res.prediction == truth


def test_search_tolerance_stops_early_with_a_verified_lower_bound() -> None:
    run, tried = _simulated(0, 1 * MB, 1000 * MB)
    res = search.search_limit(
        run,
        ceiling=1000 * MB,
        estimate_bytes=lambda n: 3 * MB * n,
        max_layers=5000,
        tolerance=0.05,
        log=lambda _: None,
    )
    over = min(t.layers for t in res.trials if t.status == "over")
    assert res.limit <= 1000 and over - res.limit <= max(1, 0.05 * res.limit)
    assert all(t.status == "ok" for t in res.trials if t.layers <= res.limit)


def test_search_cap_failure_and_nothing_fits() -> None:
    quiet = {"log": lambda _: None}
    run, _ = _simulated(0, 1 * MB, 10**6 * MB)
    res = search.search_limit(
        run, ceiling=10**6 * MB, estimate_bytes=lambda n: MB * n, max_layers=40, **quiet
    )
    assert (res.limit, res.bound) == (40, "cap")

    run, _ = _simulated(0, 1 * MB, 100 * MB, fail_at=30)
    res = search.search_limit(run, ceiling=100 * MB, estimate_bytes=lambda n: MB * n, max_layers=500, **quiet)
    assert res.bound == "failed" and res.limit < 30  # a lower bound, and the result says why

    run, tried = _simulated(200 * MB, 1 * MB, 100 * MB)
    res = search.search_limit(run, ceiling=100 * MB, estimate_bytes=lambda n: MB * n, max_layers=500, **quiet)
    assert (res.limit, res.bound, tried) == (0, "memory", [1])


def test_next_candidate_trusts_the_prediction_inside_the_bracket_else_bisects() -> None:
    assert search.next_candidate(10, 50, guess=49, max_layers=100) == 49
    assert search.next_candidate(10, 50, guess=50, max_layers=100) == 22
    assert search.next_candidate(10, 50, guess=5, max_layers=100) == 11  # strictly inside
    assert search.next_candidate(10, 30, guess=None, max_layers=100) == 20  # midpoint
    assert search.next_candidate(10, 30, guess=45, max_layers=100) == 20  # a guess past hi: midpoint
    assert search.next_candidate(1, 747, guess=None, max_layers=1000) == 27  # geometric midpoint
    assert search.next_candidate(16, None, guess=10, max_layers=100) == 18  # no bracket: >= lo + lo/8
    assert search.next_candidate(16, None, guess=500, max_layers=100) == 100
    with pytest.raises(ValueError, match="nothing lies between"):
        search.next_candidate(10, 11, guess=None, max_layers=100)


def test_fit_prediction_uses_measured_peaks() -> None:
    trials = [search.Trial(1, "ok", 110), search.Trial(11, "ok", 210), search.Trial(30, "over", 1001)]
    assert search.fit_prediction(trials, 1000, slope_estimate=1.0) == 90  # slope 10 from the two ok trials
    assert search.fit_prediction(trials[:1], 1000, slope_estimate=5.0) == 1 + 178
    assert search.fit_prediction([], 1000, 1.0) is None


_HOG = (  # allocates n x 16 MB, prints its own peak as the benchmark jobs do, then sits for a while
    "import json, time\n"
    "chunks = []\n"
    "for _ in range({n}):\n"
    "    chunks.append(bytearray(16 * 2**20))\n"
    "    time.sleep(0.02)\n"
    "hwm = next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmHWM'))\n"
    "print('RESULT ' + json.dumps({{'peak_rss': hwm * 1024}}), flush=True)\n"
    "time.sleep({hold})\n"
)


def test_watcher_kills_a_job_past_its_ceiling() -> None:
    cmd = [sys.executable, "-c", _HOG.format(n=40, hold=30)]  # 640 MB, then would sit for 30 s
    res = memwatch.run_job([cmd, cmd], [{}, {}], ceiling=300 * MB, timeout=60, use_cgroup=False)
    assert res.status == "over", res
    assert res.seconds < 20  # killed when it passed the ceiling, not after its 30 s sleep
    assert 300 * MB < res.peak_sum < 500 * MB  # caught within a few 16 MB steps of the ceiling
    assert all(code is not None and code < 0 for code in res.returncodes)


def test_watcher_passes_a_job_under_its_ceiling_and_reports_its_peak() -> None:
    cmd = [sys.executable, "-c", _HOG.format(n=6, hold=0)]  # ~100 MB each
    res = memwatch.run_job([cmd, cmd], [{}, {}], ceiling=2000 * MB, timeout=60)
    assert res.status == "ok", res
    # each process's own final peak is folded in: the sum covers the 2 x 96 MB even if no sample saw it
    assert res.peak_sum >= sum(r["peak_rss"] for r in res.results) > 2 * 96 * MB
    assert res.peak_rss_sum <= res.peak_sum and len(res.results) == 2

    fail = [sys.executable, "-c", "raise SystemExit(3)"]
    res = memwatch.run_job([fail], [{}], ceiling=2000 * MB, timeout=60)
    assert res.status == "failed" and res.returncodes == [3]


def test_search_converges_on_a_curved_peak_with_a_linear_estimate() -> None:
    # peaks that bend upwards (per-block costs growing with depth): the line overshoots, bisection saves it
    tried: list[int] = []
    ceiling = 4000 * MB

    def run(n: int):
        tried.append(n)
        peak = 500 * MB + 2 * MB * n**1.5
        return search.Trial(n, "ok" if peak <= ceiling else "over", int(min(peak, ceiling + 1)))

    truth = max(n for n in range(1, 2000) if 500 * MB + 2 * MB * n**1.5 <= ceiling)
    res = search.search_limit(
        run, ceiling=ceiling, estimate_bytes=lambda n: 2 * MB * n, max_layers=2000, log=lambda _: None
    )
    assert res.limit == truth and len(tried) <= 12


def test_confirmation_reruns_the_limit_and_backs_off_when_it_goes_over() -> None:
    # size 20 passes on its first run and goes over on the second (peaks vary from run to run)
    runs: dict[int, int] = {}

    def run(n: int):
        runs[n] = runs.get(n, 0) + 1
        fits = n < 20 or (n == 20 and runs[n] == 1)
        return search.Trial(n, "ok" if fits else "over", 100 * n)

    res = search.search_limit(
        run, ceiling=2000, estimate_bytes=lambda n: 100.0 * n, max_layers=100, confirm=1, log=lambda _: None
    )
    assert (res.limit, res.bound) == (19, "memory")
    assert runs[20] == 2 and runs[19] == 2  # the limit ran twice, both ok
    assert all(t.status == "ok" for t in res.trials if t.layers == 19)


def test_watcher_counts_a_forked_child_by_its_private_pages() -> None:
    # the parent touches 200 MB, then forks a child that sits without exec: the child's RSS shows the
    # parent's pages (copy-on-write), which must not count twice
    code = (
        "import os, time\n"
        "buf = bytearray(200 * 2**20)\n"
        "pid = os.fork()\n"
        "time.sleep(1.0)\n"
        "if pid == 0:\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
    )
    res = memwatch.run_job(
        [[sys.executable, "-c", code]], [{}], ceiling=2000 * MB, timeout=60, use_cgroup=False
    )
    assert res.status == "ok", res
    assert 200 * MB < res.peak_sum < 300 * MB  # one copy of the 200 MB, not two
