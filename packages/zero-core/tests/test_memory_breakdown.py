"""``engine.memory_breakdown()`` equals the storages really alive, each counted once.

Measured after forward, backward and step, at stages 0-3 in fp32, bf16 and fp16 on 2 ranks,
against the distinct storages of every live tensor found by the garbage collector (storages
that existed before the engine and the test's own input and loss left out). After forward the
activations autograd saved for backward are alive too and are set apart. See [Note: memory
breakdown counts storages] in zero_core/utils/storage_bytes.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank
from zero_core.testing.memory import (
    SavedForBackward,
    StorageBaseline,
    live_storages,
    measure_until_equal,
)

DIM = 64
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _engine(stage: int, precision: str):
    import zero_core

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 5))
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        # small buckets and no persistence threshold: several buckets, partitioned stage-3 params
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 3000,
            "stage3_param_persistence_threshold": 0,
        },
    }
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 4}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    return model, engine


def _phases_rank(stage: int, precision: str) -> list[tuple[str, int, int, dict[str, int]]]:
    before = StorageBaseline()
    model, engine = _engine(stage, precision)
    out = []

    def once(held: list[torch.Tensor], activations: set) -> tuple[int, int, dict[str, int]]:
        live = live_storages([*held, *engine.held_step_scalars()], before)
        params = {(str(p.device), p.untyped_storage().data_ptr()) for p in model.parameters()}
        saved = sum(live[k] for k in activations if k in live and k not in params)
        breakdown = engine.memory_breakdown()
        return sum(live.values()) - saved, sum(breakdown.values()), breakdown

    def measure(phase: str, held: list[torch.Tensor], activations: set = frozenset()) -> None:
        # a finished collective's buffers may still be alive for a moment: See [Note: collective
        # buffers outlive wait()] in zero_core/testing/memory.py
        out.append((phase, *measure_until_equal(lambda: once(held, activations))))

    for i in range(2):  # the second round has Adam's states and reused buffers
        x = torch.randn(4, DIM, dtype=PRECISIONS[precision])
        saved = SavedForBackward()
        with saved.recording():
            loss = engine(x).float().pow(2).mean()
        measure(f"forward {i}", [x, loss], saved.keys)
        engine.backward(loss)
        measure(f"backward {i}", [x, loss])
        engine.step()
        measure(f"step {i}", [x, loss])
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_breakdown_counts_live_storages_once(precision: str) -> None:
    def body():
        return {stage: _phases_rank(stage, precision) for stage in (0, 1, 2, 3)}

    for rank, per_stage in enumerate(run_multirank(body, 2, timeout=240)):
        for stage, phases in per_stage.items():
            for phase, live, reported, breakdown in phases:
                assert reported == live, (rank, stage, precision, phase, live, breakdown)


def _stage0_vs_ddp_rank() -> tuple[int, int]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def ddp_states() -> int:
        before = StorageBaseline()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 5))
        ddp = DDP(model, gradient_as_bucket_view=True)  # DDP's leanest setting: grads live in buckets
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for _ in range(2):
            ddp(torch.randn(4, DIM)).pow(2).mean().backward()
            opt.step()
        x = torch.randn(4, DIM)
        ddp(x).pow(2).mean().backward()
        live = live_storages([x], before)
        del ddp, opt, model
        return sum(live.values())

    def zero_states() -> int:
        import zero_core

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 5))
        cfg = {
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": 10**6,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        }
        engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
        for _ in range(2):
            engine.backward(engine(torch.randn(4, DIM)).pow(2).mean())
            engine.step()
        engine.backward(engine(torch.randn(4, DIM)).pow(2).mean())
        return sum(engine.memory_breakdown().values())

    assert dist.is_initialized()
    return ddp_states(), zero_states()


def test_stage0_model_states_equal_ddp() -> None:
    """fp32 stage 0 holds parameters, gradients (in its buckets) and Adam's states: 16 bytes per
    parameter, as DDP with gradient_as_bucket_view does; the gradients are not counted twice."""
    psi = DIM * DIM + DIM + DIM * 5 + 5
    for ddp, ours in run_multirank(_stage0_vs_ddp_rank, 2, timeout=240):
        assert ddp == pytest.approx(16 * psi, rel=0.01)
        assert ours == pytest.approx(16 * psi, rel=0.01)
