"""Stage 0 (data parallel) trains exactly like single-process PyTorch on the global batch."""

from __future__ import annotations

import functools

import pytest
import torch
from zero_core.testing import run_multirank
from zero_core.testing.models import TinyLM, token_batch
from zero_core.testing.parity import assert_trajectory_close, state_snapshot, train_engine, train_reference

STEPS, MICRO, SEQ, VOCAB = 20, 2, 8, 32

# emb -> l1 -> tanh -> l2 -> head, plus a Linear(3, 3) forward never uses (its grad must stay None)
_model = functools.partial(TinyLM, VOCAB, 16, 24, mlp="two_layer", norm=False, unused=True)


def _data(step: int, world: int, gas: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(1000 + step, world * gas * MICRO, SEQ, VOCAB)


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


def _reference(
    world: int, gas: int, clip: float, opt_name: str
) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = _model()
    opt = _optimizer(opt_name, model.parameters())
    return train_reference(model, opt, lambda step: _data(step, world, gas), STEPS, clip=clip)


def _train_stage0(gas: int, clip: float, opt_name: str, bucket: int, overlap: bool):
    import zero_core
    from zero_core import comm

    world = comm.get_world_size()
    torch.manual_seed(0)
    model = _model()
    opt = _optimizer(opt_name, model.parameters())
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": 0, "reduce_bucket_size": bucket, "overlap_comm": overlap},
    }
    engine, _, _, _ = zero_core.initialize(model=model, optimizer=opt, config=cfg)
    # the global-batch loss is the mean over ranks and micro-batches
    losses = train_engine(engine, lambda step: _data(step, world, gas), STEPS, micro=MICRO, gas=gas)
    assert model.unused.weight.grad is None
    return losses, state_snapshot(model)


@pytest.mark.parametrize(
    "world,gas,clip,opt_name,bucket,overlap",
    [
        (2, 1, 0.0, "adamw", 500, True),
        (2, 3, 0.5, "sgd", 10**9, True),
        (4, 1, 0.5, "adam", 37, False),
        (4, 2, 0.0, "adamw", 200, True),
    ],
)
def test_stage0_matches_single_process(world, gas, clip, opt_name, bucket, overlap):
    ref_losses, ref_state = _reference(world, gas, clip, opt_name)
    results = run_multirank(_train_stage0, world, args=(gas, clip, opt_name, bucket, overlap), timeout=180)
    for losses, state in results:
        assert_trajectory_close(losses, state, ref_losses, ref_state, rtol=1e-5, atol=1e-6)
