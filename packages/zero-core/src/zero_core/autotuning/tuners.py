"""The tuners: in which order (and how far) to explore a stage's candidates.

``tuner_type`` (DeepSpeed's names):

* ``gridsearch``: every candidate, in order (micro-batch sizes from the largest down);
* ``random``: the candidates in a seeded random order;
* ``model_based``: a cost model fitted to the measured points picks the next candidate. The
  model is a least-squares fit (small ridge term) of the score on the features of
  :func:`zero_core.autotuning.space.features` (log2 micro-batch, log2 bucket sizes, flags),
  plus the square of log2 micro-batch once four points are measured; the unmeasured candidate
  with the highest prediction runs next, and the tuner stops as soon as no unmeasured candidate
  is predicted to beat the best measured score (no expected gain). With fewer than two measured
  points it takes a coordinate step: the candidate at the best point's micro-batch size closest
  (in features) to it, i.e. one knob changed. With points at a single micro-batch size, the ridge (minimum-norm)
  solution shares the level between the intercept and log2(micro-batch), so the model then
  assumes the score grows with the micro-batch (true of throughput until memory runs out; a
  point at another size corrects it). DeepSpeed's model-based tuner fits XGBoost on similar
  features; a linear model is enough for the few (<= tens) points of one stage and needs no
  extra dependency.

All stop after ``tuner_num_trials`` experiments, or after ``tuner_early_stopping`` experiments in
a row that did not beat the best so far. Points measured before the tuner started (the
micro-batch probes) count as measured, at no cost.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from zero_core.autotuning.space import Candidate, features

Evaluate = Callable[[Candidate], float | None]


class Tuner:
    """Base: drives ``evaluate`` over ``candidates``; subclasses choose the next candidate."""

    def __init__(
        self,
        candidates: list[Candidate],
        measured: dict[Candidate, float | None],
        num_trials: int,
        early_stopping: int,
        seed: int = 0,
    ) -> None:
        self.candidates = list(candidates)
        self.measured = dict(measured)
        self.num_trials = num_trials
        self.early_stopping = early_stopping
        self.rng = random.Random(seed)

    def next_candidate(self, pending: list[Candidate]) -> Candidate | None:
        """The next candidate to run, or None to stop."""
        return pending[0]

    def run(self, evaluate: Evaluate) -> None:
        scores = [s for s in self.measured.values() if s is not None]
        best = max(scores) if scores else None
        trials = without_gain = 0
        while trials < self.num_trials and without_gain < self.early_stopping:
            pending = [c for c in self.candidates if c not in self.measured]
            if not pending:
                return
            cand = self.next_candidate(pending)
            if cand is None:
                return
            score = evaluate(cand)
            self.measured[cand] = score
            trials += 1
            if score is not None and (best is None or score > best):
                best, without_gain = score, 0
            else:
                without_gain += 1


class GridSearchTuner(Tuner):
    """Every candidate in the given order."""


class RandomTuner(Tuner):
    def next_candidate(self, pending: list[Candidate]) -> Candidate:
        return self.rng.choice(pending)


class ModelBasedTuner(Tuner):
    """Least-squares cost model over the measured points (see module doc)."""

    def next_candidate(self, pending: list[Candidate]) -> Candidate | None:
        points = [(c, s) for c, s in self.measured.items() if s is not None]
        if not points:
            return self.rng.choice(pending)
        best_cand, best = max(points, key=lambda p: p[1])
        if len(points) < 2:  # coordinate step from the best point: a knob first, else the micro-batch
            origin = features(best_cand)
            same_mbs = [c for c in pending if c.mbs == best_cand.mbs] or pending
            return min(
                same_mbs, key=lambda c: sum((a - b) ** 2 for a, b in zip(features(c), origin, strict=False))
            )
        x = torch.tensor([self._design(c, len(points)) for c, _ in points], dtype=torch.float64)
        y = torch.tensor([s for _, s in points], dtype=torch.float64)
        scale = y.abs().max().clamp_min(1e-12)
        ridge = 1e-3 * torch.eye(x.shape[1], dtype=torch.float64)
        coef = torch.linalg.solve(x.T @ x + ridge, x.T @ (y / scale))
        preds = torch.tensor([self._design(c, len(points)) for c in pending], dtype=torch.float64) @ coef
        if float(preds.max()) * float(scale) <= best:
            return None  # no candidate is expected to beat the best measured one
        return pending[int(torch.argmax(preds))]

    @staticmethod
    def _design(cand: Candidate, n_points: int) -> list[float]:
        f = features(cand)
        row = [1.0, *f]
        if n_points >= 4:
            row.append(f[0] ** 2)
        return row


TUNERS: dict[str, type[Tuner]] = {
    "gridsearch": GridSearchTuner,
    "random": RandomTuner,
    "model_based": ModelBasedTuner,
}
