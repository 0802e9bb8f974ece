"""The search for the largest model that fits a memory ceiling: candidates, bracketing, stopping.

[Note: largest-model search]
The size of a model is one integer (the number of transformer blocks at a fixed width), and the
memory a training job needs grows with it. A trial runs the job at one size and ends ``ok``
(finished, peak under the ceiling), ``over`` (went past the ceiling), or something that stops
the search (``failed``, ``timeout``, ``disk``: too little free disk for the swap files).

1. The first trial is the smallest model (1 block): it says the mode works at all and measures
   the job's fixed cost (the peak at 1 block minus the estimator's bytes for 1 block).
2. The estimator (model-state bytes per mode from zero-profiler, plus activations) then predicts
   the largest size whose fixed cost + estimated bytes stays under the ceiling: the next trial.
3. Each later candidate comes from the measured peaks: a line through the two largest ``ok``
   trials, extended to the ceiling (the estimator's slope while only one ``ok``
   trial exists). Without a failing size yet, a candidate is at least 1/8 above the largest
   ``ok`` one (so a prediction at or below a size that fits still moves up). Once sizes ``lo``
   (ok) and ``hi`` (over) bracket the limit, a prediction strictly inside the bracket is tried
   (one at or past ``hi`` is replaced by a bisection); after two predicted trials in a row that did not halve the bracket the next one
   bisects it (the midpoint, geometric when ``hi > 4 lo``: sizes may span orders of magnitude),
   as does a bracket with a single ``ok`` trial (the estimator's slope, the only one there is,
   was just proven wrong). So the search needs at most about three times the trials of a
   bisection, and usually far fewer: the peaks of a depth-scaled model lie close to a line.
4. The search stops when ``hi - lo <= max(1, tolerance * lo)`` (the limit is ``lo``), when
   ``lo`` reaches ``max_layers`` (the limit is at least the cap), or at the first trial that
   neither fits nor goes over (``lo`` is then only a lower bound, and the result says why).
5. Peaks vary by a few percent from run to run (allocator and thread timing: 1.87-2.01 GiB over
   three runs of the same 2-rank job here), which near the ceiling is a block or more. So before
   stopping, the limit is run ``confirm`` more times; a run that goes over makes that size the
   bracket's new upper end and the search goes on below it. The limit is then the largest size
   that passed every time it ran.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Trial:
    """One verified run: its size, how it ended, the job's peak (bytes) and how long it took."""

    layers: int
    status: str  # ok, over, failed, timeout, disk
    peak: int | None
    seconds: float = 0.0
    reason: str = ""
    info: dict = field(default_factory=dict)


@dataclass
class SearchResult:
    """The largest size that fit (0: not even one block), why the search stopped, every trial."""

    limit: int
    bound: str  # memory (bracketed), cap (max_layers fits), or the stopping trial's status
    prediction: int | None  # the estimator's predicted limit (after the 1-block calibration)
    trials: list[Trial]

    def best(self) -> Trial | None:
        """The trial at the limit (the largest ``ok`` one)."""
        ok = [t for t in self.trials if t.status == "ok" and t.layers == self.limit]
        return ok[-1] if ok else None


def fit_prediction(trials: list[Trial], ceiling: int, slope_estimate: float) -> int | None:
    """Largest size whose extrapolated peak stays <= ``ceiling``, from the ``ok`` trials' peaks.

    Two or more ``ok`` trials: the line through the two largest (the secant closest to the limit).
    One: that point with ``slope_estimate`` (bytes per block). None without an ``ok`` trial or
    with a slope <= 0.
    """
    ok = sorted({(t.layers, t.peak) for t in trials if t.status == "ok" and t.peak is not None})
    if not ok:
        return None
    (n1, p1), (n2, p2) = ok[-2] if len(ok) > 1 else ok[-1], ok[-1]
    slope = (p2 - p1) / (n2 - n1) if n2 > n1 else slope_estimate
    if slope <= 0:
        return None
    return n2 + math.floor((ceiling - p2) / slope)


