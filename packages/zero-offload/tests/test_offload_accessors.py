"""DeepSpeed's ``engine.zero_cpu_offload()`` reports optimizer offload to the CPU."""

from __future__ import annotations

import pytest
import torch
from zero_core.testing import run_multirank


def _offload_flags(device: str) -> tuple[bool, int]:
    import zero_core

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    zero = {"stage": 2}
    if device != "none":
        zero["offload_optimizer"] = {"device": device}
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "zero_optimization": zero,
    }
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    return engine.zero_cpu_offload(), engine.zero_optimization_stage()


@pytest.mark.parametrize(("device", "expected"), [("cpu", True), ("none", False)])
def test_zero_cpu_offload_reports_the_config(device: str, expected: bool) -> None:
    for rank, (offload, stage) in enumerate(run_multirank(_offload_flags, 2, args=(device,))):
        assert offload is expected and stage == 2, rank
