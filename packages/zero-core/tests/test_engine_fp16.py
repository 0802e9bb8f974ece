"""fp16 through the engine: an overflow on one rank skips the step on every rank, the dynamic loss
scale follows the hysteresis rules of [Note: loss scaling], and a static scale unscales exactly."""

from __future__ import annotations

import functools

import pytest
import torch
from zero_core.testing import run_multirank
from zero_core.testing.models import TinyLM, token_batch

VOCAB, MICRO, WORLD = 16, 2, 2


# emb -> l1 -> tanh -> head; forward(x, y, poison=True) returns an infinite loss
_model = functools.partial(TinyLM, VOCAB, 8, 12, mlp="one_layer", norm=False)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(1000 * step + rank, MICRO, 5, VOCAB)


# step -> how the overflow is produced: "grad" = inf gradients on rank 1 only (the all-reduce
# carries them to rank 0); "flag" = only rank 0's local_overflow() reports one (its gradients are
# finite): the decision must still be global.
OVERFLOWS = {1: "grad", 2: "flag", 6: "grad", 8: "flag", 9: "grad", 10: "flag"}
STEPS = 12


def _expected_scales(consecutive: bool) -> list[float]:
    """The scale after each step by the documented rules: init 2**8, window 3, hysteresis 2, floor 64."""
    scale, hyst, last_overflow, out = 256.0, 2, -1, []
    for it in range(STEPS):
        if it in OVERFLOWS:
            if hyst == 1:
                scale = max(scale / 2, 64.0)
            else:
                hyst -= 1
            last_overflow = it
        else:
            if consecutive:
                hyst = 2
            if (it - last_overflow) % 3 == 0:
                if not consecutive:
                    hyst = 2
                scale *= 2
        out.append(scale)
    return out


def _engine(fp16: dict, lr: float):
    """An fp16 engine (SGD with ``lr``) over a freshly seeded model; returns (engine, optimizer, model)."""
    import zero_core

    torch.manual_seed(0)
    model = _model()
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10**6,
        "fp16": {"enabled": True, **fp16},
        "optimizer": {"type": "SGD", "params": {"lr": lr}},
    }
    engine, opt, _, _ = zero_core.initialize(model=model, config=cfg)
    return engine, opt, model


def _dynamic(consecutive: bool) -> dict:
    from zero_core import comm

    rank = comm.get_rank()
    scaling = {
        "loss_scale": 0,
        "initial_scale_power": 8,
        "loss_scale_window": 3,
        "hysteresis": 2,
        "consecutive_hysteresis": consecutive,
        "min_loss_scale": 64,
    }
    engine, opt, model = _engine(scaling, lr=0.1)
    out: dict = {"scales": [], "changed": [], "skipped": [], "steps": [], "lr": []}
    out["dtypes"] = (
        {p.dtype for p in model.parameters()},
        {p.dtype for g in opt.param_groups for p in g["params"]},
    )
    real_flag = engine.strategy.local_overflow
    for it in range(STEPS):
        kind = OVERFLOWS.get(it)
        before = [p.detach().clone() for p in model.parameters()]
        masters = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
        engine.strategy.local_overflow = (lambda: True) if kind == "flag" and rank == 0 else real_flag
        x, y = _batch(it, rank)
        loss = engine(x, y, poison=kind == "grad" and rank == 1)
        engine.backward(loss)
        engine.step()
        out["scales"].append(engine.loss_scaler.loss_scale)
        changed_model = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        changed_master = any(
            not torch.equal(b, p) for b, p in zip(masters, [p for g in opt.param_groups for p in g["params"]])
        )
        out["changed"].append((changed_model, changed_master))
        out["skipped"].append(engine.skipped_steps)
        out["steps"].append(engine.global_steps)
    out["norm_after_overflow"] = engine.get_global_grad_norm()
    return out


@pytest.mark.parametrize("consecutive", [False, True])
def test_overflow_on_one_rank_skips_everywhere_and_follows_hysteresis(consecutive):
    expected = _expected_scales(consecutive)
    # the rules distinguish the two modes on this schedule (step 9 vs 10)
    assert expected != _expected_scales(not consecutive)
    for out in run_multirank(_dynamic, WORLD, args=(consecutive,)):
        assert out["dtypes"] == ({torch.float16}, {torch.float32})
        assert out["scales"] == expected
        for it, changed in enumerate(out["changed"]):
            want = it not in OVERFLOWS
            assert changed == (want, want), f"step {it}: params changed {changed}, expected {want}"
        n_skipped = [sum(1 for s in OVERFLOWS if s <= it) for it in range(STEPS)]
        assert out["skipped"] == n_skipped
        assert out["steps"] == list(range(1, STEPS + 1))  # a skipped step still counts as a step
        assert min(out["scales"]) == 64.0  # min_loss_scale is a floor


def _static(scale: float) -> dict:
    from zero_core import comm

    rank = comm.get_rank()
    engine, opt, _ = _engine({"loss_scale": scale}, lr=0.5)
    for it in range(3):
        x, y = _batch(it, rank)
        engine.backward(engine(x, y))
        engine.step()
    return {
        "dynamic": engine.loss_scaler.dynamic,
        "scale": engine.loss_scaler.loss_scale,
        "masters": [p.detach().clone() for g in opt.param_groups for p in g["params"]],
    }


def _static_reference(scale: float) -> list[torch.Tensor]:
    """fp16 model, fp32 masters, by hand: grads of (loss * scale) per rank, averaged, unscaled, SGD."""
    torch.manual_seed(0)
    model = _model()
    masters = [p.detach().clone().float() for p in model.parameters()]
    model.half()
    for it in range(3):
        grads = [torch.zeros_like(m) for m in masters]
        for rank in range(WORLD):
            model.zero_grad(set_to_none=True)
            x, y = _batch(it, rank)
            (model(x, y) * scale).backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad.float()
        with torch.no_grad():
            for m, g, p in zip(masters, grads, model.parameters()):
                m -= 0.5 * g / WORLD / scale
                p.copy_(m)
    return masters


def test_static_loss_scale():
    ref = _static_reference(1024.0)
    for out in run_multirank(_static, WORLD, args=(1024.0,)):
        assert out["dynamic"] is False and out["scale"] == 1024.0
        for m, r in zip(out["masters"], ref):
            # the engine sums the two ranks' fp16 gradients in fp16; the reference in fp32
            torch.testing.assert_close(m, r, rtol=2e-3, atol=2e-4)
