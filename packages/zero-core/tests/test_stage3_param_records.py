"""Stage-3 per-parameter state lives in the record table, not on ``nn.Parameter``.

See [Note: stage 3 parameter records] in ``zero_core/zero/stage3/param_records.py``: after
``zero.Init`` and ``initialize`` at stage 3 (and a training step) no parameter carries
``zero_state`` or a ``_zero*`` attribute, every parameter has a record that the public names
(``zero_numel``, ``zero_shape``, ``zero_shard``) agree with, and once the engine is destroyed and
the model dropped the table holds no entry for them.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank
from zero_core.zero.stage3.param_records import PartitionRecords, full_shape, is_partitioned, partition_state


def _attrs(model: nn.Module) -> list[str]:
    return sorted(
        {k for p in model.parameters() for k in vars(p) if k == "zero_state" or k.startswith("_zero")}
    )


def _train_and_drop(use_init: bool) -> dict:
    import zero_core
    from zero_core import comm
    from zero_core.zero.stage3.param_records import PARTITION_RECORDS

    before = len(PARTITION_RECORDS)
    torch.manual_seed(0)
    if use_init:
        with zero_core.Init():
            model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    else:
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    shapes = [tuple(p.shape) for p in model.parameters()]  # empty when zero.Init partitioned them
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
        "records_in_use": len(PARTITION_RECORDS) - before,
    }
    engine.destroy()
    res["attrs_after_destroy"] = _attrs(model)
    # a parameter that outlives destroy() keeps its record (it is still partitioned)
    res["partitioned_after_destroy"] = all(is_partitioned(p) for p in params)
    del engine, model, params, x
    gc.collect()
    res["records_left"] = len(PARTITION_RECORDS) - before
    return res


def _worker() -> dict:
    return {"init": _train_and_drop(True), "initialize": _train_and_drop(False)}


def test_stage3_keeps_records_off_the_parameter_and_releases_them() -> None:
    for res in run_multirank(_worker, 2, timeout=300):
        for how, r in res.items():
            assert r["attrs"] == [] and r["attrs_after_destroy"] == [], (how, r)
            assert r["partitioned"] == [True] * 4, (how, r["partitioned"])
            assert r["full_shapes"] == [(5, 6), (5,), (2, 5), (2,)], (how, r["full_shapes"])
            assert r["public_agree"], how
            assert r["records_in_use"] == 4, (how, r["records_in_use"])
            assert r["partitioned_after_destroy"], how
            assert r["records_left"] == 0, (how, r["records_left"])
        assert res["init"]["shapes_before_engine"] == [(0,)] * 4, res["init"]["shapes_before_engine"]


def test_record_table_is_weak_and_by_identity() -> None:
    table = PartitionRecords()
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))  # equal values, distinct params
    rec = object()
    table.add(a, rec)
    assert table.get(a) is rec and a in table and table.get(b) is None and b not in table
    assert table.params() == [a]
    del a
    gc.collect()
    assert len(table) == 0 and table.params() == []


def test_lookups_of_an_unpartitioned_parameter() -> None:
    p = nn.Parameter(torch.zeros(2, 3))
    assert not is_partitioned(p) and full_shape(p) == (2, 3)
    with pytest.raises(ValueError, match="not partitioned by ZeRO stage 3"):
        partition_state(p)