def next_candidate(lo: int, hi: int | None, guess: int | None, max_layers: int) -> int:
    """The next size to try given the bracket (``lo`` fits; ``hi`` goes over or None) and a prediction.

    Without ``hi``: the guess, but at least 1/8 above ``lo`` (twice ``lo`` without a guess), at most
    ``max_layers``. With ``hi``: the guess, at least ``lo + 1``; without a guess, or with one at or
    past ``hi`` (the line overshoots: peaks that curve upwards), the bracket's midpoint (geometric
    when ``hi > 4 lo``: the sizes may span orders of magnitude).
    """
    if hi is None:
        floor = lo + max(1, lo // 8)
        return min(max_layers, max(floor, guess if guess is not None else 2 * lo))
    if hi - lo < 2:
        raise ValueError(f"next_candidate: nothing lies between lo={lo} and hi={hi}")
    if guess is None or guess >= hi:  # no prediction, or one past a size known to go over
        guess = math.isqrt(lo * hi) if hi > 4 * lo else (lo + hi) // 2
    return min(hi - 1, max(lo + 1, guess))


PREDICTION_BOUND = 1 << 20  # blocks: the largest prediction reported


def _estimator_limit(
    base: float, estimate_bytes: Callable[[int], float], ceiling: int, max_layers: int
) -> int:
    """Largest n in 0..max_layers with base + estimate(n) <= ceiling (the estimate grows with n)."""
    if base + estimate_bytes(max_layers) <= ceiling:
        return max_layers
    lo, hi = 0, max_layers
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if base + estimate_bytes(mid) <= ceiling else (lo, mid)
    return lo


def _largest_clean_ok(trials: list[Trial], below: int) -> int:
    """The largest size under ``below`` that ran ``ok`` and never went over (0 if none)."""
    over = {t.layers for t in trials if t.status == "over"}
    return max(
        (t.layers for t in trials if t.status == "ok" and t.layers < below and t.layers not in over),
        default=0,
    )


def search_limit(
    run_trial: Callable[[int], Trial],
    *,
    ceiling: int,
    estimate_bytes: Callable[[int], float],
    max_layers: int,
    tolerance: float = 0.0,
    confirm: int = 0,
    log: Callable[[str], None] = print,
) -> SearchResult:
    """Find the largest size (1..``max_layers``) whose trial is ``ok``. See [Note: largest-model search].

    ``estimate_bytes(n)``: the estimator's bytes of the job at ``n`` blocks (model states and
    activations, all ranks); only its differences matter (the 1-block trial supplies the fixed cost).
    ``confirm``: runs of the limit beyond the first that must also be ``ok`` (peaks vary a little
    from run to run); one that goes over makes that size the new upper end of the bracket.
    """
    if max_layers < 1 or tolerance < 0 or ceiling <= 0 or confirm < 0:
        raise ValueError(
            "search_limit: need max_layers >= 1, tolerance >= 0, ceiling > 0, confirm >= 0; got "
            f"{max_layers}, {tolerance}, {ceiling}, {confirm}"
        )
    trials = [run_trial(1)]
    if trials[0].status != "ok":
        return SearchResult(0, "memory" if trials[0].status == "over" else trials[0].status, None, trials)
    # the estimator's own limit, not capped by max_layers (the results show it beside the measured
    # one); the search itself never asks for more than max_layers (next_candidate caps its guesses)
    prediction = _estimator_limit(
        trials[0].peak - estimate_bytes(1), estimate_bytes, ceiling, PREDICTION_BOUND
    )
    slope = (estimate_bytes(max_layers) - estimate_bytes(1)) / max(1, max_layers - 1)
    lo, hi, guess, stalls = 1, None, prediction, 0
    while True:
        closed = hi is not None and hi - lo <= max(1, math.floor(tolerance * lo))
        if closed or (hi is None and lo >= max_layers):
            if sum(1 for t in trials if t.layers == lo and t.status == "ok") > confirm:
                return SearchResult(lo, "memory" if closed else "cap", prediction, trials)
            n, bisect, confirming = lo, False, True  # run the limit once more
            log(f"  confirming {lo}")
        else:
            bisect, confirming = stalls >= 2, False
            n = next_candidate(lo, hi, None if bisect else guess, max_layers)
            log(
                f"  bracket [{lo}, {hi if hi is not None else '?'}), next {n}{' (bisection)' if bisect else ''}"
            )
        gap = None if hi is None else hi - lo
        trials.append(t := run_trial(n))
        if t.status == "ok":
            lo = max(lo, n)
        elif t.status == "over":
            hi = n if hi is None else min(hi, n)
            lo = _largest_clean_ok(trials, hi)
            if lo == 0:
                return SearchResult(0, "memory", prediction, trials)
        else:
            return SearchResult(lo, t.status, prediction, trials)
        # two predicted sizes in a row that did not halve the bracket: the next step bisects
        predicted = not confirming and not bisect and guess is not None
        stalls = stalls + 1 if predicted and gap is not None and hi - lo > gap / 2 else 0
        fits = sum(1 for x in trials if x.status == "ok")
        # one fitting size and a failing one: the estimator's slope was wrong, bisect instead
        guess = fit_prediction(trials, ceiling, slope) if fits >= 2 or hi is None else None
