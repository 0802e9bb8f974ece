"""The mutable process state of stage 3 that no engine owns, kept in one object.

[Note: stage 3 runtime context]
A few things stage 3 needs belong to the process, not to any one engine: the agreement-check
switch of [Note: stage 3 collective agreement] (set by ``set_collective_checks`` before or
after an engine is built), the counter issuing parameter ids (``zero.Init`` partitions before
any engine exists, and ranks must number parameters alike), the stack of hook runtimes driving
a forward (read by ``ZeroParamDict`` when model code touches a released parameter; weak
references, empty between forwards), the gather-on-access callbacks of open ``zero.Init`` contexts (removed on
exit), and the side streams made for the accelerator. They live in one :class:`Stage3Context`
whose lifetime is the process; the public functions (``set_collective_checks``,
``collective_checks`` ...) are thin accessors to :func:`stage3_context`. Per-parameter state is
not here: records belong to their owners, names included (See [Note: stage 3 parameter records]).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch


class Stage3Context:
    """Stage 3's process-wide runtime state. See [Note: stage 3 runtime context]."""

    def __init__(self) -> None:
        # None: follow ZERO_STAGE3_COLLECTIVE_CHECKS (see collective_agreement.collective_check_mode)
        self.collective_checks: bool | str | None = None
        # weak references to the Stage3Hooks runtimes currently driving a forward (at most one per
        # process); weak, so that a forward that raised never keeps its engine alive
        self.active_hooks: list[weakref.ref] = []
        # set by zero.Init while it constructs modules: gather-on-access without a forward
        # called with (parameter, the parameter dict of the module it was read from)
        self.on_access_outside_forward: list[Callable[[torch.nn.Parameter, Any], None]] = []
        # the Stage3Streams made for the current accelerator (streams.stage3_streams)
        self.streams: Any = None
        self._next_param_id = 0
        self._lock = threading.Lock()

    def next_param_id(self) -> int:
        """A process-unique id for a new partitioned parameter (thread-safe)."""
        with self._lock:
            pid = self._next_param_id
            self._next_param_id += 1
        return pid


_CONTEXT = Stage3Context()


def stage3_context() -> Stage3Context:
    """The process's stage-3 runtime context."""
    return _CONTEXT


__all__ = ["Stage3Context", "stage3_context"]
