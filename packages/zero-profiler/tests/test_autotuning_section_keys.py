"""The ``autotuning`` section's keys steer the search (launches replaced by a stand-in).

Each key changes what the search does: the micro-batch and train-batch bounds and the number
of micro-batch sizes decide which experiments run, the tuner's trial and early-stopping counts
how many, ``exps_dir``/``overwrite`` whether finished experiments are reused, ``results_dir``/
``model_info_path``/``overwrite`` where the model information comes from, ``arg_mappings`` the
script's flags, ``mp_size`` and ``memory_budget`` the world and what fits. The stand-in writes
the metric an engine would (throughput 100 - micro-batch: smaller is better here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from zero_core.launcher.cli import build_parser
from zero_core.testing.launch import write_json
from zero_profiler.autotuning.autotuner import Autotuner
from zero_profiler.autotuning.engine_hook import write_json_atomic
from zero_profiler.autotuning.experiment import ExperimentRunner


class _Launches:
    def __init__(self) -> None:
        self.mbs: list[int] = []

    def __call__(self, runner: ExperimentRunner, cmd: list[str], log_path: str, name: str) -> tuple[str, str]:
        config = json.loads(Path(cmd[cmd.index("--zero_config") + 1]).read_text())
        mbs, section = int(config["train_micro_batch_size_per_gpu"]), config["autotuning"]
        self.mbs.append(mbs)
        Path(log_path).write_text("")
        steps = section["end_profile_step"] - section["start_profile_step"]
        write_json_atomic(section["metric_path"], {"throughput": 100.0 - mbs, "memory": 1, "steps": steps})
        return "done", ""


def _tuner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nproc: int = 2, **section: Any
) -> tuple[Autotuner, _Launches]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(tmp_path)
    launches = _Launches()
    monkeypatch.setattr(ExperimentRunner, "_launch", lambda self, *a: launches(self, *a))
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "zero_optimization": {"stage": 1},
        "autotuning": {
            "enabled": True,
            "start_profile_step": 1,
            "end_profile_step": 2,
            "confirm_top_k": 0,
            "model_info": {"num_params": 1000},
            "max_train_micro_batch_size_per_gpu": 16,
            **section,
        },
    }
    write_json(tmp_path / "cfg.json", cfg)
    argv = [
        "run",
        "--autotuning",
        "tune",
        "--nproc",
        str(nproc),
        "job.py",
        "--zero_config",
        str(tmp_path / "cfg.json"),
    ]
    return Autotuner(build_parser().parse_args(argv)), launches


def _tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **section: Any) -> list[int]:
    tuner, launches = _tuner(tmp_path, monkeypatch, **section)
    tuner.tune()
    return launches.mbs


def test_search_limits_follow_the_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wide = _tried(tmp_path / "a", monkeypatch, num_tuning_micro_batch_sizes=5)
    assert min(wide) == 1 and max(wide) == 16 and len(set(wide)) == 5
    # train batch = micro-batch x 2 ranks within [4, 8]: micro-batches 2 to 4 only
    bounded = _tried(tmp_path / "b", monkeypatch, min_train_batch_size=4, max_train_batch_size=8)
    assert set(bounded) <= {2, 3, 4} and {2, 4} <= set(bounded)
    micro = _tried(
        tmp_path / "c",
        monkeypatch,
        min_train_micro_batch_size_per_gpu=4,
        max_train_micro_batch_size_per_gpu=8,
    )
    assert min(micro) == 4 and max(micro) == 8
    fewer = _tried(tmp_path / "d", monkeypatch, num_tuning_micro_batch_sizes=2)
    assert len(set(fewer)) == 2
    capped = _tried(tmp_path / "e", monkeypatch, num_tuning_micro_batch_sizes=5, tuner_num_trials=2)
    assert len(capped) < len(wide)
    kw = {"num_tuning_micro_batch_sizes": 5, "tuner_type": "random"}
    patient = _tried(tmp_path / "f", monkeypatch, **kw, tuner_early_stopping=50)
    impatient = _tried(tmp_path / "g", monkeypatch, **kw, tuner_early_stopping=1)
    assert len(impatient) < len(patient)


def test_finished_experiments_are_reused_from_exps_dir_unless_overwrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _tried(tmp_path, monkeypatch, exps_dir="my_exps")
    assert first and list((tmp_path / "my_exps").glob("*.json"))
    assert _tried(tmp_path, monkeypatch, exps_dir="my_exps") == []  # every experiment reused
    assert len(_tried(tmp_path, monkeypatch, exps_dir="my_exps", overwrite=True)) == len(first)
    assert len(_tried(tmp_path, monkeypatch, exps_dir="other_exps")) == len(first)


def test_model_info_comes_from_the_configured_places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profiled: list[str] = []

    def profile(self: Autotuner, path: str) -> None:
        profiled.append(path)
        write_json(Path(path), {"num_params": 7})

    monkeypatch.setattr(Autotuner, "_profile_model_info", profile)
    write_json(tmp_path / "info.json", {"num_params": 1234})
    tuner, _ = _tuner(tmp_path, monkeypatch, model_info=None, model_info_path=str(tmp_path / "info.json"))
    assert tuner.model_info()["num_params"] == 1234 and not profiled
    (tmp_path / "res" / "profile_model_info").mkdir(parents=True)
    write_json(tmp_path / "res" / "profile_model_info" / "model_info.json", {"num_params": 99})
    tuner, _ = _tuner(tmp_path, monkeypatch, model_info=None, results_dir="res")
    assert tuner.model_info()["num_params"] == 99 and not profiled
    tuner, _ = _tuner(tmp_path, monkeypatch, model_info=None, results_dir="res", overwrite=True)
    assert tuner.model_info()["num_params"] == 7 and profiled == [
        str(tmp_path / "res/profile_model_info/model_info.json")
    ]


def test_arg_mappings_set_the_script_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tuner, _ = _tuner(tmp_path, monkeypatch, arg_mappings={"train_micro_batch_size_per_gpu": "--batch"})
    cmd = tuner.runner.command("c.json", {"train_micro_batch_size_per_gpu": 6})
    assert cmd[cmd.index("--batch") + 1] == "6"
    plain, _ = _tuner(tmp_path, monkeypatch)
    assert "--batch" not in plain.runner.command("c.json", {"train_micro_batch_size_per_gpu": 6})


def test_mp_size_and_memory_budget_decide_what_is_tried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tuner, _ = _tuner(tmp_path, monkeypatch, nproc=4, mp_size=2, memory_budget=10**12)
    assert tuner.world == 2 and [s for s, _ in tuner.prune([0, 1, 2, 3], 10**6)] == [0, 1, 2, 3]
    # 1e6 parameters, 2 ranks: 16 B/param at stage 0 (16 MB) do not fit 8 MB; stage 3's 8 MB/rank does
    tight, _ = _tuner(tmp_path, monkeypatch, nproc=4, mp_size=2, memory_budget=8 * 10**6)
    assert [s for s, _ in tight.prune([0, 1, 2, 3], 10**6)] == [3]
    wide, _ = _tuner(tmp_path, monkeypatch, nproc=4, memory_budget=10**12)
    assert wide.world == 4
