"""The autotuner's output: progress lines, ``summary.md``, the best config, its command, the plot.

Files in ``results_dir`` (DeepSpeed's names where it has them): ``ds_config_optimal.json`` (the
best experiment's config without the ``autotuning`` section: it trains normally),
``cmd_optimal.txt`` (the exact command that runs it), ``summary.md`` (every experiment: config,
metric, memory, status and reason; the stages ruled out by memory) and
``metric_vs_micro_batch.png`` (the metric against the micro-batch size, one line per stage;
needs matplotlib, ``pip install matplotlib``, otherwise the summary says so).
"""

from __future__ import annotations

import os
import shlex
import statistics
import sys
from typing import Any, TextIO

from zero_core.checkpoint.atomic import atomic_path, atomic_write_text

from zero_profiler.autotuning.confirm import ConfirmOutcome
from zero_profiler.autotuning.engine_hook import write_json_atomic
from zero_profiler.autotuning.experiment import METRICS, ExperimentResult

PLOT_NAME = "metric_vs_micro_batch.png"


class Progress:
    """A text progress bar, one line per experiment (the total is an estimate: the search prunes)."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream or sys.stdout

    def update(self, result: ExperimentResult, metric: str) -> None:
        self.done += 1
        self.total = max(self.total, self.done)
        width = 20
        filled = int(width * self.done / self.total)
        value = f"{result.metric:.4g} {metric}" if result.metric is not None else "-"
        how = "reused" if result.reused else f"{result.wall_s:.1f} s"
        print(
            f"[autotuning] [{'#' * filled}{'.' * (width - filled)}] {self.done}/~{self.total} "
            f"{result.name}: {result.status} {value} ({how}){' - ' + result.reason if result.reason else ''}",
            file=self.stream,
            flush=True,
        )


def _knobs_text(result: ExperimentResult) -> str:
    parts = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(result.knobs.items())]
    if result.offload:
        parts.append("offload_optimizer=cpu")
    return ", ".join(parts) or "defaults"


def write_summary(
    path: str,
    results: list[ExperimentResult],
    best: ExperimentResult | None,
    metric: str,
    pruned: list[str],
    notes: list[str],
    command: str | None,
    confirmed: ConfirmOutcome | None = None,
) -> None:
    unit = {"throughput": "samples/s", "latency": "s/step", "flops": "FLOPS/GPU"}[metric]
    lines = ["# Autotuning summary", ""]
    lines += [f"- {n}" for n in notes]
    lines += [f"- ruled out by memory, never launched: {p}" for p in pruned]
    lines.append("")
    if best is not None:
        lines += [
            f"Best: **{best.name}** (ZeRO stage {best.stage}, micro-batch {best.mbs}, {_knobs_text(best)}): "
            f"{best.metric:.4g} {unit}"
            + (" (the median of its confirm runs)." if best.phase == "confirm" else "."),
            "",
            f"Run it: `{command}`",
            "",
        ]
    else:
        lines += ["No experiment succeeded: no configuration fits (see the reasons below).", ""]
    lines += _confirm_lines(confirmed, metric, unit)
    lines += [
        f"| experiment | stage | micro-batch | knobs | {metric} ({unit}) | peak memory (MiB) | status | wall (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        value = f"{r.metric:.4g}" if r.metric is not None else "-"
        mem = f"{r.memory / 2**20:.1f}" if r.memory else "-"
        status = r.status + (f": {r.reason}" if r.reason else "") + (" (reused)" if r.reused else "")
        lines.append(
            f"| {r.name} | {r.stage} | {r.mbs} | {_knobs_text(r)} | {value} | {mem} | "
            f"{status.replace('|', '/')} | {r.wall_s:.1f} |"
        )
    atomic_write_text(path, "\n".join(lines) + "\n")


def _confirm_lines(confirmed: ConfirmOutcome | None, metric: str, unit: str) -> list[str]:
    """The confirm phase's table: each re-measured candidate's search and confirm measurements."""
    if confirmed is None or not confirmed.runs:
        return []
    steps = {
        r.metrics.get("steps") for runs in confirmed.runs.values() for r in runs if r.metrics.get("steps")
    }
    lines = [
        f"Confirm phase: the search's {len(confirmed.runs)} best candidates measured again "
        f"({len(next(iter(confirmed.runs.values())))} fresh launch(es) each, interleaved, "
        f"{'/'.join(str(s) for s in sorted(steps)) or '-'} profiled steps; the pick is the best median "
        "of these, the search's own measurement left out: see [Note: autotuning confirm phase]).",
        "",
        f"| candidate (search experiment) | search {metric} | confirm {metric} ({unit}) | median | picked |",
        "|---|---|---|---|---|",
    ]
    picked = confirmed.pick
    for cand, runs in confirmed.runs.items():
        search = confirmed.search[cand]
        ok = [r.metric for r in runs if r.score(metric) is not None and r.metric is not None]
        values = ", ".join(f"{r.metric:.4g}" if r.metric is not None else r.status for r in runs)
        median = f"{statistics.median(ok):.4g}" if ok else "-"
        mark = "**yes**" if any(r is picked for r in runs) else ""
        lines.append(f"| {search.name} | {search.metric:.4g} | {values} | {median} | {mark} |")
    return [*lines, ""]


def write_best(results_dir: str, config: dict[str, Any], command: list[str]) -> str:
    """``ds_config_optimal.json`` and ``cmd_optimal.txt``; returns the command as one line."""
    write_json_atomic(os.path.join(results_dir, "ds_config_optimal.json"), config)
    line = shlex.join(command)
    atomic_write_text(os.path.join(results_dir, "cmd_optimal.txt"), line + "\n")
    return line


def write_plot(path: str, results: list[ExperimentResult], metric: str) -> str | None:
    """The PNG of metric against micro-batch (best knobs per point), one line per stage.

    Returns None when written, else why not (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "the plot needs matplotlib, which is not installed: pip install matplotlib"
    better = max if METRICS[metric][1] else min
    fig, ax = plt.subplots(figsize=(6, 4))
    for stage in sorted({r.stage for r in results}):
        per_mbs: dict[int, float] = {}
        for r in results:
            if r.stage == stage and r.phase == "search" and r.status == "ok" and r.metric is not None:
                per_mbs[r.mbs] = better(per_mbs.get(r.mbs, r.metric), r.metric)
        if per_mbs:
            xs = sorted(per_mbs)
            ax.plot(xs, [per_mbs[x] for x in xs], marker="o", label=f"ZeRO stage {stage}")
    ax.set_xlabel("micro-batch size per GPU")
    ax.set_ylabel(metric)
    ax.set_xscale("log", base=2)
    ax.set_title("autotuning: best of each (stage, micro-batch)")
    ax.legend()
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
    return None
