"""bf16 through the engine: bf16 module, fp32 master weights and optimizer states, and a trajectory
that matches the same scheme written by hand in one process."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from zero_core.testing import run_multirank
from zero_core.testing.models import TinyLM, token_batch

VOCAB, MICRO, WORLD, STEPS, LR = 16, 4, 2, 10, 1e-2
# bf16 keeps 8 significant bits: the engine sums the two ranks' bf16 gradients in bf16 while the
# reference sums them in fp32, so the trajectories differ by bf16 rounding of the gradients only.
# Stated tolerance on the fp32 master weights and the losses after 10 AdamW steps:
RTOL, ATOL = 2e-2, 2e-3


# emb -> l1 -> tanh -> head
_model = functools.partial(TinyLM, VOCAB, 16, 32, mlp="one_layer", norm=False)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    # two fixed batches alternate, so the loss falls clearly within 10 steps
    return token_batch(1000 * (step % 2) + rank, MICRO, 6, VOCAB)


def _reference() -> tuple[list[float], list[torch.Tensor]]:
    """The mixed-precision scheme by hand: bf16 model, fp32 masters, AdamW over the masters."""
    torch.manual_seed(0)
    model = _model()
    masters = [nn.Parameter(p.detach().clone().float()) for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=0.01)
    model.to(torch.bfloat16)
    losses = []
    for it in range(STEPS):
        grads = [torch.zeros_like(m) for m in masters]
        step_loss = 0.0
        for rank in range(WORLD):
            model.zero_grad(set_to_none=True)
            loss = model(*_batch(it, rank))
            loss.backward()
            step_loss += loss.item() / WORLD
            for g, p in zip(grads, model.parameters()):
                g += p.grad.float() / WORLD
        for m, g in zip(masters, grads):
            m.grad = g
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
        losses.append(step_loss)
    return losses, [m.detach().clone() for m in masters]


def _train() -> dict:
    import zero_core
    from zero_core import comm

    rank = comm.get_rank()
    torch.manual_seed(0)
    model = _model()
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
    }
    engine, opt, _, _ = zero_core.initialize(model=model, config=cfg)
    losses = []
    for it in range(STEPS):
        loss = engine(*_batch(it, rank))
        engine.backward(loss)
        engine.step()
        t = torch.tensor([loss.item()])
        comm.all_reduce(t)
        losses.append(t.item() / WORLD)
    masters = [p for g in opt.param_groups for p in g["params"]]
    states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    return {
        "losses": losses,
        "masters": [m.detach().clone() for m in masters],
        "module_dtypes": {p.dtype for p in model.parameters()},
        "master_dtypes": {m.dtype for m in masters},
        "state_dtypes": {t.dtype for t in states},
        # the bf16 module holds the masters rounded to bf16
        "module_is_rounded_master": all(
            torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(model.parameters(), masters)
        ),
    }


def test_bf16_matches_hand_written_mixed_precision():
    ref_losses, ref_masters = _reference()
    torch.manual_seed(0)
    init = [p.detach().clone() for p in _model().parameters()]
    for out in run_multirank(_train, WORLD):
        assert out["module_dtypes"] == {torch.bfloat16}
        assert out["master_dtypes"] == {torch.float32}
        assert out["state_dtypes"] == {torch.float32}
        assert out["module_is_rounded_master"]
        torch.testing.assert_close(
            torch.tensor(out["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL
        )
        assert out["losses"][-1] < out["losses"][0]
        for m, r, w0 in zip(out["masters"], ref_masters, init):
            torch.testing.assert_close(m, r, rtol=RTOL, atol=ATOL)
            # the tolerance is far below how far training moved the weights
            assert (r - w0).abs().max() > 10 * ATOL


def _train_with_bad_step(stage: int, check: bool | None) -> dict:
    """Three steps; on the second, only rank 1's loss is inf, so only its gradients are non-finite."""
    import zero_core
    from zero_core import comm

    rank = comm.get_rank()
    torch.manual_seed(0)
    model = _model()
    bf16 = {"enabled": True} if check is None else {"enabled": True, "check_grad_overflow": check}
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10**6,
        "bf16": bf16,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
    }
    engine, opt, _, _ = zero_core.initialize(model=model, config=cfg)
    snapshots = []
    for it in range(3):
        loss = engine(*_batch(it, rank))
        if it == 1 and rank == 1:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        snapshots.append([p.detach().float().clone() for g in opt.param_groups for p in g["params"]])
    return {"skipped": engine.skipped_steps, "steps": engine.global_steps, "masters": snapshots}


def test_bf16_skips_a_step_with_non_finite_gradients():
    # DeepSpeed's bf16.check_grad_overflow (default true): the step is dropped on every rank.
    for stage in (0, 1, 2, 3):
        for out in run_multirank(_train_with_bad_step, WORLD, args=(stage, None)):
            assert out["skipped"] == 1 and out["steps"] == 3, stage
            before, after_bad, after_next = out["masters"]
            for a, b in zip(before, after_bad):
                assert torch.equal(a, b), stage
            assert all(torch.isfinite(t).all() for t in after_next)
            assert any(not torch.equal(a, b) for a, b in zip(after_bad, after_next))
    # check_grad_overflow: false applies the update as torch would, poisoning the weights.
    for out in run_multirank(_train_with_bad_step, WORLD, args=(2, False)):
        assert out["skipped"] == 0
        assert any(not torch.isfinite(t).all() for t in out["masters"][1])
