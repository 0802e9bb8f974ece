"""DeepSpeed's engine accessors (see [Note: DeepSpeed engine accessors]) answer from the config and
the engine's state; ``set_gradient_accumulation_boundary`` overrides the micro-step count."""

from __future__ import annotations

import pytest
import torch
from zero_core.engine.accessors import DeepSpeedAccessors
from zero_core.testing import run_multirank


def _accessors() -> dict:
    import zero_core

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 4,
        "bf16": {"enabled": True},
        "communication_data_type": "fp32",
        "steps_per_print": 7,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "betas": [0.8, 0.9]}},
        "zero_optimization": {"stage": 2},  # with offload: zero-offload's test_offload_accessors.py
    }
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    out = {
        "stage": engine.zero_optimization_stage(),
        "zero": engine.zero_optimization(),
        "grads": engine.zero_optimization_partition_gradients(),
        "weights": engine.zero_optimization_partition_weights(),
        "cpu_offload": engine.zero_cpu_offload(),
        "bf16": engine.bfloat16_enabled(),
        "fp16": engine.fp16_enabled(),
        "type": engine.get_type(),
        "comm": engine.communication_data_type,
        "print": engine.steps_per_print(),
        "mom": engine.get_mom(),
        "world": engine.world_size,
        "applied_before": engine.was_step_applied(),
    }
    x = torch.ones(1, 4, dtype=torch.bfloat16)
    before = [p.detach().float().clone() for p in model.parameters()]
    engine.set_gradient_accumulation_boundary(True)  # a short window: step after one micro-batch
    engine.backward(engine(x).float().sum())
    engine.step()
    out["stepped_early"] = engine.global_steps == 1 and engine.was_step_applied()
    out["moved"] = any(not torch.equal(a, p.detach().float()) for a, p in zip(before, model.parameters()))
    engine.set_gradient_accumulation_boundary(None)  # back to counting: micro-steps 4, 8, ... end windows
    counted = []
    for _ in range(4):
        engine.backward(engine(x).float().sum())
        engine.step()
        counted.append(engine.global_steps)
    out["counted"] = counted
    return out


def test_accessors_read_the_run():
    for rank, out in enumerate(run_multirank(_accessors, 2)):
        assert (out["stage"], out["zero"], out["grads"], out["weights"]) == (2, True, True, False), rank
        assert not out["cpu_offload"] and out["bf16"] and not out["fp16"]
        assert out["type"] == torch.bfloat16 and out["comm"] == torch.float32
        assert out["print"] == 7 and out["mom"] == [(0.8, 0.9)] and out["world"] == 2
        assert out["applied_before"] is False
        assert out["stepped_early"] and out["moved"]
        assert out["counted"] == [1, 1, 2, 2]  # micro-step 4 (the third after the override) ends a window


def test_boundary_override_rejects_non_bool():
    with pytest.raises(TypeError, match="expected a bool or None"):
        DeepSpeedAccessors().set_gradient_accumulation_boundary(1)
