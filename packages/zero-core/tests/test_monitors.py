"""Monitors: the logged scalars are read back from the TensorBoard event file, the CSV files and the W&B run."""

from __future__ import annotations

import csv
import glob
import os

import pytest
import torch
from zero_core.monitor import (
    CSVMonitor,
    MonitorMaster,
    TensorBoardMonitor,
    WandbMonitor,
    parse_monitor_config,
)
from zero_core.monitor.wandb import resolve_mode
from zero_core.protocols.monitor import Monitor
from zero_core.testing import run_multirank

EVENTS = [
    [("Train/Samples/train_loss", 2.5, 0), ("Train/Samples/lr", 1e-3, 0)],
    [("Train/Samples/train_loss", 1.25, 1), ("Train/Samples/lr", 2e-3, 1)],
    [("Train/Samples/train_loss", torch.tensor(0.5), 2), ("Train/Samples/lr", 3e-3, 2)],
]


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """W&B writes only into tmp_path and sees no mode and no API key (the CI case)."""
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        path = tmp_path / var.lower()
        path.mkdir()
        monkeypatch.setenv(var, str(path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path / "wandb_dir"


def _scalars_from_event_file(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_tensorboard_event_file_has_the_scalars(tmp_path):
    monitor = TensorBoardMonitor({"enabled": True, "output_path": str(tmp_path), "job_name": "job"})
    assert isinstance(monitor, Monitor) and monitor.enabled
    for events in EVENTS:
        monitor.write_events(events)
    # Flushed after each write: readable before close.
    assert _scalars_from_event_file(monitor.log_dir)["Train/Samples/lr"][-1][0] == 2
    monitor.close()
    scalars = _scalars_from_event_file(str(tmp_path / "job"))
    assert [s for s, _ in scalars["Train/Samples/train_loss"]] == [0, 1, 2]
    assert [v for _, v in scalars["Train/Samples/train_loss"]] == [2.5, 1.25, 0.5]
    assert [v for _, v in scalars["Train/Samples/lr"]] == pytest.approx([1e-3, 2e-3, 3e-3])
    with pytest.raises(RuntimeError, match="closed"):
        monitor.write_events(EVENTS[0])


def test_csv_one_file_per_metric_flushed_and_resumable(tmp_path):
    monitor = CSVMonitor({"enabled": True, "output_path": str(tmp_path), "job_name": "run1"})
    monitor.write_events(EVENTS[0])
    loss_file = tmp_path / "run1" / "Train_Samples_train_loss.csv"
    assert _read_csv(loss_file) == [["step", "train_loss"], ["0", "2.5"]]  # visible before close
    for events in EVENTS[1:]:
        monitor.write_events(events)
    monitor.close()
    assert sorted(os.listdir(tmp_path / "run1")) == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]
    assert _read_csv(loss_file) == [["step", "train_loss"], ["0", "2.5"], ["1", "1.25"], ["2", "0.5"]]
    # A resumed job appends without a second header.
    with CSVMonitor({"enabled": True, "output_path": str(tmp_path), "job_name": "run1"}) as again:
        again.write_events([("Train/Samples/train_loss", 0.25, 3), ("eval loss", 7.0, 3)])
    assert _read_csv(loss_file)[-2:] == [["2", "0.5"], ["3", "0.25"]]
    assert _read_csv(tmp_path / "run1" / "eval_loss.csv") == [["step", "eval loss"], ["3", "7.0"]]


def test_csv_default_output_path_is_launch_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with CSVMonitor({"enabled": True}) as monitor:
        monitor.write_events([("loss", 1.0, 5)])
    assert _read_csv(tmp_path / "DeepSpeedJobName" / "loss.csv") == [["step", "loss"], ["5", "1.0"]]


def test_wandb_defaults_to_offline_and_writes_a_local_run(wandb_env):
    assert resolve_mode() == "offline"
    monitor = WandbMonitor({"enabled": True, "project": "zero-test", "group": "g1", "team": "t1"})
    try:
        for events in EVENTS:
            monitor.write_events(events)
        assert monitor.run.offline and monitor.run.project == "zero-test" and monitor.run.group == "g1"
        assert monitor.run.entity == "t1"  # wandb.team
        # W&B commits a step when a later step (or finish) arrives: several writes may share a step.
        assert monitor.run.summary["Train/Samples/train_loss"] == 1.25
    finally:
        monitor.close()
    runs = glob.glob(os.path.join(os.environ["WANDB_DIR"], "wandb", "offline-run-*"))
    assert len(runs) == 1
    files = glob.glob(os.path.join(runs[0], "run-*.wandb"))
    assert files and os.path.getsize(files[0]) > 0


def test_wandb_respects_explicit_mode(wandb_env, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_mode() is None
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_mode() == "online"


def test_master_fans_out_to_every_enabled_monitor(tmp_path):
    config = {
        "train_batch_size": 4,
        "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "j"},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "j"},
    }
    master = MonitorMaster(config)
    assert master.enabled and master.wandb_monitor is None and len(master.monitors) == 2
    for events in EVENTS:
        master.write_events(events)
    master.close()
    assert [v for _, v in _scalars_from_event_file(str(tmp_path / "tb" / "j"))["Train/Samples/train_loss"]] == [
        2.5, 1.25, 0.5]  # fmt: skip
    assert len(_read_csv(tmp_path / "csv" / "j" / "Train_Samples_lr.csv")) == 4


def test_master_disabled_and_non_zero_rank(tmp_path, monkeypatch):
    master = MonitorMaster({"csv_monitor": {"enabled": False, "output_path": str(tmp_path)}})
    assert not master.enabled and master.monitors == []
    master.write_events(EVENTS[0])
    monkeypatch.setenv("RANK", "1")
    master = MonitorMaster({"csv_monitor": {"enabled": True, "output_path": str(tmp_path)}})
    assert master.enabled and master.monitors == []
    master.write_events(EVENTS[0])
    assert os.listdir(tmp_path) == []


def _rank_writes(path):
    import torch.distributed as dist

    master = MonitorMaster({"csv_monitor": {"enabled": True, "output_path": path, "job_name": "mr"}})
    master.write_events([("loss", float(dist.get_rank() + 1), 0)])
    master.close()
    return len(master.monitors)


def test_master_writes_on_global_rank_zero_only(tmp_path):
    assert run_multirank(_rank_writes, 2, args=(str(tmp_path),), timeout=60.0) == [1, 0]
    assert _read_csv(tmp_path / "mr" / "loss.csv") == [["step", "loss"], ["0", "1.0"]]


def test_config_and_event_validation(tmp_path):
    with pytest.raises(ValueError, match=r"unknown keys \['outputpath'\] in 'tensorboard'"):
        MonitorMaster({"tensorboard": {"enabled": True, "outputpath": "x"}})
    with pytest.raises(TypeError, match="'csv_monitor.enabled' must be a bool"):
        parse_monitor_config({"csv_monitor": {"enabled": "yes"}})
    with pytest.raises(TypeError, match="'wandb.project' must be a string"):
        parse_monitor_config({"wandb": {"project": 3}})
    with pytest.raises(TypeError, match="expected a config dict"):
        MonitorMaster(42)
    with pytest.raises(ValueError, match="plain directory name"):
        CSVMonitor({"enabled": True, "output_path": str(tmp_path), "job_name": "a/b"})
    monitor = CSVMonitor({"enabled": True, "output_path": str(tmp_path)})
    for bad, match in [
        ("loss", "expected a list"),
        ([("loss", 1.0)], "must be a \\(name, value, step\\) triple"),
        ([("", 1.0, 0)], "name must be a non-empty str"),
        ([("loss", "1.0", 0)], "value must be a number"),
        ([("loss", 1.0, -1)], "step must be an int >= 0"),
        ([("loss", 1.0, 1.5)], "step must be an int >= 0"),
    ]:
        with pytest.raises((TypeError, ValueError), match=match):
            monitor.write_events(bad)
    monitor.close()
    monitor.close()  # idempotent
