"""Reading and writing partitioned state: zero.utils.safe_get_*/safe_set_* and state_dict.

The getters assemble the full fp32 value, reduced gradient and Adam states of a parameter
from every rank's partition; they must equal what single-process PyTorch holds after the
same steps on the global batch. Bucket size 50 splits parameters over several chunks.
The ``safe_get_local_*`` getters return the elements this rank owns (no communication);
writing every rank's local part with ``safe_set_local_*`` rebuilds a full value. Both stages
run in one launch.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from zero_core.testing import run_multirank

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(9, 11), nn.Tanh(), nn.Linear(11, 3))


def _data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 9, generator=torch.Generator().manual_seed(7 * step + rank))


def _reference(world: int) -> dict:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS + 1):
        loss = sum(model(_data(step, r)).pow(2).mean() for r in range(world)) / world
        loss.backward()
        if step == STEPS:
            break
        opt.step()
        opt.zero_grad()
    w = model[2].weight
    return {
        "param": w.detach().clone(),
        "grad": w.grad.clone(),
        "exp_avg": opt.state[w]["exp_avg"].clone(),
        "exp_avg_sq": opt.state[w]["exp_avg_sq"].clone(),
        "step": float(opt.state[w]["step"]),
    }


def _run(stage: int) -> dict:
    import zero_core
    from zero_core import comm
    from zero_core.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )
    from zero_core.zero.debug_access import (
        safe_get_local_fp32_param,
        safe_get_local_grad,
        safe_get_local_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    rank = comm.get_rank()
    model = _model()
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "adam_w_mode": False}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50},
    }
    engine = zero_core.initialize(model=model, config=cfg)[0]
    for step in range(STEPS + 1):
        engine.backward(engine(_data(step, rank)).pow(2).mean())
        if step < STEPS:
            engine.step()
    w = model[2].weight
    out = {
        "param": safe_get_full_fp32_param(w),
        "grad": safe_get_full_grad(w),
        "exp_avg": safe_get_full_optimizer_state(w, "exp_avg"),
        "exp_avg_sq": safe_get_full_optimizer_state(w, "exp_avg_sq"),
        "step": float(safe_get_full_optimizer_state(w, "step")),
    }
    # this rank's owned elements of w, as (offset in w's flat order, length)
    g, i = engine.strategy.state_access.param_location(w)
    owned = [(po, n) for _, po, n in engine.strategy.state_access.own_segments(g, i)]
    out["owned"] = owned
    out["local"] = {
        "param": safe_get_local_fp32_param(w),
        "grad": safe_get_local_grad(w),
        "exp_avg": safe_get_local_optimizer_state(w, "exp_avg"),
        "exp_avg_sq": safe_get_local_optimizer_state(w, "exp_avg_sq"),
    }
    local_new = torch.cat(
        [(torch.arange(w.numel(), dtype=torch.float32) / 7)[po : po + n] for po, n in owned]
    )
    safe_set_local_fp32_param(w, local_new)
    safe_set_local_optimizer_state(w, local_new * 3, "exp_avg_sq")
    out["set_local_param"] = safe_get_full_fp32_param(w)
    out["set_local_exp_avg_sq"] = safe_get_full_optimizer_state(w, "exp_avg_sq")
    try:
        safe_set_local_fp32_param(w, torch.zeros(w.numel() + 1))
    except ValueError as e:
        out["local_error"] = str(e)
    errors = []
    for call in (
        lambda: safe_set_full_fp32_param(w, torch.zeros(2, 2)),
        lambda: safe_get_full_optimizer_state(w, "momentum_buffer"),
        lambda: safe_get_full_fp32_param("w"),
    ):
        try:
            call()
        except (ValueError, KeyError, TypeError) as e:
            errors.append(type(e).__name__ + ": " + str(e))
    out["errors"] = errors

    new = torch.arange(w.numel(), dtype=torch.float32).view_as(w) / 10
    safe_set_full_fp32_param(w, new)
    safe_set_full_optimizer_state(w, new * 2, "exp_avg")
    out["set_param"] = safe_get_full_fp32_param(w)
    out["set_module"] = w.detach().clone()
    out["set_exp_avg"] = safe_get_full_optimizer_state(w, "exp_avg")

    # state_dict round trip: a fresh engine loading this rank's state continues identically
    engine.step()
    saved = engine.strategy.state_dict()
    engine.backward(engine(_data(9, rank)).pow(2).mean())
    engine.step()
    after = [p.detach().clone() for p in model.parameters()]
    model2 = _model()
    engine2 = zero_core.initialize(model=model2, config=cfg)[0]
    engine2.strategy.load_state_dict(saved)
    engine2.backward(engine2(_data(9, rank)).pow(2).mean())
    engine2.step()
    out["resume_equal"] = all(torch.equal(a, b) for a, b in zip(after, model2.parameters()))
    return out


def _run_both() -> dict:
    return {stage: _run(stage) for stage in (1, 2)}


def _check(ref: dict, res: dict, rank: int, stage: int) -> None:
    where = f"rank {rank}, stage {stage}"
    for key in ("param", "grad", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(
            res[key], ref[key], rtol=1e-5, atol=1e-7, msg=lambda m, k=key: f"{k}, {where}: {m}"
        )
    assert res["step"] == ref["step"]
    assert len(res["errors"]) == 3, res["errors"]
    assert "shape (2, 2)" in res["errors"][0] and "(3, 11)" in res["errors"][0]
    assert "momentum_buffer" in res["errors"][1] and "exp_avg" in res["errors"][1]
    assert res["errors"][2].startswith("TypeError")
    new = torch.arange(33, dtype=torch.float32).view(3, 11) / 10
    torch.testing.assert_close(res["set_param"], new)
    torch.testing.assert_close(res["set_module"], new)
    torch.testing.assert_close(res["set_exp_avg"], new * 2)
    assert res["resume_equal"], f"{where}: training resumed from state_dict diverged"
    # local getters: exactly this rank's owned elements of the full reference values
    for key in ("param", "grad", "exp_avg", "exp_avg_sq"):
        want = torch.cat([ref[key].reshape(-1)[po : po + n] for po, n in res["owned"]])
        torch.testing.assert_close(
            res["local"][key], want, rtol=1e-5, atol=1e-7, msg=lambda m, k=key: f"local {k}, {where}: {m}"
        )
    # every rank wrote its own part: together they form the full new value
    local_new = torch.arange(33, dtype=torch.float32).view(3, 11) / 7
    torch.testing.assert_close(res["set_local_param"], local_new)
    torch.testing.assert_close(res["set_local_exp_avg_sq"], local_new * 3)
    assert "owns" in res["local_error"] and str(sum(n for _, n in res["owned"])) in res["local_error"]


def test_stage12_safe_get_set_and_state_dict() -> None:
    world = 2
    ref = _reference(world)
    results = run_multirank(_run_both, world, timeout=120)
    for stage in (1, 2):
        for rank, by_stage in enumerate(results):
            _check(ref, by_stage[stage], rank, stage)
        # the ranks' owned parts tile the parameter exactly once
        covered = sorted(seg for by_stage in results for seg in by_stage[stage]["owned"])
        pos = 0
        for po, n in covered:
            assert po == pos and n > 0, covered
            pos += n
        assert pos == 33, covered
