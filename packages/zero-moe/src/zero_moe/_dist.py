"""The collectives zero-moe uses, routed through ``zero_core.comm`` when it is installed.

Every collective of the project is meant to go through ``zero_core.comm`` (so the comms
logger sees it). That module is written concurrently with this package; until it exists
this shim falls back to ``torch.distributed`` with the same names and arguments (the
contract in docs/architecture.md), so nothing here changes when it lands.

It also carries the fallback for ``all_to_all_single`` on backends that lack it: see
[Note: all-to-all fallback].
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

_REQUIRED = ("all_to_all_single", "all_reduce", "get_rank", "get_world_size", "new_group", "is_initialized")


def _backend() -> ModuleType:
    """``zero_core.comm`` when it provides the names used here, else ``torch.distributed``."""
    try:
        comm = importlib.import_module("zero_core.comm")
    except ImportError:
        return dist
    if all(hasattr(comm, name) for name in _REQUIRED):
        return comm
    return dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    return _backend().get_rank(group=group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return _backend().get_world_size(group=group) if is_initialized() else 1


def new_group(ranks: list[int]) -> Any:
    return _backend().new_group(ranks)


def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None) -> None:
    _backend().all_reduce(tensor, op=op, group=group)


# Backends found not to implement all_to_all_single (by name), so the probe runs once.
_NO_ALL_TO_ALL: set[str] = set()


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    force_fallback: bool = False,
) -> None:
    """Exchange ``input`` chunks between the ranks of ``group`` (first-dimension splits).

    [Note: all-to-all fallback]
    Some backends (MPI builds without it, older gloo on some devices) raise on
    ``all_to_all_single``. Then each chunk is sent with point-to-point ``isend``/``irecv``
    batched in one ``batch_isend_irecv`` call, and the chunk a rank keeps for itself is
    copied locally. The result is bit-identical (pure data movement); it is only slower.
    ``force_fallback`` exists so that tests exercise this path on gloo.
    """
    backend_name = str(dist.get_backend(group))
    if not force_fallback and backend_name not in _NO_ALL_TO_ALL:
        try:
            _backend().all_to_all_single(
                output,
                input,
                output_split_sizes=output_split_sizes,
                input_split_sizes=input_split_sizes,
                group=group,
            )
            return
        except RuntimeError as exc:
            if "not supported" not in str(exc).lower() and "not implemented" not in str(exc).lower():
                raise
            _NO_ALL_TO_ALL.add(backend_name)
    _all_to_all_p2p(output, input, output_split_sizes, input_split_sizes, group)


def _all_to_all_p2p(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: Any,
) -> None:
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
        # zero_core.comm.batch_isend_irecv accepts torch P2POps and logs the exchange.
        batch = getattr(_backend(), "batch_isend_irecv", dist.batch_isend_irecv)
        for work in batch(ops):
            work.wait()
    for dst, buf in recv_buffers:
        dst.copy_(buf)
