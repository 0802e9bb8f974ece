"""Node topology from the launcher's environment, and the block/stride groups built on it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from zero_core.comm import topology
from zero_core.comm.topology import NodeTopology, block_groups, node_groups, ranks_per_node
from zero_core.testing import run_multirank


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in topology.RANKS_PER_NODE_ENV:
        monkeypatch.delenv(name, raising=False)


def test_ranks_per_node_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ranks_per_node(8) == 8  # nothing set: one node
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2(x4)")
    assert ranks_per_node(8) == 2
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert ranks_per_node(8) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ranks_per_node(8) == 8
    monkeypatch.setenv("ZERO_RANKS_PER_NODE", "2")
    assert ranks_per_node(8) == 2


@pytest.mark.parametrize("raw", ["0", "-2", "two", "3"])
def test_ranks_per_node_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("ZERO_RANKS_PER_NODE", raw)
    with pytest.raises(ValueError, match="ZERO_RANKS_PER_NODE"):
        ranks_per_node(4)


def test_node_topology_layout() -> None:
    topo = NodeTopology(world_size=4, ranks_per_node=2)
    assert topo.num_nodes == 2
    assert [topo.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert topo.node_ranks(1) == (2, 3)
    assert not topo.spans_nodes((0, 1)) and topo.spans_nodes((1, 2))
    with pytest.raises(ValueError, match="divisor"):
        NodeTopology(world_size=4, ranks_per_node=3)


def _groups_body() -> None:
    rank = dist.get_rank()
    intra, inter = node_groups()
    assert dist.get_process_group_ranks(intra) == [rank - rank % 2, rank - rank % 2 + 1]
    assert dist.get_process_group_ranks(inter) == [rank % 2, rank % 2 + 2]
    assert block_groups(2) == (intra, inter)  # cached: no second creation
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=intra)
    assert t.item() == (0 + 1 if rank < 2 else 2 + 3)


def test_node_groups_two_nodes_of_two() -> None:
    run_multirank(_groups_body, world_size=4, env={"ZERO_RANKS_PER_NODE": "2"}, timeout=120)


def _reset_body() -> None:
    from zero_core import comm

    block_groups(1)
    assert (dist.get_world_size(), 1) in topology._BLOCK_GROUPS
    comm.destroy_process_group()  # the default group: the groups cut from it die with it
    assert topology._BLOCK_GROUPS == {} and topology._NESTED_GROUPS == {}


def test_destroying_the_default_group_forgets_the_cached_groups() -> None:
    run_multirank(_reset_body, world_size=2, timeout=120)
