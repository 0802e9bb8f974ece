"""The search behind ``zero run --autotuning tune|run``.

[Note: autotuning search]
The autotuner finds the fastest configuration that fits, as DeepSpeed's does, in four steps:

1. **Model information.** The parameter count comes from ``autotuning.model_info.num_params``,
   from ``model_info_path``, or from one launch of the script (ZeRO stage 3, smallest
   micro-batch) whose engine writes it and exits (``results_dir/profile_model_info/``).
2. **Pruning by memory.** Each stage's model-state bytes per device (``memory.py``: the ZeRO
   paper's formula, zero-profiler's estimator) are compared with the memory budget
   (the device's free memory, host RAM available per rank on the CPU accelerator, or the
   override of ``autotuning.memory_budget`` / ``ZERO_AUTOTUNING_MEMORY_BUDGET``). A stage whose
   model states do not fit is never launched; on a GPU it is kept with its optimizer states
   offloaded to the CPU when that makes it fit (on the CPU accelerator the host memory is the
   device memory, so offloading frees nothing there).
3. **Largest micro-batch per stage.** Short real runs: the largest size allowed (the section's
   max, bounded by ``max_train_batch_size`` and by the activation memory per sample measured in
   earlier experiments) first; if it runs out of memory (an OOM error, or a measured peak above
   the budget: see [Note: autotuning experiments]), the smallest, then a binary search between.
4. **Tuning the stage.** ``num_tuning_micro_batch_sizes`` sizes up to that largest one, times the
   stage's knob values (see ``space.py``; with ``fast: true``, DeepSpeed's default, micro-batch
   sizes only), explored by the ``tuner_type`` (see ``tuners.py``; ``model_based`` fits its
   cost model on the experiments of the stages before too, see [Note: autotuning cost model]).
   The probes of step 3 run with the knob values of the best experiment so far. Stages run from
   0 up; except with ``gridsearch``, a stage whose best is below the best of the stages before
   it ends the search (higher stages only add communication), as DeepSpeed's fast mode does.
5. **Confirming the pick.** The ``confirm_top_k`` best candidates run again over a longer
   window, interleaved, and the best median wins (see [Note: autotuning confirm phase] in
   ``confirm.py``): one short noisy measurement does not decide the search.

Every experiment's record is kept in ``exps_dir``; a restarted search with the same directories
reuses every finished experiment (``overwrite: true`` reruns them). The best experiment's config
becomes ``results_dir/ds_config_optimal.json`` with its command in ``cmd_optimal.txt``; see
``report.py`` for the rest of the output.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

from zero_profiler.autotuning.confirm import ConfirmOutcome, run_confirm_phase
from zero_profiler.autotuning.experiment import (
    ExperimentResult,
    ExperimentRunner,
    config_arg_index,
    launcher_prefix,
    with_config,
    with_mapped_args,
)
from zero_profiler.autotuning.memory import device_is_cpu, device_memory_budget, model_states_bytes
from zero_profiler.autotuning.report import PLOT_NAME, Progress, write_best, write_plot, write_summary
from zero_profiler.autotuning.space import (
    Candidate,
    batch_fits,
    build_space,
    experiment_config,
    experiment_name,
    micro_batch_candidates,
)
from zero_profiler.autotuning.tuners import TUNERS

if TYPE_CHECKING:
    from zero_core.config.builtin_sections import AutotuningConfig


class AutotuningError(RuntimeError):
    """The search cannot start (bad config or arguments)."""


def _load_section(raw: object) -> AutotuningConfig:
    from pydantic import ValidationError
    from zero_core.config.builtin_sections import AutotuningConfig

    if not isinstance(raw, dict):
        raise AutotuningError(f"autotuning: expected an object, got {raw!r}")
    from zero_core.config.unknown_keys import strip_unknown_keys

    # a misspelt key (``confirm_topk``) is warned about here too, where the search reads it, not
    # only in the experiments' logs (as the engine's config parsing does)
    strip_unknown_keys(raw, AutotuningConfig, "autotuning", "warn", [])
    try:
        section = AutotuningConfig.model_validate(raw)
    except ValidationError as exc:
        raise AutotuningError(f"autotuning section: {exc}") from None
    if section.end_profile_step <= section.start_profile_step:
        raise AutotuningError(
            f"autotuning: end_profile_step ({section.end_profile_step}) must be greater than "
            f"start_profile_step ({section.start_profile_step})"
        )
    if section.min_train_micro_batch_size_per_gpu > section.max_train_micro_batch_size_per_gpu:
        raise AutotuningError(
            "autotuning: min_train_micro_batch_size_per_gpu > max_train_micro_batch_size_per_gpu"
        )
    return section


def _world_size(args: argparse.Namespace, mp_size: int) -> tuple[int, int]:
    """(data-parallel world size, ranks per node)."""
    nproc = int(args.nproc or 1)
    nnodes = str(args.nnodes or "1").split(":")[-1]
    if not nnodes.isdigit():
        raise AutotuningError(f"zero run --autotuning: --nnodes {args.nnodes!r} is not a node count")
    total = nproc if args.launcher == "mpi" else nproc * int(nnodes)
    if total % mp_size:
        raise AutotuningError(f"autotuning.mp_size {mp_size} does not divide the {total} processes")
    return total // mp_size, nproc


class Autotuner:
    """One search over the configs of ``args`` (the parsed ``zero run`` arguments)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        try:
            i = config_arg_index(args.script_args)
        except ValueError as exc:
            raise AutotuningError(str(exc)) from None
        arg = args.script_args[i]
        path = arg.split("=", 1)[1] if "=" in arg else args.script_args[i + 1]
        try:
            with open(path) as f:
                self.user = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise AutotuningError(f"zero run --autotuning: cannot read the config {path!r}: {exc}") from None
        self.section = _load_section(self.user.get("autotuning", {}))
        self.metric = self.section.metric  # 'flops': the flops profiler is this package's own
        self.world, ranks_per_node = _world_size(args, self.section.mp_size)
        self.budget, self.budget_source = device_memory_budget(self.section, ranks_per_node)
        self.results_dir = os.path.abspath(self.section.results_dir)
        self.runner = ExperimentRunner(
            launcher_prefix(args),
            list(args.script_args),
            self.section,
            self.budget,
            os.path.abspath(self.section.exps_dir),
            self.results_dir,
        )
        self.mixed = any(bool((self.user.get(k) or {}).get("enabled")) for k in ("fp16", "bf16"))
        self.results: list[ExperimentResult] = []
        self.scores: dict[Candidate, float | None] = {}
        self.pruned: list[str] = []
        self.notes: list[str] = []
        if self.section.metric_path:  # the engine's key: every experiment gets its own (see experiment.py)
            self.notes.append(
                f"autotuning.metric_path {self.section.metric_path!r} is not used by the search: each "
                "experiment's engine writes results_dir/<experiment>/metrics.json"
            )
            print(f"[autotuning] note: {self.notes[-1]}", file=sys.stderr, flush=True)
        self.per_sample_bytes = 0.0
        self.progress = Progress(0)
        self.confirmed = ConfirmOutcome()

    # -- step 1: model information ------------------------------------------------------
    def model_info(self) -> dict[str, Any]:
        info = dict(self.section.model_info or {})
        if info.get("num_params"):
            return info
        path = self.section.model_info_path or os.path.join(
            self.results_dir, "profile_model_info", "model_info.json"
        )
        if not os.path.isfile(path) or self.section.overwrite:
            self._profile_model_info(path)
        with open(path) as f:
            return json.load(f)

    def _profile_model_info(self, path: str) -> None:
        stages = build_space(self.user, self.section, 1).stages
        cand = Candidate(3 if 3 in stages else max(stages), self.section.min_train_micro_batch_size_per_gpu)
        space = build_space(self.user, self.section, 1)
        config = experiment_config(self.user, space, cand, self.world)
        out_dir = os.path.dirname(os.path.abspath(path))
        os.makedirs(out_dir, exist_ok=True)
        extra = {"model_info": {"profile": True}, "model_info_path": os.path.abspath(path)}
        name = "profile_model_info"
        exp_config = {
            **config,
            "autotuning": {"enabled": True, "metric_path": os.path.join(out_dir, "metrics.json"), **extra},
        }
        config_path = os.path.join(out_dir, "ds_config.json")
        from zero_profiler.autotuning.engine_hook import write_json_atomic

        write_json_atomic(config_path, exp_config)
        print(f"[autotuning] profiling the model (one launch at ZeRO stage {cand.stage}) ...", flush=True)
        status, reason = self.runner._launch(
            self.runner.command(config_path, exp_config), os.path.join(out_dir, "output.log"), name
        )
        if not os.path.isfile(path):
            raise AutotuningError(
                f"zero run --autotuning: the model-information launch wrote no {path} ({status} {reason}); "
                f"see {os.path.join(out_dir, 'output.log')}, or give autotuning.model_info.num_params"
            )

    # -- step 2: pruning ----------------------------------------------------------------
    def prune(self, stages: list[int], num_params: int) -> list[tuple[int, bool]]:
        kept: list[tuple[int, bool]] = []
        for stage in stages:
            need = model_states_bytes(num_params, self.world, stage, self.mixed)
            if need <= self.budget:
                kept.append((stage, False))
                continue
            if stage > 0 and not device_is_cpu():
                offloaded = model_states_bytes(
                    num_params, self.world, stage, self.mixed, offload_optimizer=True
                )
                if offloaded <= self.budget:
                    kept.append((stage, True))
                    self.notes.append(f"stage {stage}: optimizer states offloaded to the CPU to fit")
                    continue
            self.pruned.append(
                f"stage {stage} (model states {need / 2**20:.1f} MiB > budget {self.budget / 2**20:.1f} MiB)"
            )
        return kept

    # -- experiments ----------------------------------------------------------------------
    def evaluate(self, cand: Candidate) -> float | None:
        if cand in self.scores:
            return self.scores[cand]
        config = experiment_config(self.user, self.space, cand, self.world)
        result = self.runner.run(cand, experiment_name(cand, config), config, {})
        self.results.append(result)
        score = result.score(self.metric)
        self.scores[cand] = score
        if result.status == "ok" and result.memory:
            states = model_states_bytes(self.num_params, self.world, cand.stage, self.mixed, cand.offload)
            self.per_sample_bytes = max(self.per_sample_bytes, max(0.0, result.memory - states) / cand.mbs)
        self.progress.update(result, self.metric)
        self._write_summary(None, None)
        return score

    def _largest_fitting(self, stage: int, offload: bool, sizes: list[int], knobs: tuple) -> int | None:
        """Largest of ``sizes`` (ascending) that runs: the largest first, then the smallest, then a
        binary search between the last that ran and the first that did not."""
        states = model_states_bytes(self.num_params, self.world, stage, self.mixed, offload)
        if self.per_sample_bytes > 0:  # what the memory measured so far says fits
            room = (self.budget - states) / self.per_sample_bytes
            sizes = [m for m in sizes if m <= room] or sizes[:1]
        hi = len(sizes) - 1
        if self.evaluate(Candidate(stage, sizes[hi], knobs, offload)) is not None:
            return sizes[hi]
        if hi == 0 or self.evaluate(Candidate(stage, sizes[0], knobs, offload)) is None:
            return None
        lo = 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.evaluate(Candidate(stage, sizes[mid], knobs, offload)) is not None:
                lo = mid
            else:
                hi = mid
        return sizes[lo]

    def _probe_knobs(self, combos: list[tuple]) -> tuple:
        """The knobs a stage's micro-batch probes run with: those of the best experiment so far
        where this stage tunes the same knobs (what earlier stages found carries over, so the
        probe is likely the stage's best already), else the stage's first combination."""
        ok = [(s, c) for c, s in self.scores.items() if s is not None]
        if ok:
            best = dict(max(ok, key=lambda p: p[0])[1].knobs)
            for combo in combos:
                if all(best.get(k, v) == v for k, v in combo) and any(k in best for k, _ in combo):
                    return combo
        return combos[0]

    def tune_stage(self, stage: int, offload: bool) -> float | None:
        combos = self.space.knob_combos(stage) or [()]
        sec = self.section
        if self.space.mbs_fixed is not None:
            sizes = [self.space.mbs_fixed]
        else:
            lo, hi = sec.min_train_micro_batch_size_per_gpu, sec.max_train_micro_batch_size_per_gpu
            sizes = [m for m in range(lo, hi + 1) if batch_fits(self.space, m, self.world, sec)]
        if not sizes:
            self.notes.append(
                f"stage {stage}: no micro-batch size gives a train batch within the section's bounds"
            )
            return None
        largest = self._largest_fitting(stage, offload, sizes, self._probe_knobs(combos))
        if largest is None:
            self.notes.append(f"stage {stage}: not even micro-batch {sizes[0]} ran (see the table)")
            return None
        mbs_list = [
            m
            for m in micro_batch_candidates(sizes[0], largest, sec.num_tuning_micro_batch_sizes)
            if m in sizes
        ]
        cands = [Candidate(stage, m, k, offload) for m in sorted(mbs_list, reverse=True) for k in combos]
        measured = {c: self.scores[c] for c in cands if c in self.scores}
        prior = {c: s for c, s in self.scores.items() if c.stage != stage}
        tuner = TUNERS[sec.tuner_type](
            cands, measured, sec.tuner_num_trials, sec.tuner_early_stopping, seed=stage, prior=prior
        )
        tuner.run(self.evaluate)
        scores = [s for c, s in self.scores.items() if c.stage == stage and s is not None]
        return max(scores) if scores else None

    # -- the whole search -------------------------------------------------------------------
    def tune(self) -> ExperimentResult | None:
        """Run the search; returns the best experiment (None when nothing ran) and writes the results."""
        os.makedirs(self.results_dir, exist_ok=True)
        info = self.model_info()
        self.num_params = max(1, int(int(info["num_params"]) / self.section.mp_size))
        self.space = build_space(self.user, self.section, self.num_params)
        self.notes.append(
            f"{self.num_params:,} parameters per model-parallel rank, data-parallel world size {self.world}, "
            f"memory budget {self.budget / 2**20:.1f} MiB per rank ({self.budget_source}), metric {self.metric}, "
            f"tuner {self.section.tuner_type}, fast {self.section.fast}"
        )
        stages = self.prune(self.space.stages, self.num_params)
        # the progress bar's total: about two probes plus the tuner's trials per stage
        widest = max([len(self.space.knob_combos(s)) for s, _ in stages] + [1])
        per_stage = 2 + min(self.section.tuner_num_trials, self.section.num_tuning_micro_batch_sizes * widest)
        self.progress = Progress(per_stage * len(stages) + self.section.confirm_top_k)
        best = None
        for stage, offload in stages:
            stage_best = self.tune_stage(stage, offload)
            if stage_best is None:
                continue
            if best is not None and stage_best < best and self.section.tuner_type != "gridsearch":
                self.notes.append(
                    f"stage {stage}'s best is below the stages before it: higher stages not explored"
                )
                break
            best = stage_best if best is None else max(best, stage_best)
        self.confirm()
        return self.finish()

    # -- step 5: the confirm phase ------------------------------------------------------------
    def confirm(self) -> None:
        """Re-measure the best candidates (See [Note: autotuning confirm phase])."""
        sec = self.section
        self.confirmed = run_confirm_phase(
            self.results,
            self.metric,
            sec.confirm_top_k,
            sec.start_profile_step,
            sec.end_profile_step,
            self._run_confirm,
        )
        if self.confirmed.note:
            self.notes.append(self.confirmed.note)
            print(f"[autotuning] note: {self.confirmed.note}", file=sys.stderr, flush=True)

    def _run_confirm(self, cand: Candidate, search: ExperimentResult, rnd: int, end: int) -> ExperimentResult:
        config = experiment_config(self.user, self.space, cand, self.world)
        name = f"{search.name}_confirm{rnd}"
        result = self.runner.run(cand, name, config, {"end_profile_step": end}, phase="confirm")
        self.results.append(result)
        self.progress.update(result, self.metric)
        self._write_summary(None, None)
        return result

    def best_result(self) -> ExperimentResult | None:
        """The confirm phase's pick; without one, the best search measurement."""
        if self.confirmed.pick is not None:
            return self.confirmed.pick
        ok = [r for r in self.results if r.phase == "search" and r.score(self.metric) is not None]
        return max(ok, key=lambda r: r.score(self.metric)) if ok else None

    def optimal_command(self, config_path: str, config: dict[str, Any]) -> list[str]:
        prefix = launcher_prefix(self.args)
        prefix = ["zero", "run", *prefix[4:]]
        args = with_mapped_args(
            with_config(self.args.script_args, config_path), self.section.arg_mappings, config
        )
        return [*prefix, *args]

    def _write_summary(self, best: ExperimentResult | None, command: str | None) -> None:
        write_summary(
            os.path.join(self.results_dir, "summary.md"),
            self.results,
            best,
            self.metric,
            self.pruned,
            self.notes,
            command,
            self.confirmed,
        )

    def finish(self) -> ExperimentResult | None:
        best = self.best_result()
        command = None
        if best is not None:
            cand = Candidate(best.stage, best.mbs, tuple(sorted(best.knobs.items())), best.offload)
            config = experiment_config(self.user, self.space, cand, self.world)
            self.optimal_config_path = os.path.join(self.results_dir, "ds_config_optimal.json")
            command = write_best(
                self.results_dir, config, self.optimal_command(self.optimal_config_path, config)
            )
        why_no_plot = write_plot(os.path.join(self.results_dir, PLOT_NAME), self.results, self.metric)
        if why_no_plot:
            self.notes.append(why_no_plot)
        self._write_summary(best, command)
        launched = self.runner.launched
        print(
            f"[autotuning] done: {len(self.results)} experiments ({launched} launched, "
            f"{len(self.results) - sum(1 for r in self.results if not r.reused)} reused), "
            f"summary {os.path.join(self.results_dir, 'summary.md')}",
            flush=True,
        )
        if best is not None:
            print(
                f"[autotuning] best: {best.name}, {best.metric:.4g} {self.metric}; run it with:\n  {command}",
                flush=True,
            )
        else:
            print("[autotuning] no experiment succeeded: no configuration fits", file=sys.stderr, flush=True)
        return best


def autotune(args: argparse.Namespace) -> int:
    """``zero run --autotuning tune|run``: search, write the results; with ``run``, launch the best."""
    tuner = Autotuner(args)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        tuner.runner.stop()  # the experiment runs in its own session: end it too
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        best = tuner.tune()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if best is None:
        return 1
    if args.autotuning == "run":
        from zero_core.launcher.run import run_job

        final = copy.copy(args)
        final.autotuning = None
        with open(tuner.optimal_config_path) as f:
            optimal = json.load(f)
        final.script_args = with_mapped_args(
            with_config(args.script_args, tuner.optimal_config_path), tuner.section.arg_mappings, optimal
        )
        print(f"[autotuning] launching the job with {tuner.optimal_config_path}", flush=True)
        return run_job(final)
    return 0
