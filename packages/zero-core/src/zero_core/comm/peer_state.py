"""What the other ranks are doing, from the records their collective watchdogs publish.

Each rank's watchdog thread publishes ``zero_watchdog/<rank>`` in the store about once a second
while it changes (see [Note: collective watchdog]): collectives issued per group, the op it
waits in (``wait``: group, number, op), the last module/parameter, host and pid. Readers here
are for error paths and rare collective calls (exit teardown, checkpoint agreements), never the
training step.
"""

from __future__ import annotations

import json
from typing import Any

RECORD_KEY = "zero_watchdog"


def peer_records(store: Any, ranks: list[int] | tuple[int, ...]) -> dict[int, dict[str, Any]]:
    """The published records of ``ranks`` (those that have one); store errors propagate."""
    out: dict[int, dict[str, Any]] = {}
    for r in ranks:
        key = f"{RECORD_KEY}/{r}"
        if store.check([key]):
            try:
                out[r] = json.loads(store.get(key).decode())
            except ValueError:
                continue
    return out


def waiting_on(
    store: Any, rank: int, issued: dict[str, int], ranks: list[int] | tuple[int, ...]
) -> list[tuple[int, str, int, list[int]]]:
    """``(peer, op, number, members)`` for each of ``ranks`` waiting in a collective on a group
    with ``rank`` that ``rank`` has not issued (``issued``: its counts per group key): a peer
    that waits for this rank, which is elsewhere."""
    out = []
    for r, rec in sorted(peer_records(store, [r for r in ranks if r != rank]).items()):
        wait = rec.get("wait")
        if not wait:
            continue
        group, seq, op = wait
        members = [int(x) for x in str(group).split(",") if x]
        if rank in members and issued.get(group, 0) < int(seq):
            out.append((r, str(op), int(seq), members))
    return out


def describe_waiting(waiting: list[tuple[int, str, int, list[int]]]) -> str:
    """``rank 1 waits in collective reduce_scatter_tensor (#7 on the group of global ranks [0, 1])``; ..."""
    return "; ".join(
        f"rank {r} waits in collective {op} (#{seq} on the group of global ranks {members})"
        for r, op, seq, members in waiting
    )
