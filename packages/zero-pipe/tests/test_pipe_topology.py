"""ProcessTopology against the documented examples."""

from __future__ import annotations

import pytest
from zero_pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology


def test_documented_examples():
    x = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert x.get_rank(x=0, y=1) == 1
    assert x.get_dim("y") == 3
    coord = x.get_coord(rank=1)
    assert (coord.x, coord.y) == (0, 1)
    assert x.get_axis_list(axis="x", idx=0) == [0, 1, 2]
    assert x.get_axis_list(axis="y", idx=0) == [0, 3]
    assert x.get_axis_names() == ["x", "y"]
    t = ProcessTopology(axes=["a", "b"], dims=[2, 2])
    assert t.get_rank_repr(rank=3) == "a_01-b_01"
    assert t.get_rank_repr(rank=3, omit_axes=["a"]) == "b_01"
    p = ProcessTopology(axes=["pipe", "data", "model"], dims=[2, 2, 2])
    assert p.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert p.filter_match(pipe=0, data=1) == [2, 3]
    assert p.get_axis_comm_lists("nope") == []


def test_round_trip_and_named_topologies():
    t = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    assert t.get_axis_names() == ["pipe", "data", "model"]
    for rank in range(t.world_size()):
        assert t.get_rank(**t.get_coord(rank)._asdict()) == rank
    pd = PipeDataParallelTopology(num_pp=2, num_dp=2)
    assert pd.get_axis_comm_lists("data") == [[0, 1], [2, 3]]
    assert pd.get_rank_repr(3) == ""


def test_errors():
    with pytest.raises(ValueError, match="same length"):
        ProcessTopology(["a"], [1, 2])
    with pytest.raises(ValueError, match="unique"):
        ProcessTopology(["a", "a"], [1, 2])
    t = ProcessTopology(["a", "b"], [2, 2])
    with pytest.raises(ValueError, match="outside"):
        t.get_rank(a=2, b=0)
    with pytest.raises(ValueError, match="exactly the axes"):
        t.get_rank(a=0)
    with pytest.raises(ValueError, match="rank"):
        t.get_coord(4)
