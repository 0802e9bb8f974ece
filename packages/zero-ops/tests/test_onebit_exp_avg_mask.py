"""``exp_avg_mask`` in a parameter group of 1-bit Adam, 0/1 Adam and 1-bit LAMB.

An embedding whose odd rows no batch looks up has an exactly-zero gradient there. Once the
1-bit exchange starts, those entries come back non-zero (1-bit compression sends every element
as +-scale) unless the group's ``exp_avg_mask`` zeroes them: with the mask, their momentum and
weights stay exactly what they were; without it they drift. The mask is the training script's:
``load_state_dict`` keeps the live one. See [Note: momentum mask] in zero_ops/onebit/base.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from zero_core.testing import run_multirank

ROWS, DIM = 20, 4
UNUSED = slice(1, ROWS, 2)  # odd rows: each exchanged chunk mixes used and unused entries
CASES = {
    "OneBitAdam": {"freeze_step": 2},
    "ZeroOneAdam": {
        "var_freeze_step": 4,
        "var_update_scaler": 1,
        "local_step_scaler": 2,
        "local_step_clipper": 4,
    },
    "OneBitLamb": {"freeze_step": 2},
}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(ROWS, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx)).squeeze(-1)


def _train(name: str, masked: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unused rows' drift (weights, momentum) after 10 steps, and the initial unused rows."""
    import zero_core
    from zero_core import comm

    model = _Net()
    before = model.emb.weight.detach()[UNUSED].clone()
    emb_group = {"params": [model.emb.weight], "weight_decay": 0.0}
    if masked:
        mask = torch.ones(ROWS, DIM)
        mask[UNUSED] = 0.0
        emb_group["exp_avg_mask"] = mask
    groups = [emb_group, {"params": list(model.head.parameters())}]
    cfg = {
        "train_micro_batch_size_per_gpu": ROWS // 2,
        "steps_per_print": 10**6,
        "gradient_clipping": 0.0,
        "optimizer": {"type": name, "params": {"lr": 1e-2, **CASES[name]}},
    }
    engine, opt, *_ = zero_core.initialize(model=model, model_parameters=groups, config=cfg)
    for step in range(10):
        g = torch.Generator().manual_seed(10 * step + comm.get_rank())
        # every even row in every batch (so the frozen variance covers them), random targets
        target = torch.randn(ROWS // 2, generator=g)
        engine.backward((engine(torch.arange(0, ROWS, 2)) - target).pow(2).mean())
        engine.step()
    drift = model.emb.weight.detach()[UNUSED] - before
    momentum = opt.state[model.emb.weight]["exp_avg"][UNUSED].clone()
    engine.destroy()
    return drift, momentum


def _cases() -> dict:
    return {(name, masked): _train(name, masked) for name in CASES for masked in (True, False)}


def test_the_mask_keeps_unused_rows_at_zero_momentum_once_compression_starts() -> None:
    for per_rank in run_multirank(_cases, 2, timeout=240):
        for name in CASES:
            drift, momentum = per_rank[(name, True)]
            assert torch.count_nonzero(drift) == 0 and torch.count_nonzero(momentum) == 0, name
            drift, momentum = per_rank[(name, False)]
            assert torch.count_nonzero(momentum) > 0 and torch.count_nonzero(drift) > 0, name


def test_load_state_dict_keeps_the_live_mask_and_bad_masks_are_clear_errors() -> None:
    import pytest
    from zero_ops.onebit import OnebitAdam

    p = nn.Parameter(torch.ones(3, 2))
    live = torch.tensor([[1.0], [0.0], [1.0]])
    opt = OnebitAdam([{"params": [p], "exp_avg_mask": live}], freeze_step=1)
    saved = opt.state_dict()
    saved["param_groups"][0]["exp_avg_mask"] = torch.zeros(3, 1)
    opt.load_state_dict(saved)
    assert torch.equal(opt.param_groups[0]["exp_avg_mask"], live)  # not the saved zeros
    bare = OnebitAdam([p], freeze_step=1)
    bare.load_state_dict(saved)  # a mask saved with the state is not taken over
    assert "exp_avg_mask" not in bare.param_groups[0]
    wrong = OnebitAdam([{"params": [p], "exp_avg_mask": torch.ones(4)}], freeze_step=1)
    with pytest.raises(ValueError, match=r"exp_avg_mask'\] has shape \(4,\), which does not broadcast"):
        wrong._apply_mask(0, [torch.zeros(3, 2)])
