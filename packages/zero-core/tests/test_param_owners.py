"""Per-parameter ZeRO state is kept by the strategies; a parameter holds only a weak reference
to its owner.

See [Note: parameter owners] in ``zero_core/zero/param_owners.py``: stages 0-2 put a weak
reference to each trainable parameter's owner on it (``_zero_owner``; stages 1-2 keep a
``ParamLocation`` per parameter) and ``engine.destroy()`` takes it off. After a training step
no parameter carries another ``_zero*`` attribute, the safe_get helpers find the owner from the
parameter alone, and a frozen parameter has no owner.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank
from zero_core.zero.param_owners import ParamLocation, owner_of, register_owner, release_owner


def _worker() -> dict:
    import zero_core
    from zero_core import comm
    from zero_core.utils import safe_get_full_fp32_param

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
            "zero_attrs": sorted({k for p in model.parameters() for k in vars(p) if k.startswith("_zero")}),
            "owned": [owner_of(p) is not None for p in model.parameters()],
            "full_equals_module": bool(torch.equal(safe_get_full_fp32_param(w), w.detach().float())),
        }
        if stage > 0:
            res["location"] = tuple(engine.strategy.state_access.param_location(w))
        engine.destroy()
        res["owned_after_destroy"] = any(owner_of(p) is not None for p in model.parameters())
        res["zero_attrs_after_destroy"] = sorted(
            k for p in model.parameters() for k in vars(p) if k.startswith("_zero")
        )
        out[stage] = res
    return out


def test_stages_0_to_2_put_only_a_weak_owner_reference_on_the_parameter() -> None:
    for res in run_multirank(_worker, 2, timeout=240):
        for stage, r in res.items():
            assert r["zero_attrs"] == ["_zero_owner"], (stage, r["zero_attrs"])
            assert r["zero_attrs_after_destroy"] == [], (stage, r["zero_attrs_after_destroy"])
            # parameters: w0, b0 (frozen), w2, b2
            assert r["owned"] == [True, False, True, True], (stage, r["owned"])
            assert r["full_equals_module"], stage
            assert not r["owned_after_destroy"], stage
            if stage > 0:
                group, index = r["location"]
                assert group == 0 and index >= 0, (stage, r["location"])


class _Owner:
    pass


def test_owner_reference_is_weak_and_keeps_the_latest_owner() -> None:
    p = nn.Parameter(torch.zeros(3))
    first, second = _Owner(), _Owner()
    register_owner([p], first)
    register_owner([p], second)
    release_owner([p], first)  # an earlier owner's close leaves the later owner in place
    assert owner_of(p) is second
    release_owner([p], second)
    assert owner_of(p) is None and "_zero_owner" not in vars(p)
    register_owner([p], first)
    buf = io.BytesIO()
    torch.save(p, buf)  # a saved parameter (torch.save(model)) comes back without an owner
    buf.seek(0)
    assert owner_of(torch.load(buf, weights_only=False)) is None and owner_of(p) is first
    del first  # the parameter never keeps its owner alive
    assert owner_of(p) is None
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
