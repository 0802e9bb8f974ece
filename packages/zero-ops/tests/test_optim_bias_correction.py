"""``"optimizer": {"type": "Adam", "params": {"bias_correction": false}}`` (BERT pre-training
configs) trains at stages 0-3 exactly like single-process FusedAdam without bias correction."""

from __future__ import annotations

import pytest
import torch
from zero_core.testing import parity, run_multirank
from zero_core.testing.models import TinyLM, token_batch
from zero_ops.adam import FusedAdam

STEPS, MICRO, SEQ, VOCAB = 8, 2, 8, 32
ADAM = {"lr": 1e-2, "betas": [0.9, 0.99], "weight_decay": 0.1, "bias_correction": False}


def _data(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(500 + step, world * MICRO, SEQ, VOCAB)


def _train(stages: list[int]) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    import zero_core
    from zero_core import comm

    world, out = comm.get_world_size(), []
    for stage in stages:
        torch.manual_seed(0)
        model = TinyLM(VOCAB, 16, 23)
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 0.5,
            "optimizer": {"type": "Adam", "params": ADAM},
            "zero_optimization": {"stage": stage},
        }
        engine, optimizer, _, _ = zero_core.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )
        losses = parity.train_engine(engine, lambda step: _data(step, world), STEPS, micro=MICRO, gas=1)
        out.append((losses, parity.state_snapshot(model, gathered=stage == 3)))
        engine.destroy()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_adam_without_bias_correction_matches_single_process(world: int) -> None:
    stages = [0, 1, 2, 3]
    torch.manual_seed(0)
    model = TinyLM(VOCAB, 16, 23)
    opt = FusedAdam(model.parameters(), **{**ADAM, "betas": tuple(ADAM["betas"])})
    ref_losses, ref_state = parity.train_reference(
        model, opt, lambda step: _data(step, world), STEPS, clip=0.5
    )
    # The same run with bias correction moves differently: the comparison can tell them apart.
    torch.manual_seed(0)
    other = TinyLM(VOCAB, 16, 23)
    corrected, _ = parity.train_reference(
        other,
        torch.optim.AdamW(other.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1),
        lambda step: _data(step, world),
        STEPS,
        clip=0.5,
    )
    assert abs(corrected[-1] - ref_losses[-1]) > 1e-3
    results = run_multirank(_train, world, args=(stages,), timeout=240)
    for rank_results in results:
        for stage, (losses, state) in zip(stages, rank_results):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
            for name, value in ref_state.items():
                torch.testing.assert_close(
                    state[name], value, rtol=1e-5, atol=1e-6, msg=f"stage {stage} {name}"
                )
