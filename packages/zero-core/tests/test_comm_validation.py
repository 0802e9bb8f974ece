"""zero_core.comm input validation, and clear errors without a process group."""

from __future__ import annotations

import pytest
import torch
from zero_core import comm
from zero_core.testing import multirank


def test_uninitialized_errors_name_the_fix():
    assert not comm.is_initialized()
    for call in (
        lambda: comm.get_rank(),
        lambda: comm.all_reduce(torch.ones(1)),
        lambda: comm.barrier(),
        lambda: comm.new_group([0]),
    ):
        with pytest.raises(
            RuntimeError, match="default process group is not initialized; call zero_core.distributed"
        ):
            call()


@multirank(world_sizes=(2,))
def test_argument_validation():
    with pytest.raises(TypeError, match="all_reduce: tensor must be a torch.Tensor, got list"):
        comm.all_reduce([1.0])
    with pytest.raises(TypeError, match="op must be a zero_core.comm.ReduceOp"):
        comm.all_reduce(torch.ones(1), op="sum")
    with pytest.raises(TypeError, match="group must be a ProcessGroup or None"):
        comm.all_reduce(torch.ones(1), group="world")
    with pytest.raises(ValueError, match="dst must be the global rank"):
        comm.reduce(torch.ones(1), 2)
    with pytest.raises(ValueError, match="tensor_list must be a list of world_size \\(2\\)"):
        comm.all_gather([torch.empty(1)], torch.ones(1))
    with pytest.raises(ValueError, match="output_split_sizes must be 2 non-negative ints"):
        comm.all_to_all_single(torch.empty(2), torch.empty(2), [1], None)
    with pytest.raises(ValueError, match="dim 0 \\(3\\) must be divisible"):
        comm.all_to_all_single(torch.empty(3), torch.empty(3))
    with pytest.raises(ValueError, match="object_list must be a list of world_size"):
        comm.all_gather_object([None], 1)
    with pytest.raises(ValueError, match="ranks must be ints in \\[0, 2\\)"):
        comm.new_group([0, 2])
    with pytest.raises(ValueError, match="ranks must be unique"):
        comm.new_group([1, 1])
