"""Weights & Biases monitor.

[Note: W&B without a network]
Training must never hang or fail because W&B cannot be reached. When neither ``WANDB_MODE`` nor an API key
(``WANDB_API_KEY`` or a ``api.wandb.ai`` entry in ``~/.netrc``) is configured, the run is started in
``offline`` mode: it is written under ``$WANDB_DIR/wandb/offline-run-*`` and can be uploaded later with
``wandb sync``. An explicit ``WANDB_MODE`` (online, offline, disabled) is always respected.
"""

from __future__ import annotations

import netrc
import os
from typing import Any

from zero_core.monitor.base import BaseMonitor, Event
from zero_core.monitor.config import WandbConfig, parse_section


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_mode() -> str | None:
    """The mode to start the run in: None (use ``WANDB_MODE``), else online with a key, else offline.
    See [Note: W&B without a network]."""
    if os.environ.get("WANDB_MODE"):
        return None
    return "online" if _has_api_key() else "offline"


class WandbMonitor(BaseMonitor):
    """Logs events to a W&B run (``project``, ``group``, entity ``team``); events are grouped by step and
    logged in increasing step order, because W&B drops steps lower than one already logged."""

    def __init__(self, wandb_config: WandbConfig | dict[str, Any] | None = None) -> None:
        super().__init__()
        if not isinstance(wandb_config, WandbConfig):
            wandb_config = parse_section("wandb", wandb_config)
        self.config = wandb_config
        self.enabled = wandb_config.enabled
        self.run = None
        if self.enabled:
            try:
                import wandb
            except ImportError as err:
                raise ImportError(
                    "WandbMonitor: the 'wandb' package is needed when wandb.enabled is true; "
                    "install it with `pip install zero-core[monitor]`"
                ) from err
            self.run = wandb.init(
                project=wandb_config.project,
                group=wandb_config.group,
                entity=wandb_config.team,
                mode=resolve_mode(),
                reinit="create_new",
            )

    def _write(self, events: list[Event]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for name, value, step in events:
            by_step.setdefault(step, {})[name] = value
        for step in sorted(by_step):
            self.run.log(by_step[step], step=step)

    def _close(self) -> None:
        self.run.finish()
