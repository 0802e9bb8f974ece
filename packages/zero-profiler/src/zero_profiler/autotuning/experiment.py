"""One autotuning experiment: a real launch of the user's script through ``zero run``.

Files (DeepSpeed's layout): ``exps_dir/<name>.json`` describes the experiment and, once it has
ended, holds its result (the record a restarted search reuses, see [Note: autotuning search]);
``results_dir/<name>/`` holds its ``ds_config.json``, the ``metrics.json`` the engine wrote
(``metric_path``, see [Note: autotuning experiments]) and ``output.log`` (stdout and stderr).

An experiment ends as ``ok``, ``oom`` (an out-of-memory error, or a measured peak above the
budget), ``timeout`` (still running after ``experiment_timeout`` s: its whole process group is
terminated, then killed) or ``error`` (any other failure; the reason is the exception's last
line). Failures are results: the search goes on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from zero_profiler.autotuning.engine_hook import EXPERIMENT_ENV, write_json_atomic
from zero_profiler.autotuning.space import Candidate

if TYPE_CHECKING:
    import argparse

    from zero_core.config.builtin_sections import AutotuningConfig

#: the script flags that carry the config path (ours and DeepSpeed's)
CONFIG_FLAGS = ("--zero_config", "--deepspeed_config", "--zero-config", "--deepspeed-config")

#: metric name -> (key in metrics.json, higher is better)
METRICS = {
    "throughput": ("throughput", True),
    "latency": ("latency", False),
    "flops": ("FLOPS_per_gpu", True),
}


@dataclass
class ExperimentResult:
    """What one experiment gave (also its record in ``exps_dir``)."""

    name: str
    stage: int
    mbs: int
    knobs: dict[str, Any]
    offload: bool
    status: str  # ok | oom | timeout | error | running
    reason: str = ""
    metric: float | None = None
    memory: int | None = None
    wall_s: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    reused: bool = False
    #: "search", or "confirm" for a re-measurement (see [Note: autotuning confirm phase])
    phase: str = "search"

    def score(self, metric: str) -> float | None:
        """Higher is better (latency negated); None unless the experiment succeeded."""
        if self.status != "ok" or self.metric is None:
            return None
        return self.metric if METRICS[metric][1] else -self.metric


def config_arg_index(script_args: list[str]) -> int:
    """Index in ``script_args`` of the config path's flag (``--zero_config PATH`` or ``=PATH``)."""
    for i, arg in enumerate(script_args):
        flag = arg.split("=", 1)[0]
        if flag in CONFIG_FLAGS and ("=" in arg or i + 1 < len(script_args)):
            return i
    raise ValueError(
        "zero run --autotuning: the script's arguments carry no config path; give it as "
        f"{' or '.join(CONFIG_FLAGS[:2])} PATH (the autotuner replaces it for every experiment)"
    )


def with_config(script_args: list[str], path: str) -> list[str]:
    """``script_args`` with the config path replaced by ``path``."""
    out = list(script_args)
    i = config_arg_index(out)
    if "=" in out[i]:
        out[i] = f"{out[i].split('=', 1)[0]}={path}"
    else:
        out[i + 1] = path
    return out


def with_mapped_args(
    script_args: list[str], mappings: dict[str, str] | None, config: dict[str, Any]
) -> list[str]:
    """Apply ``arg_mappings`` ({config key: script flag}): set each flag to the config's value, as
    DeepSpeed does for scripts that take batch sizes on their command line."""
    out = list(script_args)
    for key, flag in (mappings or {}).items():
        if key not in config:
            raise ValueError(f"autotuning.arg_mappings: {key!r} is not a top-level key of the config")
        value = str(config[key])
        for i, arg in enumerate(out):
            if arg == flag and i + 1 < len(out):
                out[i + 1] = value
                break
            if arg.startswith(flag + "="):
                out[i] = f"{flag}={value}"
                break
        else:
            out += [flag, value]
    return out


def _failure_reason(log: str) -> tuple[str, str]:
    """(status, reason) of a failed launch from its output."""
    if re.search(r"out of memory|OutOfMemoryError|CUDA error: out of memory", log, re.IGNORECASE):
        return "oom", "out of memory"
    found = re.findall(r"^\s*(?:\w+\.)*\w*(?:Error|Exception|Interrupt)\b.*$", log, re.MULTILINE)
    if found:
        return "error", found[-1].strip()[:300]
    tail = [line for line in log.strip().splitlines() if line.strip()][-1:] or ["no output"]
    return "error", tail[0][:300]


