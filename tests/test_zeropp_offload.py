"""MiCS and ZeRO++ hpZ with the optimizer offloaded to the CPU (zero-offload): exact training.

4 ranks as 2 nodes x 2 (``ZERO_RANKS_PER_NODE=2``); fp32, so each trajectory equals the
single-process one within 1e-5 relative (see zero-core's test_stage3_mics_hpz.py for the rest).
"""

from __future__ import annotations

import pytest
import torch
from zero_core.testing import run_multirank

DIM, BATCH, STEPS, WORLD = 16, 4, 3, 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, 4 * DIM),
        torch.nn.Tanh(),
        torch.nn.Linear(4 * DIM, DIM),
        torch.nn.Tanh(),
        torch.nn.Linear(DIM, 1),
    )


def _data() -> torch.Tensor:
    return torch.randn(STEPS, WORLD, BATCH, DIM, generator=torch.Generator().manual_seed(7))


def _reference() -> list[list[float]]:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data, losses = _data(), []
    for s in range(STEPS):
        row = []
        for r in range(WORLD):
            loss = model(data[s, r]).pow(2).mean()
            (loss / WORLD).backward()
            row.append(loss.item())
        losses.append(row)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    return losses


def _train(zero_extra: dict) -> list[float]:
    import zero
    from zero_core import comm

    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "adam_w_mode": False}},
        "zero_optimization": {
            "stage": 3,
            "param_persistence_threshold": 0,
            "offload_optimizer": {"device": "cpu"},
            **zero_extra,
        },
    }
    engine, *_ = zero.initialize(model=_model(), config=cfg)
    assert engine.strategy.offload is not None
    data, rank, out = _data(), comm.get_rank(), []
    for s in range(STEPS):
        loss = engine(data[s, rank]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def _both() -> list:
    return [_train({"mics_shard_size": 2}), _train({"zero_hpz_partition_size": 2})]


def test_mics_and_hpz_with_cpu_optimizer_offload_match_single_process() -> None:
    ref = _reference()
    got = run_multirank(_both, WORLD, timeout=300, env={"ZERO_RANKS_PER_NODE": "2"})
    for r in range(WORLD):
        for variant in got[r]:
            assert variant == pytest.approx([row[r] for row in ref], rel=1e-5)
