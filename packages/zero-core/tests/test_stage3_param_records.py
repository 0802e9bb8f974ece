"""Stage-3 records are owned by ``zero.Init`` / the strategy and reached from the parameter.

See [Note: stage 3 parameter records] in ``zero_core/zero/stage3/param_records.py``: after
``zero.Init`` and ``initialize`` at stage 3 (and a training step) each parameter reaches its
record through ``_zero_record`` (and its safe_get owner through the weak ``_zero_owner``), the
strategy owns the records (``zero.Init`` handed its own over), the public names (``zero_numel``,
``zero_shape``, ``zero_shard``) agree with the record, and once the engine is destroyed and the
model dropped no record is left.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank
from zero_core.zero.stage3.param_records import full_shape, is_partitioned, partition_state, record_of


def _attrs(model: nn.Module) -> list[str]:
    return sorted(
        {k for p in model.parameters() for k in vars(p) if k == "zero_state" or k.startswith("_zero")}
    )


def _train_and_drop(use_init: bool) -> dict:
    import zero_core
    from zero_core import comm

    torch.manual_seed(0)
    init = zero_core.Init() if use_init else None
    if init is not None:
        with init:
            model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    else:
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    shapes = [tuple(p.shape) for p in model.parameters()]  # empty when zero.Init partitioned them
    init_owned = len(init.records) if init is not None else None
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "param_persistence_threshold": 0, "reduce_bucket_size": 20},
    }
    engine = zero_core.initialize(model=model, config=cfg)[0]
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(comm.get_rank()))
    for _ in range(2):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    params = list(model.parameters())
    strategy = engine.strategy
    res = {
        "attrs": _attrs(model),
        "partitioned": [is_partitioned(p) for p in params],
        "shapes_before_engine": shapes,
        "full_shapes": [full_shape(p) for p in params],
        "public_agree": all(
            p.zero_numel == partition_state(p).numel
            and tuple(p.zero_shape) == tuple(partition_state(p).shape)
            and p.zero_shard is partition_state(p).shard
            for p in params
        ),
        "strategy_owns": [st is partition_state(p) for st, p in zip(strategy.records, params)]
        + [partition_state(p).owner_of() is strategy for p in params],
        "init_owned_before": init_owned,
        "init_owned_after": len(init.records) if init is not None else None,
    }
    refs = [weakref.ref(partition_state(p)) for p in params]
    engine.destroy()
    res["attrs_after_destroy"] = _attrs(model)
    res["owner_after_destroy"] = [partition_state(p).owner_of() for p in params] == [None] * 4
    # a parameter that outlives destroy() keeps its record (it is still partitioned)
    res["partitioned_after_destroy"] = all(is_partitioned(p) for p in params)
    del engine, strategy, model, params, x
    gc.collect()
    res["records_left"] = sum(r() is not None for r in refs)
    return res


def _worker() -> dict:
    return {"init": _train_and_drop(True), "initialize": _train_and_drop(False)}


def test_stage3_records_are_owned_by_the_strategy_and_released() -> None:
    for res in run_multirank(_worker, 2, timeout=300):
        for how, r in res.items():
            assert r["attrs"] == ["_zero_owner", "_zero_record"], (how, r["attrs"])
            assert r["attrs_after_destroy"] == ["_zero_record"], (how, r["attrs_after_destroy"])
            assert r["partitioned"] == [True] * 4, (how, r["partitioned"])
            assert r["full_shapes"] == [(5, 6), (5,), (2, 5), (2,)], (how, r["full_shapes"])
            assert r["public_agree"], how
            assert r["strategy_owns"] == [True] * 8, (how, r["strategy_owns"])
            assert r["owner_after_destroy"], how
            assert r["partitioned_after_destroy"], how
            assert r["records_left"] == 0, (how, r["records_left"])
        assert res["init"]["shapes_before_engine"] == [(0,)] * 4, res["init"]["shapes_before_engine"]
        # zero.Init owned the four records until initialize took them
        assert (res["init"]["init_owned_before"], res["init"]["init_owned_after"]) == (4, 0), res["init"]


def _by_identity() -> bool:
    from zero_core.zero.stage3.partitioned_param import partition_param

    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))  # equal values, distinct params
    partition_param(a)
    assert record_of(a) is partition_state(a) and record_of(b) is None and not is_partitioned(b)
    assert partition_state(a).owner_of() is None  # partitioned by hand: no owner
    ref = weakref.ref(partition_state(a))
    del a
    gc.collect()
    return ref() is None


def test_a_record_belongs_to_its_parameter_by_identity() -> None:
    assert run_multirank(_by_identity, 1) == [True]


def test_lookups_of_an_unpartitioned_parameter() -> None:
    p = nn.Parameter(torch.zeros(2, 3))
    assert not is_partitioned(p) and full_shape(p) == (2, 3) and record_of(p) is None
    assert not is_partitioned(None) and not is_partitioned(3)
    with pytest.raises(ValueError, match="not partitioned by ZeRO stage 3"):
        partition_state(p)
