"""The mutable process state of stage 3, kept in one object instead of module globals.

[Note: stage 3 runtime context]
A few things stage 3 needs are not owned by any one engine: the agreement-check switch of
[Note: stage 3 collective agreement] (set by ``set_collective_checks`` before or after an
engine is built), the parameter ids and readable names used in error messages (issued by
``zero.Init`` before any engine exists), the table of per-parameter partition records (filled by ``zero.Init`` and the strategy; see
[Note: stage 3 parameter records]), the stack of hook runtimes driving a forward (read by
``ZeroParamDict`` when model code touches a released parameter), the gather-on-access
callbacks of open ``zero.Init`` contexts, and the side streams made for the accelerator. They
live in one :class:`Stage3Context` whose lifetime is the process (the engine's would lose
what ``zero.Init`` and ``set_collective_checks`` recorded before it); the public functions
(``set_collective_checks``, ``collective_checks``, ``param_name`` ...) are thin accessors to
:func:`stage3_context`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from zero_core.zero.stage3.param_records import PARTITION_RECORDS, PartitionRecords


class Stage3Context:
    """Stage 3's process-wide runtime state. See [Note: stage 3 runtime context]."""

    def __init__(self) -> None:
        # None: follow ZERO_STAGE3_COLLECTIVE_CHECKS (see collective_agreement.collective_check_mode)
        self.collective_checks: bool | str | None = None
        # parameter -> its PartitionState, weakly by identity (See [Note: stage 3 parameter records])
        self.records: PartitionRecords = PARTITION_RECORDS
        # PartitionState.id -> readable name (qualified module name) for error messages
        self.param_names: dict[int, str] = {}
        # the Stage3Hooks runtimes currently driving a forward (at most one per process)
        self.active_hooks: list[Any] = []
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
