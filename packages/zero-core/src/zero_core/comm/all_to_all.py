"""``all_to_all_single`` on backends that lack it: point-to-point exchange, logged like the rest.

[Note: all-to-all fallback]
Some backends (MPI builds without it, older gloo on some devices) raise on
``all_to_all_single``. Then each chunk is sent with point-to-point ``isend``/``irecv`` batched
in one ``zero_core.comm.batch_isend_irecv`` call (so the comms logger sees the exchange), and
the chunk a rank keeps for itself is copied locally. The result is bit-identical (pure data
movement); it is only slower. A backend found lacking is remembered by name in
:data:`NO_ALL_TO_ALL`, so the probe runs once; tests add gloo to it to exercise this path.
The Mixture-of-Experts dispatch (zero-moe) is the user of uneven splits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

#: backends (by name) found not to implement ``all_to_all_single``
NO_ALL_TO_ALL: set[str] = set()


def unsupported(exc: RuntimeError) -> bool:
    """Whether ``exc`` says the backend does not implement the op (rather than a real failure)."""
    text = str(exc).lower()
    return "not supported" in text or "not implemented" in text


def all_to_all_p2p(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: Any,
) -> None:
    """``all_to_all_single`` as batched point-to-point sends and receives. See [Note: all-to-all fallback]."""
    from zero_core.comm.p2p import batch_isend_irecv

    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if input_split_sizes is None:
        input_split_sizes = [input.shape[0] // world] * world
    if output_split_sizes is None:
        output_split_sizes = [output.shape[0] // world] * world
    in_chunks = list(torch.split(input, input_split_sizes, dim=0))
    out_chunks = list(torch.split(output, output_split_sizes, dim=0))
    ops = []
    recv_buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
    for peer in range(world):
        if peer == rank:
            out_chunks[peer].copy_(in_chunks[peer])
            continue
        global_peer = dist.get_global_rank(group, peer) if group is not None else peer
        if in_chunks[peer].numel() > 0:
            ops.append(dist.P2POp(dist.isend, in_chunks[peer].contiguous(), global_peer, group))
        if out_chunks[peer].numel() > 0:
            buf = torch.empty_like(out_chunks[peer])
            recv_buffers.append((out_chunks[peer], buf))
            ops.append(dist.P2POp(dist.irecv, buf, global_peer, group))
    if ops:
        for work in batch_isend_irecv(ops):
            work.wait()
    for dst, buf in recv_buffers:
        dst.copy_(buf)
