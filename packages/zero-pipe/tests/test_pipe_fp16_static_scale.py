"""fp16 with a static loss scale through the pipeline engine: an overflowing batch (an infinite
loss on the last stage) is skipped on every rank instead of writing NaN into the masters, and
counted in ``skipped_steps``. Before the fix only a dynamic scaler checked for overflow."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from zero_core.testing import run_multirank
from zero_pipe import LayerSpec, PipelineEngine, PipelineModule

DIM, CLASSES, MB, MICRO_BATCHES, BATCHES, BAD_BATCH = 8, 5, 4, 2, 4, 1


class PoisonedLoss:
    """Cross entropy, times inf on the micro-batches of batch ``BAD_BATCH`` (last stage only)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, logits, labels):
        loss = nn.functional.cross_entropy(logits.float(), labels)
        batch = self.calls // MICRO_BATCHES
        self.calls += 1
        return loss * float("inf") if batch == BAD_BATCH else loss


def _rank() -> dict:
    specs = [LayerSpec(nn.Linear, DIM, DIM), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, DIM, CLASSES)]
    model = PipelineModule(
        specs, num_stages=2, loss_fn=PoisonedLoss(), seed_layers=True, partition_method="uniform"
    )
    cfg = {
        "train_batch_size": MB * MICRO_BATCHES,
        "train_micro_batch_size_per_gpu": MB,
        "fp16": {"enabled": True, "loss_scale": 64},
    }
    engine = PipelineEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    g = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(MB, DIM, generator=g), torch.randint(0, CLASSES, (MB,), generator=g)) for _ in range(2)
    ]
    weights, warned = [], 0
    for _ in range(BATCHES):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.train_batch(iter(batches))
        warned += sum("static loss scale 64" in str(w.message) for w in caught)
        weights.append([p.detach().float().clone() for p in model.parameters()])
    return {"weights": weights, "skipped": engine.stage_optimizer.skipped_steps, "warned": warned}


def test_static_fp16_pipeline_skips_an_overflowing_batch():
    for rank, out in enumerate(run_multirank(_rank, 2, timeout=180)):
        assert out["skipped"] == 1
        before, after_bad = out["weights"][BAD_BATCH - 1], out["weights"][BAD_BATCH]
        assert all(torch.equal(a, b) for a, b in zip(before, after_bad))  # the bad batch is not applied
        assert all(torch.isfinite(t).all() for w in out["weights"] for t in w)
        assert any(not torch.equal(a, b) for a, b in zip(after_bad, out["weights"][-1]))  # later ones are
        assert out["warned"] == (1 if rank == 0 else 0)
