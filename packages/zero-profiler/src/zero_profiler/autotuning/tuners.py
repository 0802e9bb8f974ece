"""The tuners: in which order (and how far) to explore a stage's candidates.

``tuner_type`` (DeepSpeed's names):

* ``gridsearch``: every candidate, in order (micro-batch sizes from the largest down);
* ``random``: the candidates in a seeded random order;
* ``model_based``: a cost model fitted to every finished experiment picks the next candidate
  (see [Note: autotuning cost model]). The unmeasured candidate with the highest prediction runs
  next, and the tuner stops as soon as no unmeasured candidate of the stage is predicted to beat
  the stage's best measured score (no expected gain). With fewer than two measured points in
  all it takes a coordinate step: the candidate at the best point's micro-batch size closest (in
  features) to it, i.e. one knob changed. DeepSpeed's model-based tuner fits XGBoost on similar
  features; a linear model is enough for the few (<= tens) points of one search and needs no
  extra dependency.

[Note: autotuning cost model]
The model is a least-squares fit (small ridge term) of log(score) (of -score for latency) on:
one level per ZeRO stage, log2 micro-batch (and its square once four points are measured),
and for every knob log2 of its value or 0/1 for a flag (0 where a stage has no such knob). It is fitted on the points of the stage being tuned *and* of the stages tuned before
(``prior``): the stage levels absorb what a stage costs, while the micro-batch and knob effects
are shared, so what the first stage taught (e.g. that the larger bucket is faster) lets a later
stage stop after its probe instead of measuring every knob again. The log makes those shared
effects ratios (a bucket 10% faster at every stage), which is how they behave. With points at a
single micro-batch size, the ridge (minimum-norm) solution shares each level between the stage
level and log2(micro-batch), so the model then assumes the score grows with the micro-batch
(true of throughput until memory runs out; a point at another size corrects it): a stage whose
largest micro-batch ran does not measure the smaller ones.

All stop after ``tuner_num_trials`` experiments, or after ``tuner_early_stopping`` experiments in
a row that did not beat the best so far. Points measured before the tuner started (the
micro-batch probes) count as measured, at no cost; ``prior`` (points of other stages) only
informs the cost model.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from zero_profiler.autotuning.space import Candidate, features, knob_feature

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
        prior: dict[Candidate, float | None] | None = None,
    ) -> None:
        self.candidates = list(candidates)
        self.measured = dict(measured)
        self.prior = {c: s for c, s in (prior or {}).items() if c not in self.measured}
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
    """Least-squares cost model over every measured point (See [Note: autotuning cost model])."""

    def next_candidate(self, pending: list[Candidate]) -> Candidate | None:
        own = [(c, s) for c, s in self.measured.items() if s is not None]
        points = own + [(c, s) for c, s in self.prior.items() if s is not None]
        if not points:
            return self.rng.choice(pending)
        if len(points) < 2:  # coordinate step from the best point: a knob first, else the micro-batch
            best_cand = max(points, key=lambda p: p[1])[0]
            origin = features(best_cand)
            same_mbs = [c for c in pending if c.mbs == best_cand.mbs] or pending
            return min(
                same_mbs, key=lambda c: sum((a - b) ** 2 for a, b in zip(features(c), origin, strict=False))
            )
        stages = sorted({c.stage for c, _ in points} | {c.stage for c in pending})
        names = sorted({k for c, _ in points for k, _ in c.knobs} | {k for c in pending for k, _ in c.knobs})
        quad = len(points) >= 4

        def row(c: Candidate) -> list[float]:
            return _design(c, stages, names, quad)

        transform = _score_transform([s for _, s in points])
        x = torch.tensor([row(c) for c, _ in points], dtype=torch.float64)
        y = torch.tensor([transform(s) for _, s in points], dtype=torch.float64)
        ridge = 1e-3 * torch.eye(x.shape[1], dtype=torch.float64)
        coef = torch.linalg.solve(x.T @ x + ridge, x.T @ y)
        preds = torch.tensor([row(c) for c in pending], dtype=torch.float64) @ coef
        own_scores = [transform(s) for _, s in own]
        if own_scores and float(preds.max()) <= max(own_scores):
            return None  # no candidate is expected to beat the stage's best measured one
        return pending[int(torch.argmax(preds))]


def _score_transform(scores: list[float]) -> Callable[[float], float]:
    """What the model fits, increasing in the score: log(score) for positive scores (throughput,
    FLOPS), -log(-score) for negative ones (latency, negated), the score over its largest size
    where both occur (not a metric of ours)."""
    if all(s > 0 for s in scores):
        return math.log
    if all(s < 0 for s in scores):
        return lambda s: -math.log(-s)
    size = max(abs(s) for s in scores) or 1.0
    return lambda s: s / size


def _design(cand: Candidate, stages: list[int], knob_names: list[str], quadratic: bool) -> list[float]:
    """The cost model's features of ``cand`` (See [Note: autotuning cost model])."""
    row = [1.0 if cand.stage == s else 0.0 for s in stages]
    m = math.log2(cand.mbs)
    row.append(m)
    if quadratic:
        row.append(m * m)
    knobs = dict(cand.knobs)
    row += [knob_feature(knobs[name]) if name in knobs else 0.0 for name in knob_names]
    return row


TUNERS: dict[str, type[Tuner]] = {
    "gridsearch": GridSearchTuner,
    "random": RandomTuner,
    "model_based": ModelBasedTuner,
}
