"""CSV monitor: one ``<metric>.csv`` file per metric name, rows ``step,value`` under a ``step,<label>`` header."""

from __future__ import annotations

import csv
import os
from typing import Any, TextIO

from zero_core.monitor._paths import job_dir
from zero_core.monitor.base import BaseMonitor, Event
from zero_core.monitor.config import CSVConfig, parse_section


def metric_filename(name: str) -> str:
    """File name of a metric: path separators and spaces become ``_`` (``Train/Samples/loss`` ->
    ``Train_Samples_loss.csv``)."""
    return name.replace("/", "_").replace("\\", "_").replace(" ", "_") + ".csv"


class CSVMonitor(BaseMonitor):
    """Appends to one CSV file per metric; the header's value column is the last ``/`` component of the
    name. Files are kept open and flushed after every ``write_events``, so readers see complete rows; an
    existing file (a resumed job) is appended to without a second header."""

    def __init__(self, csv_config: CSVConfig | dict[str, Any] | None = None) -> None:
        super().__init__()
        if not isinstance(csv_config, CSVConfig):
            csv_config = parse_section("csv_monitor", csv_config)
        self.config = csv_config
        self.enabled = csv_config.enabled
        self.log_dir = (
            job_dir(csv_config.output_path, csv_config.job_name, "CSVMonitor") if self.enabled else None
        )
        self._files: dict[str, tuple[TextIO, Any]] = {}

    def _writer(self, name: str) -> Any:
        filename = metric_filename(name)
        if filename not in self._files:
            path = os.path.join(self.log_dir, filename)
            handle = open(path, "a", newline="", encoding="utf-8")  # noqa: SIM115 - kept open until close()
            writer = csv.writer(handle)
            if handle.tell() == 0:
                writer.writerow(["step", name.rsplit("/", 1)[-1]])
            self._files[filename] = (handle, writer)
        return self._files[filename][1]

    def _write(self, events: list[Event]) -> None:
        for name, value, step in events:
            self._writer(name).writerow([step, value])
        for handle, _ in self._files.values():
            handle.flush()

    def _close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()
        self._files = {}


csvMonitor = CSVMonitor  # DeepSpeed's spelling
