"""Activation checkpointing inside a model trained by the engine (2 ranks, dropout): the same
gradients and trajectory as the same model without checkpointing."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from zero_core.testing import run_multirank

WIDTH, MICRO, WORLD, STEPS = 16, 4, 2, 5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(F.gelu(self.fc1(x))))


class Net(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from zero_core import activation_checkpointing as ac

        for blk in self.blocks:
            x = ac.checkpoint(blk, x) if self.checkpointed else blk(x)
        return F.mse_loss(self.head(x).squeeze(-1), y)


def _run(checkpointed: bool) -> dict:
    import zero_core
    from zero_core import activation_checkpointing as ac
    from zero_core import comm

    rank = comm.get_rank()
    torch.manual_seed(0)
    model = Net(checkpointed)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10**6,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
    }
    if checkpointed:
        cfg["activation_checkpointing"] = {"cpu_checkpointing": True}
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    if checkpointed:
        assert ac.is_configured() and ac.get_config().cpu_checkpointing
    torch.manual_seed(100 + rank)  # dropout masks differ per rank, identical between the two runs
    g = torch.Generator().manual_seed(rank)
    losses, norms, grads = [], [], []
    for _ in range(STEPS):
        x, y = torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        grads.append([p.grad.clone() for p in model.parameters()])  # averaged over both ranks
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    with torch.no_grad():  # dropout is active: two forwards of the same batch differ
        dropout_active = engine(x, y).item() != engine(x, y).item()
    return {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "dropout_active": dropout_active,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def _both() -> tuple[dict, dict]:
    return _run(True), _run(False)


def test_checkpointed_engine_run_equals_plain_run():
    for ckpt, plain in run_multirank(_both, WORLD):
        assert ckpt["losses"] == pytest.approx(plain["losses"], rel=1e-6)
        assert ckpt["norms"] == pytest.approx(plain["norms"], rel=1e-6)
        for gc, gp in zip(ckpt["grads"], plain["grads"]):
            for a, b in zip(gc, gp):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for k, v in plain["state"].items():
            torch.testing.assert_close(ckpt["state"][k], v, rtol=1e-6, atol=1e-7)
        assert ckpt["dropout_active"] and plain["dropout_active"]


class _Mpu:
    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self):
        return None


def _configure_then_initialize() -> dict:
    import zero_core
    from zero_core import activation_checkpointing as ac

    section = {"partition_activations": True, "contiguous_memory_optimization": True}
    base = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    out = {}
    # Megatron's order: its own configure (mpu, layer count) first, then initialize.
    mpu = _Mpu()
    ac.configure(mpu, deepspeed_config={"activation_checkpointing": section}, num_checkpoints=3)
    engine_section = {**section, "number_checkpoints": 2}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zero_core.initialize(model=Net(True), config={**base, "activation_checkpointing": engine_section})
    out["user_kept"] = ac.get_mpu() is mpu and ac.get_config().number_checkpoints == 3
    out["warned"] = any(
        "is not applied: checkpointing was configured by the caller" in str(w.message) for w in caught
    )
    # Without a user call, each initialize applies its own engine's section.
    ac.checkpointing._STATE.configured = False
    zero_core.initialize(
        model=Net(True), config={**base, "activation_checkpointing": {"cpu_checkpointing": True}}
    )
    first = ac.get_config().cpu_checkpointing
    zero_core.initialize(model=Net(True), config={**base, "activation_checkpointing": {"profile": True}})
    out["each_engine"] = first and ac.get_config().profile and not ac.get_config().cpu_checkpointing
    return out


def test_initialize_keeps_a_users_own_configure_call():
    (out,) = run_multirank(_configure_then_initialize, 1)
    assert out == {"user_kept": True, "warned": True, "each_engine": True}


def _contiguous_without_count() -> dict:
    import zero_core
    from zero_core import activation_checkpointing as ac

    section = {"partition_activations": True, "contiguous_memory_optimization": True}
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "activation_checkpointing": section,
    }
    ac.checkpointing._STATE.configured = False  # a fresh process, whatever the parent configured
    zero_core.initialize(model=Net(True), config=cfg)
    left_to_caller = not ac.is_configured()
    # Megatron's own call then sizes the buffer with its layer count
    ac.configure(deepspeed_config=cfg, num_checkpoints=3)
    return {"left_to_caller": left_to_caller, "count": ac.get_config().number_checkpoints}


def test_contiguous_section_without_a_count_is_left_to_the_callers_configure():
    (out,) = run_multirank(_contiguous_without_count, 1)
    assert out == {"left_to_caller": True, "count": 3}
