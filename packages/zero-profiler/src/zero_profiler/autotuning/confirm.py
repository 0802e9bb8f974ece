"""The confirm phase: the search's best few candidates measured again before one is picked.

[Note: autotuning confirm phase]
A search experiment is one short launch: a few optimizer steps of the user's script. On a
machine shared with anything else, one such measurement can be off by far more than the few
percent that separate the best candidates (DeepSpeed's autotuner, too, picks from one short run
per experiment), and the search's best measurement is the *largest* of many noisy ones, so it
is biased towards a lucky run (a winner's curse). Picking that one makes the pick a lottery
between the candidates near the top.

So after the search, whatever the tuner, the autotuner takes its ``confirm_top_k`` best
candidates (by their search score; zero's extension of the ``autotuning`` section, default 3;
0 or 1 turns the phase off) and runs each again as a fresh launch:

* over a window :data:`WINDOW_FACTOR` times as long (``end_profile_step`` moved out; the
  launch - process start, model build, communicator setup - usually costs more than a few more
  steps), and the engine's metric is already that of the window's median step (see [Note:
  autotuning experiments]), so a single slow step does not count;
* :data:`ROUNDS` round(s), the candidates interleaved within each round (candidate order
  A B C, then A B C again), so a change in the machine's load falls on all of them alike.

The pick is the candidate with the best median over its confirm runs; the search's own
measurement is left out (it is the biased one). A candidate whose confirm runs all failed
is not picked; if every confirm run failed (for example a script that stops right after the
search's ``end_profile_step``), the pick falls back to the search's best and ``summary.md`` says
why. Confirm runs are experiments like the others: recorded in ``exps_dir`` (``<name>_confirm<r>``),
listed in ``summary.md`` and reused by a restarted search.

Cost: ``confirm_top_k * ROUNDS`` launches (3 with the defaults; an exhaustive grid pays them
too). On the benchmark's 24-point space (``tools/bench/bench_autotune.py``) a model-based search
takes 3-4 search launches, so 6-7 in all against the grid's 27: the target of at most 30% of the
grid's time holds with one round; a second round (3 more launches) would not keep it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from zero_profiler.autotuning.experiment import ExperimentResult
from zero_profiler.autotuning.space import Candidate

#: how many times longer a confirm run's profiled window is than the search's
WINDOW_FACTOR = 3
#: confirm runs per candidate (interleaved across the candidates)
ROUNDS = 1

#: runs one confirm experiment: (candidate, its search result, round, end_profile_step) -> result
RunConfirm = Callable[[Candidate, ExperimentResult, int, int], ExperimentResult]


@dataclass
class ConfirmOutcome:
    """What the confirm phase measured and picked."""

    runs: dict[Candidate, list[ExperimentResult]] = field(default_factory=dict)
    search: dict[Candidate, ExperimentResult] = field(default_factory=dict)
    pick: ExperimentResult | None = None  # the picked candidate's median confirm run
    note: str = ""


def candidate_of(result: ExperimentResult) -> Candidate:
    return Candidate(result.stage, result.mbs, tuple(sorted(result.knobs.items())), result.offload)


def top_candidates(results: list[ExperimentResult], metric: str, k: int) -> list[ExperimentResult]:
    """The ``k`` best successful search experiments, one per candidate, best first."""
    best: dict[Candidate, ExperimentResult] = {}
    for r in results:
        score = r.score(metric)
        if r.phase != "search" or score is None:
            continue
        cand = candidate_of(r)
        if cand not in best or score > (best[cand].score(metric) or 0.0):
            best[cand] = r
    return sorted(best.values(), key=lambda r: -float(r.score(metric) or 0.0))[:k]


def confirm_window_end(start: int, end: int) -> int:
    """``end_profile_step`` of a confirm run: the search's window, :data:`WINDOW_FACTOR` times as long."""
    return start + WINDOW_FACTOR * (end - start)


def run_confirm_phase(
    results: list[ExperimentResult], metric: str, k: int, start: int, end: int, run: RunConfirm
) -> ConfirmOutcome:
    """Re-measure the top ``k`` search experiments (See [Note: autotuning confirm phase])."""
    out = ConfirmOutcome()
    top = top_candidates(results, metric, k) if k >= 2 else []
    if len(top) < 2:
        return out  # nothing to choose between
    out.search = {candidate_of(r): r for r in top}
    out.runs = {c: [] for c in out.search}
    window_end = confirm_window_end(start, end)
    for rnd in range(ROUNDS):
        for cand, search_result in out.search.items():
            out.runs[cand].append(run(cand, search_result, rnd, window_end))
    scored = {c: [r for r in runs if r.score(metric) is not None] for c, runs in out.runs.items()}
    scored = {c: runs for c, runs in scored.items() if runs}
    if not scored:
        reasons = sorted({f"{r.status}: {r.reason}" for runs in out.runs.values() for r in runs})
        out.note = (
            "confirm phase: no re-measurement succeeded ("
            + "; ".join(reasons)[:400]
            + "); the pick is the search's best measurement"
        )
        return out
    medians = {
        c: statistics.median(float(r.score(metric) or 0.0) for r in runs) for c, runs in scored.items()
    }
    winner = max(medians, key=lambda c: medians[c])
    runs = sorted(scored[winner], key=lambda r: float(r.score(metric) or 0.0))
    out.pick = runs[(len(runs) - 1) // 2]  # the run at the median (the lower one for an even count)
    return out
