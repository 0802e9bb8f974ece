"""Unused and frozen parameters with ZeRO stages 1 and 2.

* ``ignore_unused_parameters: true``: a parameter no rank (or only some ranks) used gets a
  zero (partially zero) gradient and nothing hangs; with plain SGD the result equals
  single-process PyTorch on the global batch.
* ``ignore_unused_parameters: false``: every rank raises, naming the parameter.
* frozen parameters are neither partitioned nor updated; a trainable parameter missing
  from the optimizer is a clear error.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from zero_core.testing import run_multirank

STEPS = 5


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.a = nn.Linear(6, 7)
        self.sometimes = nn.Linear(7, 7)  # used by rank 0 only
        self.never = nn.Linear(7, 7)
        self.b = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
        h = torch.tanh(self.a(self.frozen(x)))
        if use_sometimes:
            h = h + self.sometimes(h)
        return self.b(h).pow(2).mean()


def _data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _reference(world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(STEPS):
        loss = sum(model(_data(step, r), use_sometimes=r == 0) for r in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _engine(stage: int, ignore_unused: bool, model: nn.Module, params=None):
    import zero_core

    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 20,
            "overlap_comm": True,
            "ignore_unused_parameters": ignore_unused,
        },
    }
    params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    return zero_core.initialize(model=model, optimizer=opt, config=cfg)[0]


def _run() -> dict:
    from zero_core import comm

    rank = comm.get_rank()
    out: dict = {}
    for stage in (1, 2):
        torch.manual_seed(0)
        model = Net()
        engine = _engine(stage, True, model)
        for step in range(STEPS):
            engine.backward(engine(_data(step, rank), use_sometimes=rank == 0))
            engine.step()
        out[("ignore", stage)] = {k: v.clone() for k, v in model.state_dict().items()}
        out[("frozen_in_shards", stage)] = sum(g.layout.numel for g in engine.strategy.groups)

        torch.manual_seed(0)
        model = Net()
        engine = _engine(stage, False, model)
        try:
            engine.backward(engine(_data(0, rank), use_sometimes=True))
            out[("strict", stage)] = "no error"
        except RuntimeError as e:
            out[("strict", stage)] = str(e)

        torch.manual_seed(0)
        model = Net()
        try:
            _engine(stage, True, model, params=[model.a.weight])
            out[("orphan", stage)] = "no error"
        except ValueError as e:
            out[("orphan", stage)] = str(e)
    return out


def test_stage12_unused_and_frozen_parameters() -> None:
    world = 2
    ref = _reference(world)
    trainable = sum(p.numel() for p in Net().parameters() if p.requires_grad)
    results = run_multirank(_run, world, timeout=120)
    for stage in (1, 2):
        for res in results:
            state = res[("ignore", stage)]
            for k, v in ref.items():
                torch.testing.assert_close(
                    state[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k, s=stage: f"{k} s{s}: {m}"
                )
            assert res[("frozen_in_shards", stage)] == trainable
            msg = res[("strict", stage)]
            assert "never.weight" in msg and "never.bias" in msg and "ignore_unused_parameters" in msg, msg
            assert "a.weight" not in msg.replace("never.weight", "")
            msg = res[("orphan", stage)]
            assert "in no optimizer param group" in msg and "b.weight" in msg, msg
        assert torch.equal(results[0][("ignore", stage)]["frozen.weight"], ref["frozen.weight"])
