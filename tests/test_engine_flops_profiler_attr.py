"""``engine.flops_profiler``: DeepSpeed's attribute for the engine's flops profiler.

DeepSpeed's engine holds a ``FlopsProfiler`` under ``engine.flops_profiler`` when the
``flops_profiler`` section is enabled; after the profiled step its ``flops``, ``macs`` and
``params`` are the forward totals of that step's profile. Cross-package (zero-core's engine,
zero-profiler's profiler), so it runs in the meta-package's environment.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch
import zero
from zero_core.testing import run_multirank
from zero_profiler import FlopsProfiler

HIDDEN = 10


class OneLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.linear(x), y)


def _train(config: dict, steps: int = 3) -> Any:
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=OneLinear(), config=config)
    with contextlib.redirect_stdout(io.StringIO()):
        for _ in range(steps):
            loss = engine(torch.randn(1, HIDDEN), torch.randint(0, HIDDEN, (1,)))
            engine.backward(loss)
            engine.step()
    return engine


BASE = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


def _profiled_rank() -> bool:
    cfg = {**BASE, "flops_profiler": {"enabled": True, "profile_step": 1, "top_modules": 3}}
    engine = _train(cfg)
    prof = engine.flops_profiler
    assert isinstance(prof, FlopsProfiler)
    assert prof is engine.profiler.profiler  # zero's name stays
    # one Linear(10, 10) on one sample: 2 * 100 MACs + 10 bias adds, plus the loss's few FLOPs
    assert prof.macs == HIDDEN * HIDDEN
    assert abs(prof.flops - 2 * HIDDEN * HIDDEN - HIDDEN) / 210 < 0.05
    assert prof.params == HIDDEN * HIDDEN + HIDDEN
    engine = _train(BASE, steps=1)  # without the section
    assert engine.flops_profiler is None and engine.profiler is None
    return True


def test_flops_profiler_is_the_profile_of_the_profiled_step_and_none_without_the_section():
    # initialize sets up a process group: in a forked rank, never in the test process
    assert run_multirank(_profiled_rank, 1, timeout=120) == [True]
