"""ZeRO stages 1 and 2 with fp16 dynamic loss scaling and with bf16.

An inf injected into one rank's gradient lands in (at least) one rank's reduced partition;
the overflow decision is global, so every rank skips the step, leaves parameters and
optimizer states untouched and halves the loss scale (hysteresis 1 here; see
[Note: loss scaling]). bf16 training lowers the loss.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from zero_core.testing import run_multirank

DIM = 33


def _engine(stage: int, precision: str):
    import zero_core

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 3))
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "overlap_comm": True},
    }
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1}
    else:
        cfg["bf16"] = {"enabled": True}
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    return engine, model


def _batch(step: int, rank: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(10 * step + rank)
    x = torch.randn(8, DIM, generator=g)
    return x.to(dtype), (x[:, :3] * 0.5).to(dtype)


def _run() -> dict:
    from zero_core import comm

    rank = comm.get_rank()
    out: dict = {}
    for stage in (1, 2):
        engine, model = _engine(stage, "fp16")
        poison = {"on": False}
        target = model[2].weight
        target.register_hook(lambda g, poison=poison: g.fill_(float("inf")) if poison["on"] else g)
        scales, skipped, changed = [], [], []
        for step in range(4):
            poison["on"] = step == 2 and rank == 1
            before = [p.detach().clone() for p in model.parameters()]
            masters = [m.detach().clone() for m in engine.strategy.masters]
            x, y = _batch(step, rank, torch.float16)
            engine.backward((engine(x).float() - y.float()).pow(2).mean())
            engine.step()
            scales.append(engine.loss_scaler.loss_scale)
            skipped.append(engine.skipped_steps)
            moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
            moved |= any(not torch.equal(a, b) for a, b in zip(masters, engine.strategy.masters))
            changed.append(moved)
        out[("fp16", stage)] = (
            scales,
            skipped,
            changed,
            [p.detach().float().clone() for p in model.parameters()],
        )

        engine, model = _engine(stage, "bf16")
        losses = []
        for step in range(30):
            x, y = _batch(step % 3, rank, torch.bfloat16)
            loss = (engine(x).float() - y.float()).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[("bf16", stage)] = (
            losses,
            model[0].weight.dtype,
            [p.detach().float().clone() for p in model.parameters()],
        )
    return out


def test_stage12_fp16_overflow_skips_everywhere_and_bf16_trains() -> None:
    results = run_multirank(_run, 2, timeout=120)
    for stage in (1, 2):
        for rank, res in enumerate(results):
            scales, skipped, changed, _ = res[("fp16", stage)]
            assert scales == [256.0, 256.0, 128.0, 128.0], (stage, rank, scales)
            assert skipped == [0, 0, 1, 1], (stage, rank, skipped)
            assert changed == [True, True, False, True], (stage, rank, changed)
            losses, dtype, _ = res[("bf16", stage)]
            assert dtype == torch.bfloat16
            assert sum(losses[-3:]) < 0.5 * sum(losses[:3]), (stage, rank, losses)
        # the ranks stay identical
        for key in (("fp16", stage), ("bf16", stage)):
            for a, b in zip(results[0][key][-1], results[1][key][-1]):
                assert torch.equal(a, b), key
