"""Reduce-scatter and all-gather on gloo as direct point-to-point exchanges.

[Note: gloo direct collectives]
ZeRO stages 1-3 lean on ``reduce_scatter_tensor`` and ``all_gather_into_tensor``, and gloo's
own versions of both are slower than a plain exchange of the same bytes. Measured with torch
2.13, gloo over loopback, one host, median of 21 calls (wall ms, N fp32 elements in the full
tensor):

==========  =====  ============================  ============================  ==========
N           ranks  reduce_scatter gloo / direct  all_gather gloo / direct      all_reduce
==========  =====  ============================  ============================  ==========
1,024       2      2.14 / 0.28                   0.33 / 0.18                   0.31
262,144     2      1.75 / 0.50                   0.91 / 0.38                   2.71
3,260,000   2      14.5 / 8.2                    9.9 / 5.4                     10.2
262,144     4      7.9 / 2.5                     4.1 / 2.8                     7.8
3,260,000   4      28.8 / 13.0                   15.5 / 9.9                    21.8
3,260,000   8      67.2 / 28.4                   33.6 / 25.4                   75.2
==========  =====  ============================  ============================  ==========

(4 and 8 ranks time-share the host's 2 cores; 3.26M elements is the gradient of
tools/bench/bench_zero12.py's model.)

At a few million elements gloo's reduce-scatter costs more than its all-reduce, so a ZeRO step
(reduce-scatter, then all-gather of the updated parameters) paid about twice what DDP's one
all-reduce pays; done directly the pair costs about one all-reduce, which is what the ZeRO paper
counts.

So on a gloo group with CPU tensors, both ops are run here as one round of ``isend``/``irecv``:
member ``i`` sends chunk ``j`` of its input (reduce-scatter) or its whole input (all-gather) to
every member ``j``, all transfers in flight at once. The bytes each rank sends are those of the
ring algorithm, ``(n - 1) / n`` of the full tensor, so the comms logger's counts are unchanged
(see [Note: bytes by link class]). The reduce-scatter receives into ``n - 1`` chunk-sized
buffers (``(n - 1) / n`` of the input, freed when the op completes) and sums in group-rank
order, so the result does not depend on which message arrived first. Floating-point SUM only
(AVG reaches here as SUM plus a division, see [Note: backend workarounds]); other ops and dtypes,
other backends (NCCL has fast native ones), one-member groups and groups of more than
``MAX_MEMBERS`` (8, the largest measured; each member posts ``2 (n - 1)`` transfers) keep torch's
collective.

The transfers use tags of their own (a sequence number per process group, above ``_TAG_BASE``),
so they never match a user's or the pipeline engine's point-to-point messages on the same group.
Every member issues a group's collectives in the same order (as any collective requires), so the
sequence numbers agree; groups are counted apart, as their collectives may interleave
differently on different ranks.

``ZERO_GLOO_DIRECT_COLLECTIVES=0`` turns this off (torch's gloo collectives then run).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zero_core.comm.groups import group_ranks

ENV_SWITCH = "ZERO_GLOO_DIRECT_COLLECTIVES"
MAX_MEMBERS = 8

# Tags from 2**30 up: far from the small tags users and the pipeline engine pick.
_TAG_BASE = 1 << 30
_TAG_SPAN = 1 << 29
# Per process group object (not per member list: two groups of the same ranks may see their
# collectives in different orders); weak, so a destroyed group's count goes with it.
_sequence: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_sequence_lock = threading.Lock()


def enabled() -> bool:
    """Whether the direct path is on (``ZERO_GLOO_DIRECT_COLLECTIVES``, default on)."""
    value = os.environ.get(ENV_SWITCH, "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV_SWITCH} must be 1 or 0 (true/false, yes/no, on/off), got {value!r}")


def applies(group: Any, tensor: torch.Tensor, reduce: bool) -> bool:
    """Whether an op on ``tensor`` over ``group`` runs here. See [Note: gloo direct collectives]."""
    if tensor.device.type != "cpu" or (reduce and not tensor.is_floating_point()):
        return False
    if not 2 <= dist.get_world_size(group) <= MAX_MEMBERS or "gloo" not in str(dist.get_backend(group)):
        return False
    return enabled()


def _next_tag(group: Any) -> int:
    pg = dist.group.WORLD if group is None else group
    with _sequence_lock:
        seq = _sequence.get(pg, 0)
        _sequence[pg] = seq + 1
    return _TAG_BASE + seq % _TAG_SPAN


class DirectWork:
    """The transfers of one direct collective; ``wait()`` also runs its completion (the sum).

    Looks like a torch ``Work`` to ``zero_core.comm.Work`` and the collective watchdog:
    ``wait(timeout)``, ``is_completed()``, ``get_future()``. Its transfers are point-to-point, so
    it is waited on once, never in slices (``resumable_wait``; see [Note: collective watchdog]).
    """

    resumable_wait = False

    def __init__(self, works: list[Any], complete: Callable[[], None] | None) -> None:
        self._works = works
        self._complete = complete
        self._done = False
        self._lock = threading.Lock()

    def wait(self, timeout: timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for work in self._works:
            if deadline is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        with self._lock:
            if not self._done:
                if self._complete is not None:
                    self._complete()
                self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def get_future(self) -> torch.futures.Future:
        # gloo's point-to-point works have no futures ("Work::getFuture not implemented"), so a
        # helper thread waits and resolves one.
        fut: torch.futures.Future = torch.futures.Future()

        def resolve() -> None:
            try:
                self.wait()
                fut.set_result(None)
            except Exception as exc:  # handed to whoever waits on the future
                fut.set_exception(exc)

        threading.Thread(target=resolve, name="zero-gloo-direct-future", daemon=True).start()
        return fut

    def exception(self) -> Any:
        return None


def _exchange(
    op: str, group: Any, sends: Callable[[int], torch.Tensor], recvs: Callable[[int], torch.Tensor]
) -> list[Any]:
    """Post every send and receive with each other member, nearest ring neighbours first.

    Under torch's profiler the transfers (``gloo:send``/``gloo:recv``, each lasting until it
    completes) sit inside a ``gloo_direct:<op>`` range, so a profile tells which collective they
    belong to.
    """
    ranks = group_ranks(group)
    n, me = len(ranks), dist.get_rank(group)
    tag = _next_tag(group)
    works = []
    with torch.profiler.record_function(f"gloo_direct:{op}"):
        for k in range(1, n):
            dst, src = (me + k) % n, (me - k) % n
            works.append(dist.isend(sends(dst), ranks[dst], group=group, tag=tag))
            works.append(dist.irecv(recvs(src), ranks[src], group=group, tag=tag))
    return works


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Any) -> DirectWork:
    """SUM of every member's ``input`` chunk ``i`` into member ``i``'s ``output`` (flat,
    contiguous; apart from ``input`` or exactly this rank's chunk of it)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    c = output.numel()
    chunks = input.view(n, c)
    received = {src: torch.empty_like(output) for src in range(n) if src != me}
    works = _exchange("reduce_scatter", group, lambda dst: chunks[dst], lambda src: received[src])

    def complete() -> None:
        own = chunks[me]
        if output.data_ptr() == own.data_ptr():  # in place: ``output`` is this rank's own chunk
            for src in range(n):
                if src != me:
                    output.add_(received[src])
        else:  # group-rank order: the same additions whichever message came first
            parts = [own if src == me else received[src] for src in range(n)]
            torch.add(parts[0], parts[1], out=output)
            for part in parts[2:]:
                output.add_(part)
        received.clear()

    return DirectWork(works, complete)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Any) -> DirectWork:
    """Every member's ``input`` into slot ``i`` of ``output`` (flat, contiguous; apart from
    ``output`` or exactly this rank's slot of it)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    slots = output.view(n, input.numel())
    if slots[me].data_ptr() != input.data_ptr():  # not an in-place all-gather
        slots[me].copy_(input)
    return DirectWork(_exchange("all_gather", group, lambda dst: input, lambda src: slots[src]), None)
