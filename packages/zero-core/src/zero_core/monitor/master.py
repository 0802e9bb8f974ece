"""``MonitorMaster``: one object that fans events out to every enabled monitor, on global rank 0 only."""

from __future__ import annotations

import os

import torch.distributed as dist

from zero_core.monitor.base import BaseMonitor, Event, validate_events
from zero_core.monitor.config import parse_monitor_config


def _global_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class MonitorMaster:
    """Builds the TensorBoard, W&B and CSV monitors named by a config and writes events to all of them.

    ``config`` is a whole config (dict or config object with ``tensorboard``, ``wandb`` and ``csv_monitor``
    sections; other keys are ignored). ``enabled`` is true on every rank when any monitor is enabled (so
    every rank takes the same code path around collectives), but the backends are created, and events
    written, only on global rank 0: other ranks create no files and ``write_events`` is a no-op there.
    """

    def __init__(self, config: object = None) -> None:
        sections = parse_monitor_config(config)
        self.enabled = any(section.enabled for section in sections.values())
        self.rank = _global_rank()
        self.tb_monitor: BaseMonitor | None = None
        self.wandb_monitor: BaseMonitor | None = None
        self.csv_monitor: BaseMonitor | None = None
        if self.rank != 0:
            return
        if sections["tensorboard"].enabled:
            from zero_core.monitor.tensorboard import TensorBoardMonitor

            self.tb_monitor = TensorBoardMonitor(sections["tensorboard"])
        if sections["wandb"].enabled:
            from zero_core.monitor.wandb import WandbMonitor

            self.wandb_monitor = WandbMonitor(sections["wandb"])
        if sections["csv_monitor"].enabled:
            from zero_core.monitor.csv import CSVMonitor

            self.csv_monitor = CSVMonitor(sections["csv_monitor"])

    @property
    def monitors(self) -> list[BaseMonitor]:
        """The backends active in this process (none on ranks other than 0)."""
        return [m for m in (self.tb_monitor, self.wandb_monitor, self.csv_monitor) if m is not None]

    def write_events(self, events: list[Event]) -> None:
        """Write ``(name, value, step)`` events to every enabled monitor (rank 0 only)."""
        events = validate_events(events, "MonitorMaster")
        for monitor in self.monitors:
            monitor.write_events(events)

    def close(self) -> None:
        """Close every backend (flushes files, finishes the W&B run)."""
        for monitor in self.monitors:
            monitor.close()
