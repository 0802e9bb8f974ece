"""The confirm phase of ``zero run --autotuning``: a lucky first measurement does not win.

The search runs for real (the autotuner, its runner, records, summary and best config), but the
launches are replaced by a deterministic stand-in that writes the metric the engine would: each
stage has a true throughput, and stage 2's *first* measurement is a lucky outlier (3x its true
value). See [Note: autotuning confirm phase].
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from zero_core.launcher.cli import build_parser
from zero_core.testing.launch import experiment_records, write_json
from zero_profiler.autotuning.autotuner import Autotuner
from zero_profiler.autotuning.confirm import confirm_window_end
from zero_profiler.autotuning.engine_hook import write_json_atomic
from zero_profiler.autotuning.experiment import ExperimentRunner

TRUE = {0: 100.0, 1: 120.0, 2: 90.0}  # samples/s by ZeRO stage: stage 1 is the best
LUCKY = {2: 300.0}  # stage 2's first run reads 300


class FakeLaunches:
    """Stands in for ``ExperimentRunner._launch``: writes metrics.json as the engine would."""

    def __init__(self, fail_confirm: bool = False) -> None:
        self.calls: list[tuple[int, int]] = []  # (stage, end_profile_step) of every launch
        self.fail_confirm = fail_confirm

    def __call__(self, runner: ExperimentRunner, cmd: list[str], log_path: str, name: str) -> tuple[str, str]:
        config = json.loads(Path(cmd[cmd.index("--zero_config") + 1]).read_text())
        stage, section = int(config["zero_optimization"]["stage"]), config["autotuning"]
        first = all(s != stage for s, _ in self.calls)
        self.calls.append((stage, section["end_profile_step"]))
        Path(log_path).write_text("")
        if self.fail_confirm and not first:
            Path(log_path).write_text("RuntimeError: deliberate confirm failure\n")
            return "failed", "exit status 1"
        value = LUCKY.get(stage, TRUE[stage]) if first else TRUE[stage]
        steps = section["end_profile_step"] - section["start_profile_step"]
        write_json_atomic(section["metric_path"], {"throughput": value, "memory": 1, "steps": steps})
        return "done", ""


def _search(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: FakeLaunches, **section: Any) -> Autotuner:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ExperimentRunner, "_launch", lambda self, *a: fake(self, *a))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": [0, 1, 2]},
        "autotuning": {
            "enabled": True,
            "start_profile_step": 2,
            "end_profile_step": 4,
            "tuner_type": "gridsearch",
            "model_info": {"num_params": 1000},
            **section,
        },
    }
    write_json(tmp_path / "cfg.json", cfg)
    args = build_parser().parse_args(
        ["run", "--autotuning", "tune", "--nproc", "2", "job.py", "--zero_config", str(tmp_path / "cfg.json")]
    )
    tuner = Autotuner(args)
    tuner.tune()
    return tuner


def _optimal_stage(tmp_path: Path) -> int:
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    return int(optimal["zero_optimization"]["stage"])


def test_confirm_phase_picks_the_truly_best(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeLaunches()
    _search(tmp_path, monkeypatch, fake)
    long_end = confirm_window_end(2, 4)
    assert long_end == 8
    # the search (one run per stage), then the top 3 again, over the longer window, in score order
    assert fake.calls == [(0, 4), (1, 4), (2, 4), (2, long_end), (1, long_end), (0, long_end)]
    assert _optimal_stage(tmp_path) == 1  # not stage 2, whose single search run was the largest
    records = experiment_records(tmp_path / "autotuning_exps")
    phases = sorted(r["result"]["phase"] for r in records.values())
    assert phases == ["confirm"] * 3 + ["search"] * 3
    summary = (tmp_path / "autotuning_results" / "summary.md").read_text()
    assert "Confirm phase: the search's 3 best candidates" in summary
    assert "(the median of its confirm runs)" in summary and "| **yes** |" in summary

    # a restarted search reuses the confirm runs too
    again = FakeLaunches()
    _search(tmp_path, monkeypatch, again)
    assert again.calls == [] and _optimal_stage(tmp_path) == 1


def test_without_confirm_phase_the_lucky_run_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeLaunches()
    _search(tmp_path, monkeypatch, fake, confirm_top_k=0)
    assert fake.calls == [(0, 4), (1, 4), (2, 4)]
    assert _optimal_stage(tmp_path) == 2


def test_confirm_top_k_limits_the_phase(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeLaunches()
    _search(tmp_path, monkeypatch, fake, confirm_top_k=2)
    assert fake.calls[3:] == [(2, 8), (1, 8)] and _optimal_stage(tmp_path) == 1


def test_failed_confirm_runs_fall_back_to_the_search(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeLaunches(fail_confirm=True)
    _search(tmp_path, monkeypatch, fake)
    assert len(fake.calls) == 6 and _optimal_stage(tmp_path) == 2
    summary = (tmp_path / "autotuning_results" / "summary.md").read_text()
    assert "confirm phase: no re-measurement succeeded" in summary
    assert "RuntimeError: deliberate confirm failure" in summary


def test_confirm_top_k_is_checked() -> None:
    from zero_profiler.autotuning.autotuner import AutotuningError, _load_section

    with pytest.raises(AutotuningError, match="confirm_top_k"):
        _load_section({"confirm_top_k": -1})
    with pytest.warns(UserWarning, match="autotuning.confirm_topk: .*confirm_top_k"):
        _load_section({"confirm_topk": 2})


def test_engine_metric_is_the_median_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One step slowed 10x (another job on the machine) does not move the experiment's metric."""
    from types import SimpleNamespace

    import torch
    from zero_core.config.builtin_sections import AutotuningConfig
    from zero_profiler.autotuning import engine_hook

    clock = iter([0.0, 1.0, 2.0, 12.0, 13.0, 14.0, 15.0])  # mark, steps 2-5 (step 4 takes 10 s), finish
    monkeypatch.setattr(engine_hook.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(engine_hook, "_end_process", lambda: None)
    section = AutotuningConfig(
        enabled=True, metric_path=str(tmp_path / "m.json"), start_profile_step=1, end_profile_step=5
    )
    engine = SimpleNamespace(
        global_steps=0, global_samples=0, device=torch.device("cpu"), profiler=None, global_rank=0,
        dp_world_size=2, config=SimpleNamespace(zero_optimization=SimpleNamespace(stage=1)),
        train_micro_batch_size_per_gpu=lambda: 4, gradient_accumulation_steps=lambda: 1,
    )  # fmt: skip
    hook = engine_hook.AutotuningMetricHook(section, engine, 0)
    for step in range(1, 6):
        engine.global_steps, engine.global_samples = step, 8 * step
        hook(engine)
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["step_throughputs"] == [8.0, 8.0, 0.8, 8.0]
    assert metrics["throughput"] == 8.0 and metrics["latency"] == 1.0  # the median step
    assert metrics["throughput_window"] == pytest.approx(32 / 14.0)  # the window's mean, for the record
