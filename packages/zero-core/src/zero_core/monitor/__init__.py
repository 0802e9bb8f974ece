"""Training monitors (DeepSpeed's ``deepspeed.monitor``): TensorBoard, Weights & Biases and CSV files,
and ``MonitorMaster`` that fans events out to the enabled ones on global rank 0.

Each monitor implements ``zero_core.protocols.monitor.Monitor``: ``enabled``, ``write_events(events)`` with
``(name, value, step)`` events, and ``close()``. tensorboard and wandb are imported only when enabled.
"""

from zero_core.monitor.base import BaseMonitor, validate_events
from zero_core.monitor.config import CSVConfig, TensorBoardConfig, WandbConfig, parse_monitor_config
from zero_core.monitor.csv import CSVMonitor, csvMonitor
from zero_core.monitor.master import MonitorMaster
from zero_core.monitor.tensorboard import TensorBoardMonitor
from zero_core.monitor.wandb import WandbMonitor

__all__ = [
    "BaseMonitor",
    "CSVConfig",
    "CSVMonitor",
    "MonitorMaster",
    "TensorBoardConfig",
    "TensorBoardMonitor",
    "WandbConfig",
    "WandbMonitor",
    "csvMonitor",
    "parse_monitor_config",
    "validate_events",
]
