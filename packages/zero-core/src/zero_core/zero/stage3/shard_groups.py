"""Which ranks a stage-3 parameter is sharded over and gathered from: MiCS and ZeRO++'s hpZ.

[Note: MiCS and hpZ shard groups]
Plain stage 3 shards every parameter over the whole data-parallel group of ``N`` ranks, so
each of its three collectives per step (forward all-gather, backward all-gather, gradient
reduce-scatter) spans every node. Two config switches keep traffic inside nodes (the node
layout is [Note: node topology]'s; what counts as cross-node is [Note: bytes by link class]):

* MiCS (``mics_shard_size`` = S; arXiv 2205.00119): model states are sharded over *shard
  groups*, blocks of S consecutive ranks, and replicated across the N/S groups. Gathers stay
  inside the shard group; a gradient bucket is reduce-scattered inside it and the reduced
  shard then all-reduced over the *replica group* (the ranks holding the same shard in every
  shard group). Each rank holds N/S times plain stage 3's model states (1/S of them instead
  of 1/N). Gradients are divided by N before the sums, so the result is plain stage 3's mean.
  ``mics_hierarchical_params_gather`` gathers a shard group that spans nodes in two hops:
  first across nodes among the ranks at the same position of each node of the shard group
  (each rank sends its shard once to each other node), then inside the node (the gathered
  pieces of this node's ranks). That is MiCS's order; across nodes a rank sends ``S/L - 1``
  shards instead of the flat all-gather's ``S - L`` (``L`` ranks per node). Inside the node
  first would send this node's ``L`` shards across, no saving.
* hpZ (``zero_hpz_partition_size`` = H; ZeRO++, arXiv 2306.10209): parameters keep their 1/N
  shard over the whole group, but a primary all-gather also leaves each rank a *secondary
  partition*: chunk ``i`` of H of the gathered weight, ``i`` this rank's position in its
  block of H consecutive ranks (normally its node). While every parameter of a bucket has a
  valid secondary copy the bucket is gathered from those, inside the H block. Secondary copies
  are dropped whenever shards change (the optimizer step, a checkpoint load, a
  ``GatheredParameters`` modification), so the first forward after a step gathers from the
  primary shards and refreshes them, and the backward reads only inside the node. With
  gradient accumulation the later micro-steps' forwards also read the secondary copies (the
  weights have not changed). Persistent parameters never need them. The secondary copy costs
  ``2Ψ/H`` bytes per rank in 16-bit training (``memory_breakdown``'s ``secondary_parameters``).

MiCS and hpZ together are refused (MiCS's shard group already keeps gathers in a group).
S and H must divide N, and the data-parallel group must be the whole world (the groups are
cut from global ranks); both are checked when the engine is built, before any step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zero_core import comm
from zero_core.zero.stage3.collective_agreement import wait_bounded
from zero_core.zero.stage3.param_records import partition_state


@dataclass
class ShardRoute:
    """The groups of one engine's MiCS or hpZ layout; shared by its parameters' records' ``route``."""

    world: int
    shard_group: Any = None  # MiCS: the S ranks a parameter is sharded over
    shard_size: int = 0
    replica_group: Any = None  # MiCS: the N/S ranks holding the same shard
    hops: tuple[Any, Any] | None = None  # MiCS hierarchical: (inter-node, intra-node) groups
    hop_sizes: tuple[int, int] = (1, 1)
    hpz_group: Any = None  # hpZ: this rank's block of H ranks
    hpz_size: int = 1
    hpz_rank: int = 0

    @property
    def mics(self) -> bool:
        return self.shard_size > 0


def _int_key(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"zero_optimization.{name} must be an int, got {value!r}")
    return value


