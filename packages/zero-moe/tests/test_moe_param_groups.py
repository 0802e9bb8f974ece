"""Expert parameter tagging and optimizer parameter-group splitting."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zero_moe import (
    MoE,
    has_moe_layers,
    is_moe_param,
    is_moe_param_group,
    split_moe_and_non_moe_params,
    split_params_into_different_moe_groups_for_optimizer,
)


def _model() -> nn.Module:
    model = nn.Module()
    model.inp = nn.Linear(4, 4)
    model.moe = MoE(4, nn.Linear(4, 4), num_experts=3)
    return model


def test_is_moe_param_and_split():
    model = _model()
    assert has_moe_layers(model) and not has_moe_layers(nn.Linear(2, 2))
    dense, experts = split_moe_and_non_moe_params(model)
    assert set(experts) == {"ep_size_1"}
    assert len(experts["ep_size_1"]) == 6  # 3 experts x (weight, bias)
    assert all(is_moe_param(p) for p in experts["ep_size_1"])
    assert not any(is_moe_param(p) for p in dense)
    assert len(dense) + 6 == len(list(model.parameters()))


def test_split_param_groups_keeps_hyperparameters():
    model = _model()
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "lr": 0.5, "weight_decay": 0.1}
    )
    assert len(groups) == 2
    dense, moe = groups
    assert not is_moe_param_group(dense) and is_moe_param_group(moe)
    assert moe["name"] == "ep_size_1" and moe["lr"] == 0.5 and moe["weight_decay"] == 0.1
    assert all(is_moe_param(p) for p in moe["params"]) and not any(is_moe_param(p) for p in dense["params"])
    opt = torch.optim.SGD(groups, lr=0.1)  # torch accepts the extra keys
    assert len(opt.param_groups) == 2


def test_split_param_groups_respects_max_group_size():
    model = _model()
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters())}], max_group_size=20
    )
    moe_groups = [g for g in groups if is_moe_param_group(g)]
    # expert params are 16 + 4 elements each; at most 20 elements per group
    assert len(moe_groups) == 3
    assert all(sum(p.numel() for p in g["params"]) <= 20 for g in moe_groups)
    assert sum(len(g["params"]) for g in moe_groups) == 6


def test_split_param_groups_validation():
    with pytest.raises(TypeError, match="dict or a list"):
        split_params_into_different_moe_groups_for_optimizer(iter([]))
    with pytest.raises(TypeError, match="'params' entry"):
        split_params_into_different_moe_groups_for_optimizer([{"lr": 1.0}])
    with pytest.raises(ValueError, match="max_group_size"):
        split_params_into_different_moe_groups_for_optimizer({"params": []}, max_group_size=0)
