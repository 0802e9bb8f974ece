"""TensorBoard monitor: scalars into an event file under ``<output_path>/<job_name>``."""

from __future__ import annotations

from typing import Any

from zero_core.monitor._paths import job_dir
from zero_core.monitor.base import BaseMonitor, Event
from zero_core.monitor.config import TensorBoardConfig, parse_section


class TensorBoardMonitor(BaseMonitor):
    """Writes each event with ``SummaryWriter.add_scalar`` and flushes after every ``write_events`` so a
    running TensorBoard (or a reader) sees it. tensorboard is imported only when the monitor is enabled."""

    def __init__(self, tensorboard_config: TensorBoardConfig | dict[str, Any] | None = None) -> None:
        super().__init__()
        if not isinstance(tensorboard_config, TensorBoardConfig):
            tensorboard_config = parse_section("tensorboard", tensorboard_config)
        self.config = tensorboard_config
        self.enabled = tensorboard_config.enabled
        self.log_dir: str | None = None
        self.summary_writer = None
        if self.enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError(
                    "TensorBoardMonitor: the 'tensorboard' package is needed when tensorboard.enabled is true; "
                    "install it with `pip install zero-core[monitor]`"
                ) from err
            self.log_dir = job_dir(
                tensorboard_config.output_path, tensorboard_config.job_name, "TensorBoardMonitor"
            )
            self.summary_writer = SummaryWriter(log_dir=self.log_dir)

    def _write(self, events: list[Event]) -> None:
        for name, value, step in events:
            self.summary_writer.add_scalar(name, value, step)
        self.summary_writer.flush()

    def _close(self) -> None:
        self.summary_writer.close()
