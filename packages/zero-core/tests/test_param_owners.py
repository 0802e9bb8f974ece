"""Per-parameter ZeRO state is kept by the strategies, not patched onto ``nn.Parameter``.

See [Note: parameter owner registry] in ``zero_core/zero/param_owners.py``: stages 0-2 register
each trainable parameter's owner in ``PARAM_OWNERS`` (stages 1-2 keep a ``ParamLocation`` per
parameter) and ``engine.destroy()`` removes the entries. After a training step no parameter
carries a ``_zero*`` attribute, the safe_get helpers still find the owner from the parameter
alone, and a frozen parameter has no owner.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank
from zero_core.zero.param_owners import ParamLocation, ParamOwnerRegistry


def _worker() -> dict:
    import zero_core
    from zero_core import comm
    from zero_core.utils import safe_get_full_fp32_param
    from zero_core.zero.param_owners import PARAM_OWNERS

    out = {}
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
        model[0].bias.requires_grad_(False)
        cfg = {
            "train_micro_batch_size_per_gpu": 3,
            "steps_per_print": 10**6,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 20},
        }
        engine = zero_core.initialize(model=model, config=cfg)[0]
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(comm.get_rank()))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        w = model[2].weight
        res = {
            "zero_attrs": sorted(k for p in model.parameters() for k in vars(p) if k.startswith("_zero")),
            "owned": [PARAM_OWNERS.owner_of(p) is not None for p in model.parameters()],
            "full_equals_module": bool(torch.equal(safe_get_full_fp32_param(w), w.detach().float())),
        }
        if stage > 0:
            res["location"] = tuple(engine.strategy.state_access.param_location(w))
        engine.destroy()
        res["owned_after_destroy"] = any(PARAM_OWNERS.owner_of(p) is not None for p in model.parameters())
        out[stage] = res
    return out


def test_stages_0_to_2_keep_parameter_state_off_the_parameter() -> None:
    for res in run_multirank(_worker, 2, timeout=240):
        for stage, r in res.items():
            assert r["zero_attrs"] == [], (stage, r["zero_attrs"])
            # parameters: w0, b0 (frozen), w2, b2
            assert r["owned"] == [True, False, True, True], (stage, r["owned"])
            assert r["full_equals_module"], stage
            assert not r["owned_after_destroy"], stage
            if stage > 0:
                group, index = r["location"]
                assert group == 0 and index >= 0, (stage, r["location"])


def test_registry_is_weak_and_keeps_the_latest_owner() -> None:
    reg = ParamOwnerRegistry()
    p = nn.Parameter(torch.zeros(3))
    first, second = object(), object()
    reg.register([p], first)
    reg.register([p], second)
    reg.release([p], first)  # an earlier owner's close leaves the later owner in place
    assert reg.owner_of(p) is second
    reg.release([p], second)
    assert reg.owner_of(p) is None
    reg.register([p], first)
    del p
    assert len(reg._owners) == 0
    loc = ParamLocation(1, 4)
    assert tuple(loc) == (1, 4)
    with pytest.raises(AttributeError):
        loc.group = 2  # type: ignore[misc]


def test_stage3_switches_live_in_the_runtime_context() -> None:
    from zero_core.zero.stage3.partitioned_param import collective_checks, set_collective_checks
    from zero_core.zero.stage3.runtime_context import stage3_context

    ctx = stage3_context()
    before = ctx.collective_checks
    try:
        set_collective_checks(False)
        assert ctx.collective_checks is False and collective_checks() is False
        set_collective_checks(True)
        assert ctx.collective_checks is True and collective_checks() is True
        with pytest.raises(TypeError, match="must be a bool"):
            set_collective_checks(1)  # type: ignore[arg-type]
        a, b = ctx.next_param_id(), ctx.next_param_id()
        assert b == a + 1
    finally:
        ctx.collective_checks = before
