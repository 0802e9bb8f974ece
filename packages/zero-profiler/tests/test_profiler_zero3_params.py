"""Parameter counts of ZeRO stage 3 partitioned parameters: the full size, not the local shard."""

from __future__ import annotations

import torch
import torch.nn as nn
from zero_profiler import FlopsProfiler, estimate_zero3_model_states_mem_needs_all_live
from zero_profiler.report import count_params, param_numel


def partition(module: nn.Module, attr: str, world: int = 4, rank: int = 1) -> None:
    """Make every parameter look like a released stage 3 parameter: local data is the shard
    (or empty), the full element count and shape are attributes (zero-core or DeepSpeed names)."""
    shape_attr = {"zero_numel": "zero_shape", "ds_numel": "ds_shape"}[attr]
    for p in module.parameters():
        full = p.numel()
        setattr(p, attr, full)
        setattr(p, shape_attr, p.shape)
        shard = -(-full // world)
        flat = torch.cat([p.data.flatten(), p.data.new_zeros(shard * world - full)])
        p.data = flat[rank * shard : (rank + 1) * shard].clone() if rank >= 0 else p.data.new_empty(0)


def test_param_numel_prefers_full_size_attributes():
    p = nn.Parameter(torch.empty(0))
    assert param_numel(p) == 0
    p.ds_numel = 120
    assert param_numel(p) == 120
    p.zero_numel = 120
    assert param_numel(p) == 120
    assert param_numel(nn.Parameter(torch.empty(3, 5))) == 15


def test_partitioned_params_count_full_size_both_conventions():
    for attr in ("zero_numel", "ds_numel"):
        for rank in (1, -1):  # a 1/N shard, or released (empty)
            model = nn.Sequential(nn.Linear(10, 7), nn.Linear(7, 3))
            full = sum(p.numel() for p in model.parameters())
            partition(model, attr, rank=rank)
            assert sum(p.numel() for p in model.parameters()) < full  # what a naive count sees
            assert count_params(model) == full, (attr, rank)
            prof = FlopsProfiler(model)
            prof.start_profile()
            assert prof.get_total_params() == full
            assert "params per GPU:" in prof.model_profile_text()
            prof.end_profile()


def test_shared_partitioned_parameter_counted_once():
    lin = nn.Linear(6, 6)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    partition(model, "zero_numel", rank=-1)  # released: every local tensor empty, same data_ptr
    assert count_params(model) == 6 * 6 + 6
    two = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6))
    partition(two, "ds_numel", rank=-1)
    assert count_params(two) == 2 * (6 * 6 + 6)  # distinct parameters are not merged


def test_memory_estimate_uses_full_size(capsys):
    model = nn.Linear(32, 32)
    expected = estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    partition(model, "ds_numel", rank=-1)
    assert estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2) == expected
    capsys.readouterr()
