"""Tensors taken from parameters inside ``GatheredParameters`` stay valid after it exits (issue 26).

Releasing a gathered parameter used to resize the gather buffer's storage to zero bytes, which
left a ``p.detach()`` / ``p.data`` / view taken inside the context pointing at freed memory:
reading it segfaulted. See [Note: tensors taken from a gathered parameter]. Ranks run forked
(``run_multirank``), so a crash fails the test ("died with signal 11") instead of killing pytest.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank
from zero_core.zero.stage3.param_records import partition_state

DIM = 5

PATTERNS = {
    "detach": lambda p: p.detach(),
    "data": lambda p: p.data,
    "view": lambda p: p.view(-1),
    "slice": lambda p: p.data[1:3],
    "transpose": lambda p: p.detach().t(),
    "clone": lambda p: p.clone(),
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 7), nn.Tanh(), nn.Linear(7, 3))


def _cfg() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }


def _read_every_way(t: torch.Tensor) -> list[torch.Tensor]:
    d = t.detach()
    return [
        d.sum().reshape(1),
        d.clone().reshape(-1),
        (d + 1).reshape(-1),
        torch.from_numpy(d.numpy().copy()).reshape(-1),
    ]


def _rank() -> dict:
    import zero_core
    from zero_core import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    model = _net()
    reference = copy.deepcopy(model)
    engine, _, _, _ = zero_core.initialize(model=model, config=_cfg())
    w = model[0].weight
    taken, expected = {}, {}
    with zero_core.GatheredParameters(list(model.parameters())):
        for name, how in PATTERNS.items():
            taken[name] = how(w)
            expected[name] = how(w).detach().clone()
        str(taken["view"])  # printing inside is fine too
    assert w.numel() == 0  # released: the module holds no full copy
    for name, t in taken.items():  # after exit: every read gives the values at release time
        str(t)
        for got in _read_every_way(t):
            assert torch.isfinite(got).all(), name
        torch.testing.assert_close(t.detach(), expected[name], rtol=0, atol=0, msg=name)
    # a parameter nobody kept a tensor of still frees its gather buffer
    assert partition_state(model[2].weight).full.untyped_storage().nbytes() == 0

    # train (gather, release, re-gather the same parameters many times); the tensors keep the
    # values they had, and training matches plain torch with a view taken between forward and backward
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    for _step in range(2):
        x, y = torch.randn(2 * world, DIM, generator=g), torch.randn(2 * world, 3, generator=g)
        loss = nn.functional.mse_loss(engine(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2])
        with zero_core.GatheredParameters(list(model.parameters())):
            mid = w.detach()  # taken while autograd holds saved views of the same buffer
        engine.backward(loss)
        engine.step()
        nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
        opt.zero_grad()
        str(mid)
        assert torch.isfinite(mid).all()
    engine.empty_partition_cache()
    for name, t in taken.items():
        torch.testing.assert_close(t.detach(), expected[name], rtol=0, atol=0, msg=f"{name} after training")
    with zero_core.GatheredParameters(list(model.parameters())):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"state": state, "ref": {k: v.detach() for k, v in reference.state_dict().items()}}


@pytest.mark.parametrize("world", [1, 2])
def test_tensors_taken_inside_gathered_parameters_survive_release(world):
    for r in run_multirank(_rank, world, timeout=180):
        for k, v in r["ref"].items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)
