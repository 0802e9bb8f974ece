"""Node topology: which ranks share a machine, and the process groups built on that.

[Note: node topology]
Across machines the link is 4-10x slower than inside one, so MiCS and ZeRO++ (hpZ, qgZ) keep
traffic inside a node where they can. They need two facts: how many ranks run on each node,
and which global ranks those are.

* Ranks per node come from the launcher: ``LOCAL_WORLD_SIZE`` (torchrun, ``zero run``),
  ``OMPI_COMM_WORLD_LOCAL_SIZE`` (Open MPI), ``MPI_LOCALNRANKS`` (MPICH/Hydra),
  ``SLURM_NTASKS_PER_NODE`` (Slurm). ``ZERO_RANKS_PER_NODE`` overrides all of them, so that
  four processes on one machine can stand for two nodes of two ranks in a test or benchmark.
  With none set, the whole world is one node.
* Ranks are node-major: node ``n`` holds global ranks ``[n*L, (n+1)*L)`` for ``L`` ranks per
  node. torchrun, ``mpirun --map-by slot`` and Slurm's block distribution all number ranks
  this way; a launcher that interleaves nodes would make the "inside a node" groups span nodes
  (correct results, slower traffic).

:func:`block_groups` cuts the world into contiguous blocks of ``k`` ranks and returns this
rank's block and its "stride" group (the ranks at the same position in every block). With
``k`` = ranks per node these are the intra-node and inter-node groups; with ``k`` = MiCS's
shard size they are the shard group and the replica group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from zero_core.comm.groups import new_group, on_default_group_destroyed

#: Environment variables read for the ranks per node, in order of precedence.
RANKS_PER_NODE_ENV: tuple[str, ...] = (
    "ZERO_RANKS_PER_NODE",
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "SLURM_NTASKS_PER_NODE",
)


@dataclass(frozen=True)
class NodeTopology:
    """``world_size`` ranks, ``ranks_per_node`` on each node, numbered node-major."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(
                f"NodeTopology: ranks_per_node={self.ranks_per_node} must be a positive divisor of "
                f"world_size={self.world_size}"
            )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """The node that global ``rank`` runs on."""
        return rank // self.ranks_per_node

    def node_ranks(self, node: int) -> tuple[int, ...]:
        """The global ranks of ``node``."""
        start = node * self.ranks_per_node
        return tuple(range(start, start + self.ranks_per_node))

    def spans_nodes(self, ranks: tuple[int, ...] | list[int]) -> bool:
        """Whether a group of these global ranks has members on more than one node."""
        return len({self.node_of(r) for r in ranks}) > 1


def _parse_count(name: str, raw: str) -> int:
    # Slurm writes "2(x3)" for "2 tasks on each of 3 nodes"; the count is the leading number.
    text = raw.strip().split("(", 1)[0].split(",", 1)[0]
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a positive number of ranks per node") from None
    if value < 1:
        raise ValueError(f"{name}={raw!r}: expected a positive number of ranks per node")
    return value


def ranks_per_node(world_size: int) -> int:
    """Ranks per node for a world of ``world_size`` ranks. See [Note: node topology]."""
    for name in RANKS_PER_NODE_ENV:
        raw = os.environ.get(name)
        if raw is None or not raw.strip():
            continue
        value = _parse_count(name, raw)
        if world_size % value:
            raise ValueError(
                f"{name}={value} does not divide the world size {world_size}: every node must run the "
                f"same number of ranks (set ZERO_RANKS_PER_NODE to a divisor of {world_size})"
            )
        return value
    return world_size


def current_topology() -> NodeTopology:
    """The topology of the initialised default process group."""
    if not dist.is_initialized():
        raise RuntimeError("zero_core.comm.topology: torch.distributed is not initialized")
    world = dist.get_world_size()
    return NodeTopology(world, ranks_per_node(world))


_BLOCK_GROUPS: dict[tuple[int, int], tuple[Any, Any]] = {}


def block_groups(block_size: int) -> tuple[Any, Any]:
    """This rank's ``(block_group, stride_group)`` for contiguous blocks of ``block_size`` ranks.

    Collective on first use: every rank of the world must call it with the same ``block_size``,
    in the same order as its other group creations (``torch.distributed.new_group``'s rule).
    Cached per world size and block size; :func:`reset_groups` forgets the cache when the
    default group is destroyed.
    """
    if not dist.is_initialized():
        raise RuntimeError("zero_core.comm.topology.block_groups: torch.distributed is not initialized")
    world, rank = dist.get_world_size(), dist.get_rank()
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < 1
        or world % block_size
    ):
        raise ValueError(
            f"zero_core.comm.topology.block_groups: block_size must be a positive divisor of the world "
            f"size {world}, got {block_size!r}"
        )
    key = (world, block_size)
    if key not in _BLOCK_GROUPS:
        mine_block: Any = None
        mine_stride: Any = None
        for start in range(0, world, block_size):
            ranks = list(range(start, start + block_size))
            group = new_group(ranks)
            if rank in ranks:
                mine_block = group
        for offset in range(block_size):
            ranks = list(range(offset, world, block_size))
            group = new_group(ranks)
            if rank in ranks:
                mine_stride = group
        _BLOCK_GROUPS[key] = (mine_block, mine_stride)
    return _BLOCK_GROUPS[key]


_NESTED_GROUPS: dict[tuple[int, int, int], tuple[Any, Any]] = {}


def nested_block_groups(outer: int, inner: int) -> tuple[Any, Any]:
    """Inside this rank's block of ``outer`` ranks: its block of ``inner`` ranks and its stride
    group (the ranks at the same position in every ``inner`` block of the same ``outer`` block).

    With ``outer`` = MiCS's shard size and ``inner`` = ranks per node these are the two hops of
    MiCS's hierarchical gather: the shard group's ranks on this node, and this rank's peers on
    the shard group's other nodes. ``inner`` must divide ``outer``, which must divide the world
    size. Collective on first use, like :func:`block_groups`.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "zero_core.comm.topology.nested_block_groups: torch.distributed is not initialized"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, v in (("outer", outer), ("inner", inner)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(
                f"zero_core.comm.topology.nested_block_groups: {name} must be an int >= 1, got {v!r}"
            )
    if world % outer or outer % inner:
        raise ValueError(
            f"zero_core.comm.topology.nested_block_groups: need inner ({inner}) | outer ({outer}) | world "
            f"size ({world})"
        )
    key = (world, outer, inner)
    if key not in _NESTED_GROUPS:
        mine: list[Any] = [None, None]
        for start in range(0, world, outer):
            layouts = [list(range(b, b + inner)) for b in range(start, start + outer, inner)]
            layouts += [list(range(start + o, start + outer, inner)) for o in range(inner)]
            for i, ranks in enumerate(layouts):
                group = new_group(ranks)
                if rank in ranks:
                    mine[0 if i < outer // inner else 1] = group
        _NESTED_GROUPS[key] = (mine[0], mine[1])
    return _NESTED_GROUPS[key]


def node_groups() -> tuple[Any, Any]:
    """This rank's ``(intra_node_group, inter_node_group)``. Collective on first use."""
    return block_groups(current_topology().ranks_per_node)


def reset_groups() -> None:
    """Forget cached groups (called when the default process group is destroyed)."""
    _BLOCK_GROUPS.clear()
    _NESTED_GROUPS.clear()


on_default_group_destroyed(reset_groups)
