"""``Work``: the handle returned by asynchronous ``zero_core.comm`` ops.

It wraps torch's ``Work`` so that two things happen exactly once, when the op completes
(first ``wait()``, or the future from ``get_future()`` resolving): the post-processing of
a backend workaround (divide for AVG, copy a uint8 buffer back into a bool tensor, trim a
padded all_gather; see [Note: backend workarounds]) and the comms logger's timing (see
[Note: what the comms logger counts]).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from zero_core.comm.logger import PendingRecord


class Work:
    """An in-flight collective; ``wait()`` blocks until it is done and its results are final."""

    def __init__(
        self,
        inner: Any,
        finalize: Callable[[], None] | None = None,
        record: PendingRecord | None = None,
        watchdog: Any = None,
        token: int | None = None,
    ) -> None:
        self._inner = inner
        # the collective watchdog bounding this op (see [Note: collective watchdog])
        self._watchdog = watchdog
        self._token = token
        self._finalize = finalize
        self._record = record
        self._done = False
        self._lock = threading.Lock()

    def _complete(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        if self._finalize is not None:
            self._finalize()
        if self._record is not None:
            self._record.finish()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the op is complete (raises the backend's error on failure or timeout).

        Without ``timeout`` the collective watchdog's deadline applies, and a failure raises
        :class:`~zero_core.comm.watchdog.CollectiveTimeoutError` naming the missing ranks.
        """
        if self._done:
            return True
        if self._watchdog is not None and self._token is not None:
            self._watchdog.wait(self._inner, self._token, timeout)
            ok = None
        else:
            ok = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        self._complete()
        return True if ok is None else bool(ok)

    def is_completed(self) -> bool:
        """Whether the transfer finished; post-processing still needs ``wait()``."""
        return self._done or bool(self._inner.is_completed())

    def get_future(self) -> Any:
        """A ``torch.futures.Future`` that resolves after post-processing has run."""

        def _then(fut: Any) -> Any:
            self._complete()
            return fut.value()

        return self._inner.get_future().then(_then)

    def __getattr__(self, name: str) -> Any:
        # Anything else (exception(), source_rank(), ...) is torch's Work's own.
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"zero_core.comm.Work(done={self._done}, inner={self._inner!r})"