def build_route(
    dp_group: Any, mics_shard_size: int = -1, hierarchical: bool = False, hpz_size: int = 1
) -> ShardRoute | None:
    """Validate the MiCS/hpZ settings against the world and make their groups (collective).

    Returns None for plain stage 3. Raises ``ValueError`` naming the key and what is allowed.
    """
    from zero_core.comm.topology import block_groups, current_topology, nested_block_groups

    shard = _int_key("mics_shard_size", mics_shard_size)
    hpz = _int_key("zero_hpz_partition_size", hpz_size)
    mics_on, hpz_on = shard > 0, hpz > 1
    if not mics_on and not hpz_on:
        if hierarchical:
            raise ValueError("zero_optimization.mics_hierarchical_params_gather needs mics_shard_size >= 1")
        return None
    if mics_on and hpz_on:
        raise ValueError(
            "zero_optimization: mics_shard_size and zero_hpz_partition_size > 1 cannot be combined; "
            "use one (MiCS shards the states over groups; hpZ keeps a node-local copy of the weights)"
        )
    world = comm.get_world_size() if comm.is_initialized() else 1
    if dp_group is not None and comm.get_world_size(dp_group) != world:
        raise ValueError(
            "zero_optimization: MiCS and hpZ need the data-parallel group to be the whole world "
            f"({world} ranks), got a group of {comm.get_world_size(dp_group)}"
        )
    size, key = (shard, "mics_shard_size") if mics_on else (hpz, "zero_hpz_partition_size")
    if world % size:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(
            f"zero_optimization.{key}={size} does not divide the data-parallel world size {world}; "
            f"allowed: {divisors}"
        )
    route = ShardRoute(world=world)
    if world == 1:
        return None
    block, stride = block_groups(size)
    if hpz_on:
        route.hpz_group, route.hpz_size, route.hpz_rank = block, hpz, comm.get_rank(block)
        return route
    route.shard_group, route.shard_size, route.replica_group = block, shard, stride
    per_node = current_topology().ranks_per_node
    if hierarchical and shard > per_node:  # a shard group inside one node needs no second hop
        if shard % per_node:
            raise ValueError(
                f"zero_optimization.mics_hierarchical_params_gather: mics_shard_size={shard} spans nodes "
                f"of {per_node} ranks but is not a multiple of it; use a multiple of {per_node}"
            )
        intra, inter = nested_block_groups(shard, per_node)
        route.hops, route.hop_sizes = (inter, intra), (shard // per_node, per_node)
    return route


@dataclass(frozen=True)
class GatherSource:
    """Where one all-gather of a bucket reads: the group, its size, and which pieces it sends."""

    group: Any
    world: int
    secondary: bool = False  # pieces are hpZ secondary copies, not the primary shards
    route: ShardRoute | None = None

    def piece(self, st: Any) -> torch.Tensor:
        return st.secondary if self.secondary else st.shard

    def all_gather(self, recv: torch.Tensor, send: torch.Tensor) -> Any:
        """Start the all-gather of ``send`` into ``recv`` (rank-major); returns a waitable."""
        route = self.route
        if not self.secondary and route is not None and route.hops is not None:
            return _TwoHopGather(recv, send, route)
        return comm.all_gather_into_tensor(recv, send, group=self.group, async_op=True)


def gather_source(st: Any) -> GatherSource:
    """The source of the next all-gather of a parameter with state ``st``; see the Note."""
    route = getattr(st, "route", None)
    if route is not None and st.secondary is not None:
        return GatherSource(route.hpz_group, route.hpz_size, True, route)
    return GatherSource(st.group, st.world, False, route)


def source_key(st: Any) -> tuple[int, bool]:
    """Parameters with equal keys share one all-gather."""
    src = gather_source(st)
    return id(src.group), src.secondary


def keep_secondary(st: Any) -> None:
    """After a primary gather: keep this rank's hpZ chunk of the full weight (see the Note)."""
    route = getattr(st, "route", None)
    if route is None or route.hpz_group is None or st.persistent:
        return
    n = st.padded_numel // route.hpz_size
    st.secondary = st.full[route.hpz_rank * n : (route.hpz_rank + 1) * n].clone()


def drop_secondary(params: Any) -> None:
    """Forget hpZ secondary copies (their shards changed)."""
    for p in params:
        partition_state(p).secondary = None


def reduce_across_replicas(out: torch.Tensor, route: ShardRoute | None, what: str) -> None:
    """MiCS: sum a reduce-scattered gradient shard over the replica group (in place, blocking)."""
    if route is None or route.replica_group is None or route.world // max(route.shard_size, 1) == 1:
        return
    work = comm.all_reduce(out, group=route.replica_group, async_op=True)
    wait_bounded(work, f"all-reduce over the MiCS replicas of the {what}")


def broadcast_group(st: Any) -> tuple[Any, int]:
    """The group and size over which a modified full parameter is broadcast from the modifier.

    MiCS replicas must all take the modifier's value, so the broadcast spans the world (the
    modifier is then a global rank; see ``modifier_group_rank``).
    """
    route = getattr(st, "route", None)
    if route is not None and route.mics:
        return None, route.world
    return st.group, st.world


class _TwoHopGather:
    """MiCS's hierarchical all-gather over a shard group spanning ``M`` nodes of ``L`` ranks.

    Shard-group rank ``r = j*L + l`` (node ``j``, position ``l``). Hop 1, across nodes among
    the ranks at position ``l``: ``mid[j]`` = shard of ``j*L + l``. Hop 2, inside the node:
    ``tmp[l', j]`` = shard of ``j*L + l'``, which :meth:`wait` transposes into ``recv``.
    Hop 1 is waited for at launch so hop 2 can be in flight like a flat gather.
    """

    def __init__(self, recv: torch.Tensor, send: torch.Tensor, route: ShardRoute) -> None:
        (inter, intra), (self.m, self.l) = route.hops, route.hop_sizes
        self.recv, self.chunk = recv, send.numel()
        mid = torch.empty(self.m * self.chunk, dtype=send.dtype, device=send.device)
        wait_bounded(
            comm.all_gather_into_tensor(mid, send, group=inter, async_op=True), "MiCS inter-node gather"
        )
        self.tmp = torch.empty(self.l * self.m * self.chunk, dtype=send.dtype, device=send.device)
        self.work = comm.all_gather_into_tensor(self.tmp, mid, group=intra, async_op=True)

    def wait(self, timeout: Any = None) -> bool:
        self.work.wait(timeout=timeout)
        src = self.tmp.view(self.l, self.m, self.chunk).transpose(0, 1)
        self.recv.view(self.m, self.l, self.chunk).copy_(src)
        return True
