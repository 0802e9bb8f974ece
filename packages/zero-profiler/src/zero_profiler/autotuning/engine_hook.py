"""The engine's side of an autotuning experiment: measure, write ``metric_path``, exit early.

[Note: autotuning experiments]
Every experiment of the autotuner (``zero run --autotuning tune|run``) is a real launch of the
user's script with a config the autotuner wrote. That config carries an ``autotuning`` section
with ``enabled: true`` and a ``metric_path``; zero-core's ``initialize`` then adds this module's
step hook to the engine (``zero_core/engine/autotuning_experiment.py``, the seam: zero-core imports
nothing of the autotuner), and, as DeepSpeed's engine does, the engine

* records the wall clock and the global sample count after optimizer step ``start_profile_step``
  and after every step up to ``end_profile_step``, and writes ``{"throughput": samples/s,
  "latency": s/step, "FLOPS_per_gpu": ..., "memory": peak bytes, "mbs": ...}`` as JSON to
  ``metric_path`` (rank 0, atomically), then ends the process (every rank, exit status 0), so
  the script's own loop never runs past the measurement. ``throughput`` and ``latency`` are
  those of the window's median step (by time; the slower middle one for an even count; every
  step's samples/s is in ``step_throughputs``), not the window's mean: one step slowed by
  something else on the machine (another job, a page fault, a garbage collection) then does not
  decide the experiment, which matters because the search compares experiments a few percent
  apart (``throughput_window`` keeps the mean);
* with ``metric: flops``, takes the FLOPs of one training step (forward and backward) from
  zero-profiler's flops profiler (the experiment's config profiles the step just before the
  window, so the profiler's overhead is not timed) and reports ``FLOPS_per_gpu`` = those FLOPs /
  the median step time of the window;
* with ``model_info.profile: true`` (the autotuner's first launch), writes the model's parameter
  counts to ``model_info_path`` right after ``initialize`` and ends the process.

Memory is the largest over the ranks of the accelerator's peak: ``max_memory_allocated`` on a
GPU; on the CPU accelerator that counter is the process's peak RSS, which also holds the
interpreter and its libraries (hundreds of MB that training does not use), so there the engine
reports the peak RSS minus what the process held before ``initialize`` other than the model's
own parameters and buffers: the model states, activations and buffers training added. The
autotuner compares that figure with its memory budget; above it, the experiment counts as
out of memory (see [Note: autotuning search] in ``autotuner.py``). The baseline is taken by
zero-core at the start of ``initialize`` (``experiment_baseline``), before anything is built.

A config with ``autotuning.enabled`` but no ``metric_path`` (a user's config copied from a
DeepSpeed job) trains normally, with a warning that the search is run by ``zero run
--autotuning``: zero-core says so without this module, so such a config runs with zero-core alone.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

import torch
from zero_core import comm
from zero_core.checkpoint.atomic import atomic_write_json
from zero_core.engine.autotuning_experiment import EXPERIMENT_ENV

if TYPE_CHECKING:
    from zero_core.config.builtin_sections import AutotuningConfig
    from zero_core.engine.engine import ZeroEngine

__all__ = ["EXPERIMENT_ENV", "AutotuningMetricHook", "build_autotuning_hook", "write_json_atomic"]


def write_json_atomic(path: str, data: object) -> None:
    """Write ``data`` as JSON to ``path`` (its folder made if missing) through zero-core's one
    atomic writer: see [Note: one atomic writer] in ``checkpoint/atomic.py``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_json(path, data)


def _peak_memory_bytes(baseline: int) -> int:
    from zero_core.accelerator import get_accelerator

    acc = get_accelerator()
    return max(0, int(acc.max_memory_allocated()) - baseline)


def _max_over_ranks(value: float, device: torch.device) -> float:
    if not comm.is_initialized() or comm.get_world_size() == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    comm.all_reduce(t, op=comm.ReduceOp.MAX)
    return float(t.item())


