"""Progressive layer drop as DeepSpeed's engine drives it (See [Note: progressive layer drop]).

DeepSpeed's behaviour: with ``progressive_layer_drop.enabled`` every training forward gets
``progressive_layer_drop=True, pld_theta=theta`` with theta 1.0 before the first optimizer step
and ``(1 - theta) * exp(-gamma * t) + theta`` after step ``t`` (numpy's exp, compared bit for
bit); ``engine.get_pld_theta()`` reads it; a model whose forward takes no such arguments fails
with a TypeError. Training with a model that drops a layer by that probability matches a plain
PyTorch loop given the same thetas.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from zero_core.config.errors import ConfigError
from zero_core.engine.progressive_layer_drop import ProgressiveLayerDrop
from zero_core.testing import run_multirank

DIM, MICRO = 6, 2


def ds_theta(theta: float, gamma: float, step: int) -> float:
    return (1.0 - theta) * np.exp(-gamma * step) + theta


@pytest.mark.parametrize("theta", [0, 0.1, 0.9, 1.0])
def test_schedule_is_deepspeeds_to_the_bit(theta):
    pld = ProgressiveLayerDrop(theta, 0.001)
    assert pld.get_theta() == 1.0
    for step in range(20):
        pld.update_state(step)
        assert pld.get_theta() == ds_theta(theta, 0.001, step)
        assert pld.get_state() == {"progressive_layer_drop": True, "pld_theta": pld.get_theta()}
    with pytest.raises(ValueError, match=r"keep probability in \[0, 1\]"):
        ProgressiveLayerDrop(1.5, 0.001)
    with pytest.raises(ValueError, match="gamma must be >= 0"):
        ProgressiveLayerDrop(0.5, -1.0)


class PLDNet(torch.nn.Module):
    """Skips its middle layer with probability 1 - pld_theta (a seeded coin per forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(DIM, DIM)
        self.mid = torch.nn.Linear(DIM, DIM)
        self.out = torch.nn.Linear(DIM, 3)
        self.coins = torch.Generator().manual_seed(7)
        self.seen: list = []

    def forward(self, x, y, progressive_layer_drop=False, pld_theta=1.0):
        self.seen.append(pld_theta if progressive_layer_drop else None)
        h = torch.tanh(self.l1(x))
        if not progressive_layer_drop or torch.rand((), generator=self.coins).item() < pld_theta:
            h = h + torch.tanh(self.mid(h))
        return torch.nn.functional.cross_entropy(self.out(h), y)


def _batch(i: int):
    g = torch.Generator().manual_seed(i)
    return torch.randn(MICRO, DIM, generator=g), torch.randint(0, 3, (MICRO,), generator=g)


THETA, GAMMA, STEPS, GAS = 0.3, 0.2, 6, 2


def _cfg(stage: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "progressive_layer_drop": {"enabled": True, "theta": THETA, "gamma": GAMMA},
        **extra,
    }


def _reference(model: PLDNet) -> dict:
    """Plain PyTorch: the thetas DeepSpeed's engine would pass, computed by hand."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    theta = 1.0
    for step in range(STEPS):
        for k in range(GAS):
            (model(*_batch(step * GAS + k), progressive_layer_drop=True, pld_theta=theta) / GAS).backward()
        theta = ds_theta(THETA, GAMMA, step)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank(stage: int, save_dir: str) -> dict:
    import zero_core

    torch.manual_seed(0)
    model = PLDNet()
    engine, *_ = zero_core.initialize(model=model, config=_cfg(stage))
    assert engine.pld_enabled() and engine.pld_params() == {"theta": THETA, "gamma": GAMMA}
    assert engine.get_pld_theta() == 1.0
    for step in range(STEPS):
        for k in range(GAS):
            engine.backward(engine(*_batch(step * GAS + k)))
            engine.step()
        assert engine.get_pld_theta() == ds_theta(THETA, GAMMA, step)  # after the boundary of step
        if step == 2:
            engine.save_checkpoint(save_dir, tag="s3")
    seen = [t for t in model.seen]
    engine.eval()
    with torch.no_grad():
        engine(*_batch(99))
    assert model.seen[-1] is None  # evaluation forwards get no PLD arguments
    engine.train()
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items() if "coins" not in k}
    # resuming: the schedule follows the restored step counter (theta of step 2 for step 3's forwards)
    resumed, *_ = zero_core.initialize(model=PLDNet(), config=_cfg(stage))
    resumed.load_checkpoint(save_dir, tag="s3")
    return {"seen": seen, "state": state, "resumed": resumed.get_pld_theta()}


@pytest.mark.parametrize("stage", [0, 3])
def test_engine_passes_the_schedule_and_trains_as_plain_pytorch(stage, tmp_path):
    torch.manual_seed(0)
    want = _reference(copy.deepcopy(PLDNet()))
    r = run_multirank(_rank, 1, args=(stage, str(tmp_path)), timeout=180)[0]
    thetas = [1.0] * GAS + [ds_theta(THETA, GAMMA, s) for s in range(STEPS - 1) for _ in range(GAS)]
    assert r["seen"] == thetas
    for k, v in want.items():
        torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert r["resumed"] == ds_theta(THETA, GAMMA, 2)


def _plain_rank() -> bool:
    import zero_core

    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = torch.nn.Linear(DIM, 3)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.l(x), y)

    engine, *_ = zero_core.initialize(model=Plain(), config=_cfg(0))
    with pytest.raises(TypeError, match="progressive_layer_drop"):
        engine(*_batch(0))  # DeepSpeed: the forward's own TypeError
    cfg = _cfg(0)
    cfg["progressive_layer_drop"] = {"enabled": False, "theta": THETA}
    engine, *_ = zero_core.initialize(model=Plain(), config=cfg)
    assert engine.get_pld_theta() is None and engine.progressive_layer_drop is None
    engine.backward(engine(*_batch(0)))
    with pytest.raises(ConfigError, match=r"progressive_layer_drop.theta: 2 is out of range"):
        zero_core.initialize(
            model=Plain(), config={**cfg, "progressive_layer_drop": {"enabled": True, "theta": 2}}
        )
    return True


def test_a_model_without_the_arguments_fails_and_off_means_nothing_passed():
    # initialize sets up a process group: in a forked rank, never in the test process
    assert run_multirank(_plain_rank, 1, timeout=120) == [True]
