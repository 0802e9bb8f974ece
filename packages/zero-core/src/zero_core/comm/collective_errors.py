"""The errors of a collective that cannot complete (see [Note: collective watchdog])."""

from __future__ import annotations

from typing import Any


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the watchdog's timeout; the message names the
    collective, the group, the ranks that did not arrive and the last module/parameter."""


class PeerFailedError(CollectiveTimeoutError):
    """A collective cannot complete because a member rank ended with an error; the message names
    that rank, where it was and its error. ``failed_rank`` is the rank that failed first."""

    def __init__(self, message: str, failed_rank: int) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.failed_rank))
