"""What every monitor shares: event validation and the closed state."""

from __future__ import annotations

import numbers

Event = tuple[str, float, int]


def validate_events(events: object, owner: str) -> list[Event]:
    """Check ``events`` is a list of ``(name, value, step)`` and return them with plain float values.

    Values may be Python numbers or one-element tensors (``loss.detach()``); steps must be ints >= 0.
    """
    if not isinstance(events, (list, tuple)):
        raise TypeError(
            f"{owner}.write_events: expected a list of (name, value, step), got {type(events).__name__}"
        )
    out = []
    for i, event in enumerate(events):
        if not isinstance(event, (tuple, list)) or len(event) != 3:
            raise ValueError(
                f"{owner}.write_events: event {i} must be a (name, value, step) triple, got {event!r}"
            )
        name, value, step = event
        if not isinstance(name, str) or not name:
            raise TypeError(f"{owner}.write_events: event {i} name must be a non-empty str, got {name!r}")
        if hasattr(value, "numel") and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"{owner}.write_events: event {i} ('{name}') value must be a number, got {value!r}"
            )
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise TypeError(
                f"{owner}.write_events: event {i} ('{name}') step must be an int >= 0, got {step!r}"
            )
        out.append((name, float(value), int(step)))
    return out


class BaseMonitor:
    """Implements the ``Monitor`` protocol of ``zero_core.protocols.monitor`` around ``_write``."""

    enabled: bool = False

    def __init__(self) -> None:
        self._closed = False

    def write_events(self, events: list[Event]) -> None:
        """Persist ``events`` (``(name, value, step)`` each). A disabled monitor ignores them."""
        events = validate_events(events, type(self).__name__)
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError(f"{type(self).__name__}.write_events: the monitor is closed")
        if events:
            self._write(events)

    def _write(self, events: list[Event]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release the backend; idempotent."""
        if not self._closed:
            self._closed = True
            if self.enabled:
                self._close()

    def _close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> BaseMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
