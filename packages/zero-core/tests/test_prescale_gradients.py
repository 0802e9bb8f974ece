"""``prescale_gradients`` and ``gradient_predivide_factor``: where the division by the world size happens.

Stage 0 sums first and divides after, as DeepSpeed does by default; ``prescale_gradients``
divides by the world size before the sum, ``gradient_predivide_factor`` by that factor before
and by ``world / factor`` after. The results agree to fp32 rounding; the order is visible in
fp16, where per-rank gradients of 40960 overflow when summed first (81920 > 65504) and do not
when divided first. Stages 1-3 always divide before the sum. See the scaling paragraph of
[Note: gradient buckets] in zero_core/engine/grad_buckets.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank

MICRO, DIM = 4, 8


def _fp16_step(stage: int, extra: dict) -> tuple[int, list[float]]:
    """One fp16 step whose per-rank weight gradient is 40960 (static loss scale 1024)."""
    import zero_core
    from zero_core.zero.debug_access import safe_get_full_grad

    torch.manual_seed(0)
    model = nn.Linear(DIM, 1, bias=False)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10**6,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-6}},
        "fp16": {"enabled": True, "loss_scale": 1024},
        "zero_optimization": {"stage": stage},
        **extra,
    }
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    engine.backward(engine(torch.ones(MICRO, DIM, dtype=torch.float16)).float().sum() * 10)
    grad = safe_get_full_grad(model.weight)
    engine.step()
    skipped = engine.skipped_steps
    engine.destroy()
    return skipped, grad.reshape(-1).tolist()


def _fp16_cases() -> list:
    return [
        _fp16_step(0, {}),
        _fp16_step(0, {"prescale_gradients": True}),
        _fp16_step(0, {"gradient_predivide_factor": 2.0}),
        _fp16_step(2, {}),
        _fp16_step(2, {"prescale_gradients": True}),
    ]


def test_fp16_shows_the_division_before_the_sum() -> None:
    for default, prescaled, predivided, stage2, stage2_prescaled in run_multirank(_fp16_cases, 2):
        assert default[0] == 1  # 40960 + 40960 overflows fp16: the step is skipped
        assert prescaled == (0, [40.0] * DIM)  # 20480 + 20480: the unscaled mean gradient, 40
        assert predivided == (0, [40.0] * DIM)
        assert stage2 == stage2_prescaled == (0, [40.0] * DIM)  # stages 1-3 always divide first


def _fp32_grads(extra: dict) -> list[torch.Tensor]:
    import zero_core
    from zero_core import comm
    from zero_core.zero.debug_access import safe_get_full_grad

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 2))
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, **extra}
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    x = torch.randn(MICRO, DIM, generator=torch.Generator().manual_seed(comm.get_rank()))
    engine.backward(engine(x).pow(2).mean())
    grads = [safe_get_full_grad(p) for p in model.parameters()]
    engine.step()
    engine.destroy()
    return grads


def _fp32_cases() -> list:
    return [_fp32_grads(e) for e in ({}, {"prescale_gradients": True}, {"gradient_predivide_factor": 3.0})]


@pytest.mark.parametrize("world", [1, 2])
def test_results_agree_to_fp32_rounding(world: int) -> None:
    for default, prescaled, predivided in run_multirank(_fp32_cases, world):
        for d, p, q in zip(default, prescaled, predivided):
            torch.testing.assert_close(p, d, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(q, d, rtol=1e-6, atol=1e-7)


def test_predivide_factor_at_stages_1_to_3_is_an_error() -> None:
    from zero_core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="gradient_predivide_factor: 2 applies at ZeRO stage 0"):
        load_config(
            {"train_batch_size": 8, "gradient_predivide_factor": 2.0, "zero_optimization": {"stage": 2}}
        )