def _end_process() -> None:
    """Every rank leaves here together, as DeepSpeed's engine ends an experiment with exit().

    ``os._exit``, not ``SystemExit``: the measurement is written, and tearing the job down
    normally can abort a rank (a communication thread of an overlapping stage still joinable
    when the interpreter unwinds: "terminate called without an active exception", SIGABRT),
    which would turn a measured experiment into a failed one."""
    if comm.is_initialized():
        comm.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class AutotuningMetricHook:
    """Engine step hook that measures the window between the two profile steps.

    Built by :func:`build_autotuning_hook`; see [Note: autotuning experiments].
    """

    def __init__(self, section: AutotuningConfig, engine: ZeroEngine, baseline_bytes: int) -> None:
        self.start = int(section.start_profile_step)
        self.end = int(section.end_profile_step)
        if self.end <= self.start:
            raise ValueError(
                f"autotuning: end_profile_step ({self.end}) must be greater than start_profile_step "
                f"({self.start})"
            )
        self.metric_path = str(section.metric_path)
        self.engine = engine
        self.baseline = baseline_bytes
        self._t0: float | None = None
        self._samples0 = 0
        self._last: tuple[float, int] = (0.0, 0)  # (time, global samples) at the previous step
        self._step_times: list[float] = []
        self._step_samples: list[int] = []

    def __call__(self, engine: ZeroEngine) -> None:
        step = engine.global_steps
        if step == self.start:
            self._mark_start(engine)
        elif self.start < step <= self.end and self._t0 is not None:
            self._mark_step(engine)
            if step == self.end:
                self._finish(engine)

    def _sync(self, engine: ZeroEngine) -> None:
        from zero_core.accelerator import get_accelerator

        get_accelerator().synchronize()
        if comm.is_initialized() and comm.get_world_size() > 1:
            comm.barrier()

    def _mark_start(self, engine: ZeroEngine) -> None:
        self._sync(engine)
        self._t0 = time.perf_counter()
        self._samples0 = engine.global_samples
        self._last = (self._t0, self._samples0)

    def _mark_step(self, engine: ZeroEngine) -> None:
        # the accelerator's queue drained, so the step's time is its real time; no barrier: the
        # step's collectives already keep the ranks together, and rank 0's clock is what is written
        from zero_core.accelerator import get_accelerator

        get_accelerator().synchronize()
        now, samples = time.perf_counter(), engine.global_samples
        self._step_times.append(max(now - self._last[0], 1e-9))
        self._step_samples.append(samples - self._last[1])
        self._last = (now, samples)

    def _finish(self, engine: ZeroEngine) -> None:
        self._sync(engine)
        elapsed = max(time.perf_counter() - float(self._t0 or 0.0), 1e-9)
        samples = engine.global_samples - self._samples0
        steps = self.end - self.start
        per_step = [n / t for n, t in zip(self._step_samples, self._step_times, strict=True)]
        # the median step (the slower middle one for an even count): its samples/s and its time,
        # so that throughput x latency is still the samples of a step
        mid = sorted(range(len(per_step)), key=lambda i: self._step_times[i])[len(per_step) // 2]
        step_time = self._step_times[mid]
        memory = _max_over_ranks(_peak_memory_bytes(self.baseline), engine.device)
        flops = getattr(engine.profiler, "last_step_flops", None) if engine.profiler is not None else None
        result = {
            "throughput": per_step[mid],
            "throughput_window": samples / elapsed,
            "step_throughputs": per_step,
            "latency": step_time,
            "FLOPS_per_gpu": (flops / step_time) if flops else None,
            "memory": int(memory),
            "elapsed": elapsed,
            "steps": steps,
            "samples": samples,
            "mbs": engine.train_micro_batch_size_per_gpu(),
            "gas": engine.gradient_accumulation_steps(),
            "world_size": engine.dp_world_size,
            "zero_stage": int(engine.config.zero_optimization.stage),
        }
        if engine.global_rank == 0:
            write_json_atomic(self.metric_path, result)
            print(
                f"[zero autotuning] wrote {self.metric_path}: {result['throughput']:.2f} samples/s, "
                f"{result['memory'] / 2**20:.1f} MiB peak",
                flush=True,
            )
        _end_process()


def build_autotuning_hook(
    section: AutotuningConfig, engine: ZeroEngine, info: dict[str, int], baseline_bytes: int
) -> AutotuningMetricHook:
    """The step hook of an autotuning experiment, for the ``autotuning`` config ``section`` of a
    launch with a ``metric_path`` (zero-core's ``attach_experiment_hook`` calls it; ``info``
    and ``baseline_bytes`` are its ``experiment_baseline``).

    With ``model_info.profile`` the model information is written and the process ends here."""
    model_info = getattr(section, "model_info", None) or {}
    if model_info.get("profile"):
        path = section.model_info_path or os.path.join(
            os.path.dirname(section.metric_path), "model_info.json"
        )
        if engine.global_rank == 0:
            write_json_atomic(path, info)
        _end_process()
    return AutotuningMetricHook(section, engine, baseline_bytes)
