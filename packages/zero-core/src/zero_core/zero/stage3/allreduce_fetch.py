"""``zero_optimization.use_all_reduce_for_fetch_params``: a stage-3 fetch as an all-reduce.

[Note: all-reduce fetch]
A gathered bucket normally travels as one all-gather of the ranks' shards, packed side by side
as bytes, followed by one strided copy per parameter into its gather buffer (See
[Note: stage 3 parameter layout]). DeepSpeed's ``stage3_use_all_reduce_for_fetch_params``
fetches instead with a SUM all-reduce of a zero-filled buffer holding every parameter of the
bucket at its full padded size: each rank writes its shard at its own offset, the zeros of the
other ranks' slots add nothing, and after the sum every slot holds the whole parameter, ready to
be copied into the gather buffer in one contiguous piece. The sum is exact (a value plus zeros;
only a negative zero comes back positive), so results are the same as with the all-gather. It
sends about twice the all-gather's bytes (a ring all-reduce is a reduce-scatter plus an
all-gather) for a simpler unpack, which DeepSpeed found faster where host-side slicing was the
bottleneck.

As in DeepSpeed it applies to fetches of the primary shards in their own dtype: ZeRO++ qwZ's
quantized gathers, hpZ's gathers from the secondary copies and MiCS's two-hop hierarchical
gathers keep their own collectives, and a bucket mixing dtypes is fetched as one all-reduce per
dtype (``gather_params`` groups by dtype when the mode is on). The owning strategy decides (its
``fetch_by_all_reduce``), so every fetch of its parameters, ``GatheredParameters`` included,
takes the same route on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zero_core import comm


def fetch_by_all_reduce(st: Any) -> bool:
    """Whether the strategy owning the parameter of record ``st`` fetches by all-reduce."""
    owner = st.owner_of()
    return bool(getattr(owner, "fetch_by_all_reduce", False))


def all_reduce_fetch(
    todo: list[torch.nn.Parameter], states: list[Any], group: Any, release: Callable[[Any, Any], None]
) -> tuple[Any, Callable[[int, torch.Tensor], None], int]:
    """Start the all-reduce of one bucket; returns the work, ``unpack(i, full)`` (copies parameter
    ``i`` into its gather buffer ``full``, with ``unpack.buffers`` the tensors the wait must cover)
    and the bytes sent. ``release(p, st)`` is called once a parameter's shard is packed (offloaded
    shards leave the device again, See [Note: offloaded shards])."""
    offsets, total = [], 0
    for st in states:
        offsets.append(total)
        total += st.padded_numel
    shard0 = states[0].shard
    buf = torch.zeros(total, dtype=shard0.dtype, device=shard0.device)
    for p, st, off in zip(todo, states, offsets):
        lo = off + st.rank * st.shard_numel
        buf[lo : lo + st.shard_numel].copy_(st.shard)
        release(p, st)
    work = comm.all_reduce(buf, group=group, async_op=True)

    def unpack(i: int, full: torch.Tensor) -> None:
        st = states[i]
        full.copy_(buf[offsets[i] : offsets[i] + st.padded_numel])

    unpack.buffers = (buf,)  # type: ignore[attr-defined]
    return work, unpack, buf.numel() * buf.element_size()
