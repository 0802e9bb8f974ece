"""fp16 with a static loss scale (``"loss_scale": N``) skips an overflowing step at every ZeRO stage.

Fault injected: an infinite loss on rank 0, then NaN gradients on rank 1 only (a backward hook).
Before the fix only a dynamic scaler checked for overflow, so these steps wrote NaN into the
fp32 masters for good with ``skipped_steps`` left at 0 and no warning.
"""

from __future__ import annotations

import functools
import warnings

import torch
from zero_core.testing import run_multirank
from zero_core.testing.models import TinyLM, token_batch

VOCAB, MICRO, WORLD = 16, 2, 2
_model = functools.partial(TinyLM, VOCAB, 8, 12, mlp="one_layer", norm=False)
# step -> fault: "inf_loss" on rank 0, "nan_grad" on rank 1; other steps are clean
FAULTS = {1: "inf_loss", 2: "nan_grad"}


def _nan_grads(module, inputs, output):  # noqa: ANN001 (a forward hook)
    output.register_hook(lambda g: torch.full_like(g, float("nan")))


def _run_stage(stage: int) -> dict:
    import zero_core
    from zero_core import comm

    rank = comm.get_rank()
    torch.manual_seed(0)
    model = _model()
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10**6,
        "fp16": {"enabled": True, "loss_scale": 128},
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, opt, _, _ = zero_core.initialize(model=model, config=cfg)
    masters = lambda: [p.detach().clone() for g in opt.param_groups for p in g["params"]]  # noqa: E731
    out: dict = {"changed": [], "skipped": [], "finite": [], "warnings": 0}
    for it in range(4):
        fault = FAULTS.get(it)
        before = masters()
        hook = model.l1.register_forward_hook(_nan_grads) if fault == "nan_grad" and rank == 1 else None
        x, y = token_batch(100 * it + rank, MICRO, 5, VOCAB)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = engine(x, y, poison=fault == "inf_loss" and rank == 0)
            engine.backward(loss)
            engine.step()
        if hook is not None:
            hook.remove()
        out["warnings"] += sum("static loss scale 128" in str(w.message) for w in caught)
        after = masters()
        out["changed"].append(any(not torch.equal(a, b) for a, b in zip(before, after)))
        out["finite"].append(all(bool(torch.isfinite(m).all()) for m in after))
        out["skipped"].append(engine.skipped_steps)
    out["scale"] = engine.loss_scaler.loss_scale
    engine.destroy()
    return out


def _all_stages() -> dict:
    return {stage: _run_stage(stage) for stage in (0, 1, 2, 3)}


def test_static_fp16_scale_skips_overflowing_steps_at_every_stage():
    for rank, per_stage in enumerate(run_multirank(_all_stages, WORLD, timeout=300)):
        for stage, out in per_stage.items():
            where = f"rank {rank} stage {stage}"
            assert out["changed"] == [True, False, False, True], where  # faulty steps not applied
            assert out["finite"] == [True] * 4, where  # no NaN/inf ever reaches the masters
            assert out["skipped"] == [0, 1, 2, 2], where
            assert out["scale"] == 128.0, where  # a static scale stays put
            assert out["warnings"] == (2 if rank == 0 else 0), where  # rank 0 warns once per skip
