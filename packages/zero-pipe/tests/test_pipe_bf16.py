"""bf16 through the pipeline engine (2 stages, and 2 stages x 2 replicas with ZeRO-1): bf16
layers, fp32 masters, training that lowers the loss, and bf16.check_grad_overflow: a batch whose
gradients are not finite is skipped on every rank instead of poisoning the weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zero_core.testing import run_multirank
from zero_pipe import LayerSpec, PipelineEngine, PipelineModule

DIM, CLASSES, MB, MICRO_BATCHES, BATCHES, BAD_BATCH = 8, 5, 4, 2, 6, 2


def specs():
    return [LayerSpec(nn.Linear, DIM, DIM), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, DIM, CLASSES)]


def data(n):
    g = torch.Generator().manual_seed(11)
    return [
        (torch.randn(MB, DIM, generator=g), torch.randint(0, CLASSES, (MB,), generator=g)) for _ in range(n)
    ]


class PoisonedLoss:
    """Cross entropy, times inf on the micro-batches of one batch (on the last stage only)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, logits, labels):
        loss = nn.functional.cross_entropy(logits.float(), labels)
        batch = self.calls // MICRO_BATCHES
        self.calls += 1
        return loss * float("inf") if batch == BAD_BATCH else loss


def _rank(zero_stage: int, check: bool) -> dict:
    loss_fn = PoisonedLoss()
    model = PipelineModule(
        specs(), num_stages=2, loss_fn=loss_fn, seed_layers=True, partition_method="uniform"
    )
    dp = torch.distributed.get_world_size() // 2
    cfg = {
        "train_batch_size": MB * MICRO_BATCHES * dp,
        "train_micro_batch_size_per_gpu": MB,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True, "check_grad_overflow": check},
        "zero_optimization": {"stage": zero_stage},
    }
    engine = PipelineEngine(model, torch.optim.AdamW(model.parameters(), lr=0.02), cfg)
    # the same batch every time, so that the loss falls clearly
    mine = data(MICRO_BATCHES * dp)[engine.grid.data_parallel_id :: dp]
    losses, weights = [], []
    for _ in range(BATCHES):
        losses.append(float(engine.train_batch(iter(mine))))
        weights.append([p.detach().float().clone() for p in model.parameters()])
    return {
        "losses": losses,
        "weights": weights,
        "module_dtypes": {p.dtype for p in model.parameters()},
        "skipped": engine.stage_optimizer.skipped_steps,
    }


@pytest.mark.parametrize("world,zero_stage", [(2, 0), (4, 1)], ids=["2-stages", "2x2-zero1"])
def test_bf16_pipeline_trains_and_skips_a_non_finite_batch(world, zero_stage):
    for out in run_multirank(_rank, world, args=(zero_stage, True), timeout=180):
        assert out["module_dtypes"] == {torch.bfloat16}
        assert out["skipped"] == 1
        before, after_bad = out["weights"][BAD_BATCH - 1], out["weights"][BAD_BATCH]
        assert all(torch.equal(a, b) for a, b in zip(before, after_bad))
        last = out["weights"][-1]
        assert all(torch.isfinite(t).all() for t in last)
        assert any(not torch.equal(a, b) for a, b in zip(after_bad, last))
        good = [x for i, x in enumerate(out["losses"]) if i != BAD_BATCH]
        assert good[-1] < good[0]
    # Without the check the update is applied, as torch would: the weights become non-finite.
    for out in run_multirank(_rank, 2, args=(0, False), timeout=180):
        assert out["skipped"] == 0
        assert any(not torch.isfinite(t).all() for t in out["weights"][BAD_BATCH])
