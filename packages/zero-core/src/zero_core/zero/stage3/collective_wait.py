"""The bounded wait on a stage-3 collective, and the error it raises.

Every stage-3 collective, whoever starts it (the gathers and broadcasts of
``partitioned_param.py``, the gradient reduce-scatters of ``reduce_buckets.py``, MiCS's replica
all-reduce and two-hop gather in ``shard_groups.py``), is waited for here: the wait is bounded
by the collective watchdog's timeout and tells the watchdog what it waits for, so a rank that
never joins gives a :class:`Stage3CollectiveError` naming the collective instead of a hang
(see [Note: stage 3 collective agreement] in ``partitioned_param.py``). A leaf module: it
imports no other stage-3 module, so each of those can use it.
"""

from __future__ import annotations

import datetime
from typing import Any

from zero_core import comm
from zero_core.comm import watchdog as _watchdog


class Stage3CollectiveError(RuntimeError):
    """Ranks disagreed on (or did not join) a stage-3 collective."""


def wait_bounded(work: Any, what: str) -> None:
    """Wait for ``work`` (the collective ``what``) at most the collective timeout."""
    wd = _watchdog.get_watchdog()
    if wd is not None:
        wd.note(what)  # the parameters of this collective, for the watchdog's diagnosis
    timeout = _watchdog.collective_timeout()
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:
        raise Stage3CollectiveError(
            f"ZeRO stage 3: {what} failed or did not complete within {timeout:g} s on rank "
            f"{comm.get_rank()}: another rank did not join or failed (ranks took different paths through the model?). Backend said: {exc}"
        ) from exc
