"""``zero run --autotuning tune|run``: pruning by memory, the search, its results, resume, failures.

The launch tests start real searches (every experiment is a ``zero run`` of a script), kept
small: tiny models, profile steps 1-3, a bounded space. See [Note: autotuning search].
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from zero_core.config.builtin_sections import AutotuningConfig
from zero_core.testing.launch import experiment_records, run_zero, write_json
from zero_profiler.autotuning.experiment import (
    _failure_reason,
    config_arg_index,
    with_config,
    with_mapped_args,
)
from zero_profiler.autotuning.memory import model_states_bytes, parse_bytes
from zero_profiler.autotuning.space import Candidate, build_space, micro_batch_candidates
from zero_profiler.autotuning.tuners import TUNERS

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
JOB = HERE / "_autotuning_job.py"
PROFILE = {"start_profile_step": 1, "end_profile_step": 3}


# -- the parts, without launches ---------------------------------------------------------------


def test_model_states_prune_by_stage() -> None:
    p = 1_000_000
    fp32 = [model_states_bytes(p, 4, s, mixed_precision=False) for s in range(4)]
    assert fp32 == [16 * p, 4 * p + 4 * p + 8 * p / 4, 4 * p + 12 * p / 4, 16 * p / 4]
    mixed = [model_states_bytes(p, 4, s, mixed_precision=True) for s in range(4)]
    assert mixed == [16 * p, 4 * p + 12 * p / 4, 2 * p + 14 * p / 4, 16 * p / 4]  # the ZeRO paper's
    assert model_states_bytes(p, 4, 2, False, offload_optimizer=True) == 4 * p + 4 * p / 4
    assert parse_bytes("64MB", "x") == 64_000_000 and parse_bytes("2GiB", "x") == 2 * 2**30
    with pytest.raises(ValueError, match="ZERO_X: 'lots' is not a byte count"):
        parse_bytes("lots", "ZERO_X")


def test_space_from_auto_lists_and_fixed_values() -> None:
    section = AutotuningConfig(fast=False)
    space = build_space(
        {
            "train_micro_batch_size_per_gpu": "auto",
            "zero_optimization": {"stage": [1, 3], "reduce_bucket_size": [10, 20]},
        },
        section,
        num_params=800,
    )
    assert space.stages == [1, 3] and space.mbs_fixed is None
    assert space.knob_values[1]["reduce_bucket_size"] == [10, 20]
    assert space.knob_values[1]["allgather_bucket_size"] == [100, 800]  # 1/8 of the model, all of it
    assert len(space.knob_combos(1)) == 2 * 2 * 2
    fast = build_space(
        {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {}}, AutotuningConfig(), 800
    )
    assert fast.stages == [0, 1, 2, 3] and fast.mbs_fixed == 4 and fast.knob_combos(2) == [()]
    with pytest.raises(ValueError, match="zero_optimization.stage: 5 is not a stage"):
        build_space({"zero_optimization": {"stage": 5}}, section, 800)
    assert micro_batch_candidates(2, 16, 4) == [2, 4, 8, 16]
    assert micro_batch_candidates(1, 5, 3) == [1, 2, 5]


def test_script_arguments() -> None:
    args = ["--steps", "3", "--zero_config", "a.json", "--bs", "1"]
    assert with_config(args, "b.json") == ["--steps", "3", "--zero_config", "b.json", "--bs", "1"]
    assert with_config(["--deepspeed_config=a.json"], "b.json") == ["--deepspeed_config=b.json"]
    mapped = with_mapped_args(
        args, {"train_micro_batch_size_per_gpu": "--bs"}, {"train_micro_batch_size_per_gpu": 8}
    )
    assert mapped[-2:] == ["--bs", "8"]
    with pytest.raises(ValueError, match="carry no config path"):
        config_arg_index(["--steps", "3"])
    assert _failure_reason("x\ntorch.OutOfMemoryError: CUDA out of memory\n")[0] == "oom"
    assert _failure_reason("Traceback\nValueError: bad thing\nmore\n") == ("error", "ValueError: bad thing")


@pytest.mark.parametrize("tuner", ["gridsearch", "random", "model_based"])
def test_tuners_find_the_best_and_stop_early(tuner: str) -> None:
    cands = [
        Candidate(1, m, (("reduce_bucket_size", b),)) for m in (16, 8, 4, 2, 1) for b in (100, 1000, 10000)
    ]

    def score(c: Candidate) -> float:  # rises with the micro-batch, best at the middle bucket size
        return c.mbs * 10 - abs(c.knob_dict()["reduce_bucket_size"] - 1000) / 100

    seen: list[Candidate] = []

    def evaluate(c: Candidate) -> float:
        seen.append(c)
        return score(c)

    TUNERS[tuner](cands, {}, num_trials=50, early_stopping=100, seed=0).run(evaluate)
    assert len(set(seen)) == len(seen)
    if tuner != "model_based":  # without early stopping, all of them; the cost model stops by itself
        assert len(seen) == len(cands)
    if tuner != "model_based":
        assert max(cands, key=score) in seen
    seen.clear()
    TUNERS[tuner](cands, {cands[0]: score(cands[0])}, num_trials=50, early_stopping=4, seed=0).run(evaluate)
    best = max(cands, key=score)
    if tuner == "model_based":  # from the largest micro-batch's probe, as the autotuner starts it
        assert best in seen and len(seen) <= 4
    assert cands[0] not in seen  # measured before the tuner started: not run again
    assert len(seen) < len(cands) - 1


def test_model_based_tuner_carries_what_earlier_stages_taught() -> None:
    # throughput: a level per stage, x1.5 per doubling of the micro-batch, the larger bucket 20%
    # faster at every stage (a shared effect, as the cost model assumes)
    level = {0: 100.0, 1: 90.0, 2: 120.0}

    def score(c: Candidate) -> float:
        return (
            level[c.stage]
            * 1.5 ** (c.mbs.bit_length())
            * (1.2 if c.knob_dict()["reduce_bucket_size"] > 10 else 1.0)
        )

    def cands(stage: int) -> list[Candidate]:
        return [Candidate(stage, m, (("reduce_bucket_size", b),)) for m in (8, 4, 2) for b in (10, 1000)]

    seen: list[Candidate] = []

    def evaluate(c: Candidate) -> float:
        seen.append(c)
        return score(c)

    # stage 0 from its probe at the largest micro-batch: one knob step, then no predicted gain
    probe0 = Candidate(0, 8, (("reduce_bucket_size", 10),))
    TUNERS["model_based"](cands(0), {probe0: score(probe0)}, 50, 5).run(evaluate)
    assert seen == [Candidate(0, 8, (("reduce_bucket_size", 1000),))]
    prior = {probe0: score(probe0), seen[0]: score(seen[0])}
    # stage 2, probed with the knob stage 0 found best: the model (fitted on stage 0 too) expects
    # nothing better, so the stage costs its probe alone
    seen.clear()
    probe2 = Candidate(2, 8, (("reduce_bucket_size", 1000),))
    TUNERS["model_based"](cands(2), {probe2: score(probe2)}, 50, 5, prior=prior).run(evaluate)
    assert seen == []
    # probed with the other knob instead, it measures the one candidate predicted to be better
    probe2 = Candidate(2, 8, (("reduce_bucket_size", 10),))
    TUNERS["model_based"](cands(2), {probe2: score(probe2)}, 50, 5, prior=prior).run(evaluate)
    assert seen == [Candidate(2, 8, (("reduce_bucket_size", 1000),))]


def test_probes_take_the_best_knobs_so_far() -> None:
    from zero_profiler.autotuning.autotuner import Autotuner

    tuner = Autotuner.__new__(Autotuner)
    tuner.scores = {
        Candidate(0, 8, (("overlap_comm", True), ("reduce_bucket_size", 10))): 1.0,
        Candidate(0, 8, (("overlap_comm", True), ("reduce_bucket_size", 1000))): 2.0,
        Candidate(0, 4, (("overlap_comm", False), ("reduce_bucket_size", 1000))): None,
    }
    combos3 = [
        (("overlap_comm", o), ("reduce_bucket_size", r), ("stage3_prefetch_bucket_size", p))
        for o in (False, True)
        for r in (10, 1000)
        for p in (10, 1000)
    ]
    assert tuner._probe_knobs(combos3) == (
        (("overlap_comm", True), ("reduce_bucket_size", 1000), ("stage3_prefetch_bucket_size", 10))
    )
    assert tuner._probe_knobs([()]) == ()  # fast mode: no knobs
    tuner.scores = {}
    assert tuner._probe_knobs(combos3) == combos3[0]


def test_a_metric_path_in_the_search_config_is_noted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zero_profiler.autotuning.autotuner import Autotuner

    monkeypatch.chdir(tmp_path)  # the search makes its results and experiments directories here
    from zero_core.launcher.cli import build_parser

    cfg = write_json(tmp_path / "cfg.json", {"autotuning": {"enabled": True, "metric_path": "m.json"}})
    args = build_parser().parse_args(["run", "--autotuning", "tune", "job.py", "--zero_config", str(cfg)])
    # a metric_path in the search's own config is the engine's key: the search says it is not used
    assert any("metric_path 'm.json' is not used" in n for n in Autotuner(args).notes)


# -- real searches -----------------------------------------------------------------------------


def test_memory_pruning_launches_only_stage_3(tmp_path: Path) -> None:
    # 50M parameters (declared: model_info), fp32 Adam, 2 ranks: model states per rank are
    # 800/600/500/400 MB at stages 0/1/2/3; a 450 MB budget leaves stage 3 alone.
    cfg = write_json(
        tmp_path / "cfg.json",
        {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "autotuning": {"enabled": True, **PROFILE, "model_info": {"num_params": 50_000_000}},
        },
    )
    out = run_zero(
        "--autotuning", "tune", "--nproc", "2", str(JOB), "--zero_config", str(cfg),
        cwd=tmp_path, env={"ZERO_AUTOTUNING_MEMORY_BUDGET": "450MB"},
    )  # fmt: skip
    records = experiment_records(tmp_path / "autotuning_exps")
    assert records and all(name.startswith("z3_") for name in records), (list(records), out)
    summary = (tmp_path / "autotuning_results" / "summary.md").read_text()
    for stage in (0, 1, 2):
        assert f"ruled out by memory, never launched: stage {stage} " in summary
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert optimal["zero_optimization"]["stage"] == 3 and "autotuning" not in optimal


def test_search_measures_the_model_and_confirms_the_pick(tmp_path: Path) -> None:
    # One rank: no model_info, so one launch measures the model; stages 0 and 1 at micro-batch 2
    # (two search launches); then the confirm phase runs both again over the longer window.
    cfg = write_json(
        tmp_path / "cfg.json",
        {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": [0, 1]},
            "autotuning": {"enabled": True, **PROFILE, "tuner_type": "gridsearch"},
        },
    )
    run_zero("--autotuning", "tune", "--nproc", "1", str(JOB), "--zero_config", str(cfg), cwd=tmp_path)
    results = tmp_path / "autotuning_results"
    info = json.loads((results / "profile_model_info" / "model_info.json").read_text())
    assert info["num_params"] == 16 * 32 + 32 + 32 + 1  # the job's MLP
    records = [r["result"] for r in experiment_records(tmp_path / "autotuning_exps").values()]
    assert sorted((r["phase"], r["stage"]) for r in records) == [
        ("confirm", 0),
        ("confirm", 1),
        ("search", 0),
        ("search", 1),
    ]
    assert all(r["status"] == "ok" for r in records), records
    confirm = [r for r in records if r["phase"] == "confirm"]
    # steps 1-7: three times the search's window of steps 1-3 (see [Note: autotuning confirm phase])
    assert {r["metrics"]["steps"] for r in confirm} == {6} and {r["metrics"]["steps"] for r in records} == {
        2,
        6,
    }
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal["zero_optimization"]["stage"] == max(confirm, key=lambda r: r["metric"])["stage"]
    assert "Confirm phase: the search's 2 best candidates" in (results / "summary.md").read_text()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_failures_are_recorded_and_a_killed_search_resumes(tmp_path: Path) -> None:
    # One rank, micro-batch fixed: one experiment per stage. Stage 1 raises, stage 2 hangs (killed
    # at the timeout), stage 3 holds until the test interrupts the search itself (SIGTERM).
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": [1, 2, 3]},
        "autotuning": {
            "enabled": True,
            **PROFILE,
            "tuner_type": "gridsearch",
            "experiment_timeout": 40,
            "model_info": {"num_params": 1000},
        },
    }
    cfg = write_json(tmp_path / "cfg.json", config)
    hold = tmp_path / "hold"
    hold.write_text("")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "JOB_RAISE_STAGE": "1",
        "JOB_HANG_STAGE": "2",
        "JOB_HOLD_STAGE": "3",
        "JOB_HOLD_FILE": str(hold),
    }
    argv = [sys.executable, "-m", "zero_core.launcher", "run", "--autotuning", "tune", "--nproc", "1"]
    argv += [str(JOB), "--zero_config", str(cfg)]
    first = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pid_file = Path(str(hold) + ".pid")
    deadline = time.monotonic() + 600
    while not pid_file.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert pid_file.exists(), first.communicate()[0].decode()[-4000:]
    first.send_signal(signal.SIGTERM)  # interrupt the search in the middle of the stage-3 experiment
    first.wait(timeout=60)
    held = int(pid_file.read_text())
    for _ in range(40):  # the search ended its running experiment too
        if not _alive(held):
            break
        time.sleep(0.5)
    assert not _alive(held)
    exps = tmp_path / "autotuning_exps"
    before = experiment_records(exps)
    by_stage = {r["result"]["stage"]: r["result"] for r in before.values()}
    assert (
        by_stage[1]["status"] == "error"
        and "ValueError: deliberate failure at stage 1" in by_stage[1]["reason"]
    )
    assert by_stage[2]["status"] == "timeout" and "still running after 40 s" in by_stage[2]["reason"]
    assert by_stage[3]["status"] == "running"  # interrupted: not a finished experiment

    hold.unlink()
    # a longer timeout for the rerun (a loaded machine); the section is not part of an experiment's identity
    config["autotuning"]["experiment_timeout"] = 600
    write_json(cfg, config)
    out = run_zero(
        "--autotuning", "tune", "--nproc", "1", str(JOB), "--zero_config", str(cfg), cwd=tmp_path, env=env
    )
    after = experiment_records(exps)
    for name, record in before.items():  # the finished experiments were reused, not rerun
        if record["result"]["stage"] != 3:
            assert after[name] == record
    assert after[next(n for n, r in before.items() if r["result"]["stage"] == 3)]["result"]["status"] == "ok"
    assert "(1 launched, 2 reused)" in out, out
    summary = (tmp_path / "autotuning_results" / "summary.md").read_text()
    assert "ValueError: deliberate failure" in summary and "timeout" in summary and "(reused)" in summary
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert optimal["zero_optimization"]["stage"] == 3


def test_engine_hook_only_for_experiments(monkeypatch: pytest.MonkeyPatch) -> None:
    # zero-core's seam (engine/autotuning_experiment.py) adds this package's hook to the engine
    from types import SimpleNamespace

    from zero_core.engine.autotuning_experiment import ExperimentBaseline, attach_experiment_hook
    from zero_profiler.autotuning.engine_hook import EXPERIMENT_ENV, AutotuningMetricHook

    def hooks_for(section: AutotuningConfig) -> list:
        engine = SimpleNamespace(global_rank=0, _step_hooks=[])
        attach_experiment_hook(SimpleNamespace(autotuning=section), engine, ExperimentBaseline())
        return engine._step_hooks

    monkeypatch.delenv(EXPERIMENT_ENV, raising=False)
    assert hooks_for(AutotuningConfig()) == []
    with pytest.warns(UserWarning, match="the search is run by `zero run --autotuning"):
        assert hooks_for(AutotuningConfig(enabled=True)) == []  # a plain run trains normally
    (hook,) = hooks_for(AutotuningConfig(enabled=True, metric_path="m.json"))
    assert isinstance(hook, AutotuningMetricHook) and hook.metric_path == "m.json"
    bad = AutotuningConfig(enabled=True, metric_path="m.json", start_profile_step=5, end_profile_step=5)
    with pytest.raises(ValueError, match="end_profile_step \\(5\\) must be greater than start_profile_step"):
        AutotuningMetricHook(bad, None, 0)


def test_largest_micro_batch_search_stops_on_oom() -> None:
    # the search's logic alone: an "experiment" runs out of memory above micro-batch 6
    from zero_profiler.autotuning.autotuner import Autotuner

    tuner = Autotuner.__new__(Autotuner)
    tuner.num_params, tuner.world, tuner.mixed, tuner.budget, tuner.per_sample_bytes = (
        1000,
        2,
        False,
        10**9,
        0.0,
    )
    probed: list[int] = []

    def evaluate(cand: Candidate) -> float | None:
        probed.append(cand.mbs)
        return float(cand.mbs) if cand.mbs <= 6 else None

    tuner.evaluate = evaluate  # type: ignore[method-assign]
    assert tuner._largest_fitting(1, False, list(range(1, 17)), ()) == 6
    assert probed[:2] == [16, 1] and len(probed) <= 2 + 4  # the largest, the smallest, a binary search
    probed.clear()
    assert tuner._largest_fitting(1, False, [8, 16], ()) is None and probed == [16, 8]
    # memory measured earlier bounds the first probe: 1000 bytes per sample in a 6000-byte room
    tuner.budget, tuner.per_sample_bytes = (
        12000 + 6000,
        1000.0,
    )  # model states (fp32, stage 1, N=2): 12 bytes x 1000
    probed.clear()
    assert tuner._largest_fitting(1, False, list(range(1, 17)), ()) == 6 and probed == [6]