class ExperimentRunner:
    """Launch experiments and keep their records (see the module doc)."""

    def __init__(
        self,
        launch_prefix: list[str],
        script_args: list[str],
        section: AutotuningConfig,
        budget: int,
        exps_dir: str,
        results_dir: str,
    ) -> None:
        config_arg_index(script_args)  # fail early with the clear message
        self.launch_prefix = launch_prefix
        self.script_args = script_args
        self.section = section
        self.budget = budget
        self.exps_dir = exps_dir
        self.results_dir = results_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.launched = 0
        os.makedirs(exps_dir, exist_ok=True)
        os.makedirs(results_dir, exist_ok=True)

    def command(self, config_path: str, config: dict[str, Any]) -> list[str]:
        args = with_mapped_args(with_config(self.script_args, config_path), self.section.arg_mappings, config)
        return [*self.launch_prefix, *args]

    def cached(self, name: str) -> ExperimentResult | None:
        path = os.path.join(self.exps_dir, f"{name}.json")
        if self.section.overwrite or not os.path.isfile(path):
            return None
        with open(path) as f:
            record = json.load(f)
        result = record.get("result")
        if not result or result.get("status") == "running":
            return None  # interrupted while running: run it again
        return ExperimentResult(**{**result, "reused": True})

    def run(
        self,
        cand: Candidate,
        name: str,
        config: dict[str, Any],
        extra: dict[str, Any],
        phase: str = "search",
    ) -> ExperimentResult:
        """Run (or reuse) the experiment ``name``; ``extra`` goes into its ``autotuning`` section
        (and overrides the search's keys there, e.g. ``end_profile_step`` for a confirm run)."""
        found = self.cached(name)
        if found is not None:
            return found
        out_dir = os.path.join(self.results_dir, name)
        os.makedirs(out_dir, exist_ok=True)
        metric_path = os.path.join(out_dir, "metrics.json")
        if os.path.exists(metric_path):
            os.remove(metric_path)
        section = {
            "enabled": True,
            "metric": self.section.metric,
            "metric_path": metric_path,
            "start_profile_step": self.section.start_profile_step,
            "end_profile_step": self.section.end_profile_step,
            **extra,
        }
        exp_config = {**config, "autotuning": section}
        if self.section.metric == "flops":
            # the step just before the measured window (same model and batch, so the same FLOPs):
            # the profiler's own overhead stays out of the timed steps (see [Note: autotuning
            # experiments])
            exp_config["flops_profiler"] = {
                "enabled": True,
                "profile_step": self.section.start_profile_step - 1,
            }
        config_path = os.path.join(out_dir, "ds_config.json")
        write_json_atomic(config_path, exp_config)
        cmd = self.command(config_path, exp_config)
        result = ExperimentResult(
            name, cand.stage, cand.mbs, cand.knob_dict(), cand.offload, "running", phase=phase
        )
        record_path = os.path.join(self.exps_dir, f"{name}.json")
        write_json_atomic(
            record_path, {"name": name, "command": cmd, "config": config, "result": asdict(result)}
        )
        start = time.perf_counter()
        status, reason = self._launch(cmd, os.path.join(out_dir, "output.log"), name)
        result.wall_s = time.perf_counter() - start
        end_step = int(section["end_profile_step"])
        self._classify(result, status, reason, metric_path, os.path.join(out_dir, "output.log"), end_step)
        write_json_atomic(
            record_path, {"name": name, "command": cmd, "config": config, "result": asdict(result)}
        )
        return result

    def _launch(self, cmd: list[str], log_path: str, name: str) -> tuple[str, str]:
        env = {**os.environ, EXPERIMENT_ENV: name}
        env.setdefault("OMP_NUM_THREADS", "1")
        self.launched += 1
        with open(log_path, "wb") as log:
            # its own session, so that a timeout can end every process of the launch at once
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                rc = self.proc.wait(timeout=float(self.section.experiment_timeout))
            except subprocess.TimeoutExpired:
                self.stop()
                return "timeout", f"still running after {self.section.experiment_timeout:g} s; killed"
            finally:
                self.proc = None
        return ("done", "") if rc == 0 else ("failed", f"exit status {rc}")

    def stop(self) -> None:
        """End the running launch, if any: SIGTERM to its process group, SIGKILL after 10 s."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def _classify(
        self,
        result: ExperimentResult,
        status: str,
        reason: str,
        metric_path: str,
        log_path: str,
        end_step: int,
    ) -> None:
        with open(log_path, errors="replace") as f:
            log = f.read()
        if status == "timeout":
            result.status, result.reason = "timeout", reason
            return
        if not os.path.isfile(metric_path):
            if status == "failed":
                result.status, result.reason = _failure_reason(log)
                result.reason = f"{result.reason} ({reason})"
            else:
                result.status = "error"
                result.reason = (
                    f"the script ended before optimizer step {end_step} "
                    "(end_profile_step): it must train at least that many steps"
                )
            return
        with open(metric_path) as f:
            metrics = json.load(f)
        result.metrics = metrics
        result.memory = int(metrics.get("memory") or 0)
        result.metric = metrics.get(METRICS[self.section.metric][0])
        if result.metric is None:
            result.status, result.reason = (
                "error",
                f"the engine measured no {self.section.metric} (see output.log)",
            )
        elif result.memory > self.budget:
            result.status = "oom"
            result.reason = f"peak {result.memory / 2**20:.1f} MiB > budget {self.budget / 2**20:.1f} MiB"
        else:
            result.status = "ok"
            if status == "failed":  # measured (all ranks reached end_profile_step), then failed to exit
                result.reason = f"the metric was written, then the launch ended with {reason}"


def launcher_prefix(args: argparse.Namespace) -> list[str]:
    """``python -m zero_core.launcher run <the launcher flags of args>`` (without the script)."""
    from zero_core.launcher.run import TORCHRUN_FLAGS

    out = [sys.executable, "-m", "zero_core.launcher", "run", "--launcher", args.launcher]
    if args.nproc is not None:
        out += ["--nproc", str(args.nproc)]
    for dest, flag in TORCHRUN_FLAGS:
        if getattr(args, dest) is not None:
            out += [flag, str(getattr(args, dest))]
    if args.standalone:
        out.append("--standalone")
    if args.mpi_args:
        out.append(f"--mpi-args={args.mpi_args}")
    if args.no_local_rank:
        out.append("--no_local_rank")
    if args.module:
        out.append("--module")
    return [*out, args.script]
