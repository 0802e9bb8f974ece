"""The comms logger's split of bytes into inside-node and cross-node ([Note: bytes by link class])."""

from __future__ import annotations

import pytest
import torch
from zero_core.comm.link_bytes import p2p_sends, split_by_link
from zero_core.testing import run_multirank

WORLD4 = (0, 1, 2, 3)


def test_model_on_two_nodes_of_two() -> None:
    b = 4000  # logical bytes; chunk 1000 over 4 ranks
    assert split_by_link("all_gather_into_tensor", WORLD4, 0, 2, b) == (1000, 2000)
    assert split_by_link("reduce_scatter_tensor", WORLD4, 3, 2, b) == (1000, 2000)
    assert split_by_link("all_reduce", WORLD4, 1, 2, b) == (2000, 4000)
    # a group inside one node never crosses; one rank per node always does
    assert split_by_link("all_gather_into_tensor", (2, 3), 2, 2, b) == (2000, 0)
    assert split_by_link("all_reduce", (0, 2), 0, 2, b) == (0, 4000)
    assert split_by_link("broadcast", WORLD4, 0, 2, b, root=0) == (4000, 8000)
    assert split_by_link("broadcast", WORLD4, 1, 2, b, root=0) == (0, 0)
    assert split_by_link("all_to_all_single", WORLD4, 0, 2, b, send_splits=[10, 20, 30, 40]) == (20, 70)
    assert split_by_link("reduce", WORLD4, 1, 2, b, root=2) == (1000, 3000)
    assert split_by_link("send", (), 1, 2, b, peer=2) == (0, b)
    assert split_by_link("recv", WORLD4, 1, 2, b) == (0, 0)
    assert p2p_sends([("isend", 1, 8), ("irecv", 2, 8), ("isend", 3, 4)], 0, 2) == (8, 4)
    # one node: nothing crosses
    assert split_by_link("all_reduce", WORLD4, 0, 4, b)[1] == 0


def test_model_rejects_what_it_cannot_split() -> None:
    with pytest.raises(ValueError, match="no link model"):
        split_by_link("gather", WORLD4, 0, 2, 8)
    with pytest.raises(ValueError, match="root"):
        split_by_link("broadcast", WORLD4, 0, 2, 8)
    with pytest.raises(ValueError, match="ranks_per_node"):
        split_by_link("all_reduce", WORLD4, 0, 0, 8)


def _logged() -> dict:
    from zero_core import comm
    from zero_core.comm import comms_logger
    from zero_core.comm.topology import node_groups

    rank = comm.get_rank()
    intra_group, inter_group = node_groups()
    comms_logger.reset()
    comms_logger.enable()
    t = torch.ones(100)  # 400 bytes
    comm.all_reduce(t)
    comm.all_reduce(t, group=intra_group)
    comm.all_reduce(t, group=inter_group)
    comm.broadcast(t, src=0)
    out = torch.empty(100)
    comm.all_to_all_single(out, t)
    comm.all_gather_into_tensor(torch.empty(400), t)
    if rank == 0:
        comm.send(t, dst=3)
    elif rank == 3:
        comm.recv(t, src=0)
    comms_logger.disable()
    return {
        "all": comms_logger.bytes_by_link(),
        "all_reduce": comms_logger.bytes_by_link("all_reduce"),
        "inter_group": comms_logger.bytes_by_link("all_reduce", tuple(range(rank % 2, 4, 2))),
    }


def test_logger_counts_by_link_on_four_ranks() -> None:
    got = run_multirank(_logged, 4, timeout=120, env={"ZERO_RANKS_PER_NODE": "2"})
    # all_reduce: world (2*100 intra, 2*200 inter) + node group (400 intra) + inter group (400 inter)
    for r in range(4):
        assert got[r]["all_reduce"] == {"intra_node": 200 + 400, "inter_node": 400 + 400}
        assert got[r]["inter_group"] == {"intra_node": 0, "inter_node": 400}
    # rank 0 also broadcasts 400 to 1 (intra) and to 2, 3 (inter), sends 400 to rank 3 (inter);
    # all-to-all 100 to each other rank; all-gather its 400 to each other rank
    a2a, ag = (100, 200), (400, 800)
    assert got[0]["all"] == {
        "intra_node": 600 + 400 + a2a[0] + ag[0],
        "inter_node": 800 + 800 + 400 + a2a[1] + ag[1],
    }
    assert got[3]["all"] == {"intra_node": 600 + a2a[0] + ag[0], "inter_node": 800 + a2a[1] + ag[1]}
