"""ZeRO-Infinity state access: masters and Adam states on NVMe are read and written where they live.

Stage 3 with ``offload_optimizer`` nvme (masters swapped with the states) and ``offload_param``
nvme: ``state_dict()`` / ``load_state_dict()`` of the strategy round-trip into a fresh engine
(same trajectory afterwards), and ``safe_set_full_fp32_param`` /
``safe_set_full_optimizer_state`` persist to NVMe: a run that sets values mid-training follows
exactly the trajectory of a non-offloaded run that sets the same values.
"""

from __future__ import annotations

import pytest
import torch
from zero_core.testing import run_multirank
from zero_core.testing.models import MLPClassifier, classification_batch
from zero_core.testing.parity import train_engine


def _engine(offload: bool, nvme: str):
    import zero_core

    torch.manual_seed(0)
    model = MLPClassifier(12, 40, 5)
    zc: dict = {"stage": 3, "sub_group_size": 300, "param_persistence_threshold": 0}
    if offload:
        zc["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "pipeline_read": True}
        zc["offload_param"] = {"device": "nvme", "nvme_path": nvme, "buffer_size": 1024, "max_in_cpu": 0}
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "zero_optimization": zc,
    }
    engine, *_ = zero_core.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), config=cfg
    )
    return engine, model


def _steps(engine, lo: int, hi: int) -> list[float]:
    from zero_core import comm

    world = comm.get_world_size()
    return train_engine(
        engine, lambda step: classification_batch(step, 4 * world, 12, 5), range(lo, hi), micro=4
    )


def _round_trip(nvme: str) -> dict:
    a, _ = _engine(True, nvme)
    _steps(a, 0, 3)
    sd = a.strategy.state_dict()
    after_a = _steps(a, 3, 6)
    a.destroy()
    b, _ = _engine(True, nvme)
    b.strategy.load_state_dict(sd)
    after_b = _steps(b, 3, 6)
    b.destroy()
    return {"a": after_a, "b": after_b, "has_states": sorted(next(iter(sd["optimizer"]["state"].values())))}


def _safe_set(offload: bool, nvme: str) -> dict:
    from zero_core.utils import (
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )

    e, model = _engine(offload, nvme)
    losses = _steps(e, 0, 2)
    w = model.l1.weight
    new_w = torch.linspace(-0.3, 0.3, w.zero_numel).view(tuple(w.zero_shape))
    safe_set_full_fp32_param(w, new_w)
    new_m = torch.full(tuple(w.zero_shape), 0.05)
    safe_set_full_optimizer_state(w, new_m, "exp_avg")
    got_w = safe_get_full_fp32_param(w)
    got_m = safe_get_full_optimizer_state(w, "exp_avg")
    losses += _steps(e, 2, 5)
    e.destroy()
    return {
        "losses": losses,
        "w_ok": bool(torch.equal(got_w, new_w)),
        "m_ok": bool(torch.equal(got_m, new_m)),
    }


def _all(nvme: str) -> dict:
    return {
        "round_trip": _round_trip(nvme),
        "set_off": _safe_set(True, nvme),
        "set_ref": _safe_set(False, nvme),
    }


@pytest.mark.parametrize("world", [1, 2])
def test_offload_infinity_state_dict_and_safe_set_persist(world: int, tmp_path) -> None:
    (r, *_) = run_multirank(_all, world, args=(str(tmp_path),), timeout=180)
    rt = r["round_trip"]
    assert "exp_avg" in rt["has_states"] and "exp_avg_sq" in rt["has_states"], rt
    torch.testing.assert_close(torch.tensor(rt["b"]), torch.tensor(rt["a"]), rtol=1e-6, atol=1e-7)
    off, ref = r["set_off"], r["set_ref"]
    assert off["w_ok"] and off["m_ok"] and ref["w_ok"] and ref["m_ok"], (off, ref)
    torch.testing.assert_close(torch.tensor(off["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)


def _stage12_set_state(nvme: str, stage: int) -> dict:
    """Stages 1 and 2 keep the masters in host memory and only the Adam states on NVMe: a state
    set between steps reaches the swap file (read back, and used by the next step)."""
    import zero_core
    from zero_core.zero.debug_access import (
        safe_get_full_optimizer_state,
        safe_get_local_optimizer_state,
        safe_set_full_optimizer_state,
        safe_set_local_optimizer_state,
    )

    out = {}
    for offload in (True, False):
        torch.manual_seed(0)
        model = MLPClassifier(12, 40, 5)
        zc: dict = {"stage": stage, "sub_group_size": 300}
        if offload:
            zc["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
        cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6, "zero_optimization": zc}
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        engine, *_ = zero_core.initialize(model=model, optimizer=opt, config=cfg)
        _steps(engine, 0, 2)
        first, last = list(model.parameters())[0], list(model.parameters())[-1]
        full = safe_get_full_optimizer_state(first, "exp_avg")
        safe_set_full_optimizer_state(first, full * 0.5 + 0.001, "exp_avg")
        local = safe_get_local_optimizer_state(last, "exp_avg_sq")
        safe_set_local_optimizer_state(last, local * 2.0, "exp_avg_sq")
        read_back = (
            safe_get_full_optimizer_state(first, "exp_avg").clone(),
            safe_get_local_optimizer_state(last, "exp_avg_sq").clone(),
        )
        expected = (full * 0.5 + 0.001, local * 2.0)
        losses = _steps(engine, 2, 5)
        out[offload] = {"read_back": read_back, "expected": expected, "losses": losses}
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_stage12_nvme_optimizer_state_setters_reach_the_swap_file(stage: int, tmp_path) -> None:
    for rank_out in run_multirank(_stage12_set_state, 2, args=(str(tmp_path), stage), timeout=180):
        for offload, r in rank_out.items():
            for got, want in zip(r["read_back"], r["expected"], strict=True):
                torch.testing.assert_close(got, want, msg=f"offload={offload}")
        torch.testing.assert_close(rank_out[True]["losses"], rank_out[False]["losses"], rtol=1e-5, atol=1e-6)
