"""StepProfiler: the flops_profiler config section applied in a training loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from zero_profiler import FlopsProfilerConfig, StepProfiler


class FakeEngine:
    world_size = 1
    dp_world_size = 1
    mp_world_size = 1

    def train_micro_batch_size_per_gpu(self):
        return 4


def train(steps, hook, model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        hook.on_step_begin(step)
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        hook.on_optimizer_step_begin(step)
        opt.step()
        opt.zero_grad()
        hook.on_step_end(step)


def test_profiles_only_the_configured_step(capsys, tmp_path):
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 2, bias=False))
    out_file = tmp_path / "flops.txt"
    section = {"enabled": True, "profile_step": 2, "module_depth": -1, "top_modules": 1, "detailed": True,
               "output_file": str(out_file)}  # fmt: skip
    hook = StepProfiler(model, section, engine=FakeEngine())
    train(4, hook, model)
    text = out_file.read_text()
    assert "Profile Summary at step 2:" in text
    assert "batch size per GPU:" in text and "step latency:" in text and "bwd latency:" in text
    fwd = 2 * 4 * 8 * 8 + 2 * 4 * 8 * 2
    bwd = 2 * 4 * 8 * 8 + 2 * (2 * 4 * 8 * 2)  # first layer: weight grad only
    prof_lines = [
        ln for ln in text.splitlines() if ln.startswith("fwd flops per GPU:") or ln.startswith("bwd flops")
    ]
    assert prof_lines[0].split()[-1] == str(fwd)  # below 1K: printed without prefix
    assert prof_lines[1].split()[-1] == str(bwd)
    assert hook.last_profile == text
    assert all(not m._forward_hooks for m in model.modules())
    assert capsys.readouterr().out == ""


def test_disabled_does_nothing(capsys):
    model = nn.Linear(8, 2)
    hook = StepProfiler(model, {"enabled": False, "profile_step": 0})
    train(2, hook, model)
    assert hook.last_profile is None and capsys.readouterr().out == ""


def test_prints_to_stdout_on_rank_zero_only(capsys):
    model = nn.Linear(8, 2)
    StepProfiler_ = StepProfiler(model, {"enabled": True, "profile_step": 1}, rank=1)
    train(2, StepProfiler_, model)
    assert capsys.readouterr().out == "" and StepProfiler_.last_profile is not None
    hook = StepProfiler(model, FlopsProfilerConfig(enabled=True, profile_step=1))
    train(2, hook, model)
    assert "Profile Summary at step 1:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "section, error",
    [
        ({"enabled": "yes"}, "enabled"),
        ({"profile_step": -1}, "profile_step"),
        ({"top_modules": 0}, "top_modules"),
        ({"module_depth": -5}, "module_depth"),
        ({"profile_stepp": 1}, "unknown keys"),
    ],
)
def test_config_validation(section, error):
    with pytest.raises(ValueError, match=error):
        FlopsProfilerConfig.from_section(section)
