"""ZeRO-3 leaf modules whose ranks run different submodules train as data-parallel PyTorch.

The mixture-of-experts case: a block marked with ``set_z3_leaf_modules`` runs, on each rank,
only the experts its tokens were routed to (here ``experts[rank % 2]``; a third expert no rank
uses). DeepSpeed's own test (``test_choose_module_by_rank``) only checks that such a run
finishes; the reference here is single-process data-parallel training: each parameter's gradient
is the mean over ranks of what each rank computed, zero from a rank that did not use it.
Covered: the leaf called twice per forward, a leaf parameter also used outside the leaf before
its entry (a tied weight: its outside gradient arrives after the leaf's), an in-place op on the
leaf's input, and a leaf whose inputs have no producer (the whole model marked as a leaf,
DeepSpeed's ``ChooseModuleByRankModel``). See [Note: z3 leaf gradient units].
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank
from zero_core.testing.parity import assert_tensors_close

DIM, STEPS, LR = 8, 3, 0.5


class RankExperts(nn.Module):
    """Runs the gate, then the expert of its rank (``self.rank % 2``); expert 2 is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(3)])
        self.rank = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(1.5)  # in place on its input, as some MoE blocks do (jitter noise)
        return self.experts[self.rank % 2](torch.tanh(self.gate(x)))


class Net(nn.Module):
    """The leaf block called twice, its gate weight also used (tied) before it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.block = RankExperts()
        self.out = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + 0.1 * nn.functional.linear(h, self.block.gate.weight)  # outside use of a leaf weight
        h = self.block(h) + self.block(torch.tanh(h) + 0.0)
        return nn.functional.cross_entropy(self.out(h), y)


class WholeModelLeaf(nn.Module):
    """DeepSpeed's ChooseModuleByRankModel: the model itself is the leaf, its input is data."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(DIM, 3, bias=False) for _ in range(2)])
        self.rank = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(torch.relu(self.linears[self.rank % 2](x)), y)


def _build(kind: str, rank: int) -> nn.Module:
    torch.manual_seed(0)
    model = Net() if kind == "net" else WholeModelLeaf()
    (model.block if kind == "net" else model).rank = rank
    return model


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(2, DIM, generator=g), torch.randint(0, 3, (2,), generator=g)


def _reference(kind: str, world: int) -> dict[str, torch.Tensor]:
    """One process: the mean over the ranks' losses, each with that rank's expert."""
    model = _build(kind, 0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        for r in range(world):
            (model.block if kind == "net" else model).rank = r
            (model(*_batch(step, r)) / world).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank(kind: str) -> dict[str, torch.Tensor]:
    import zero_core
    from zero_core import comm
    from zero_core.utils import set_z3_leaf_modules

    rank = comm.get_rank()
    model = _build(kind, rank)
    set_z3_leaf_modules(model, [RankExperts if kind == "net" else WholeModelLeaf])
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 100},
    }
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    for step in range(STEPS):
        engine.backward(engine(*_batch(step, rank)))
        engine.step()
    with zero_core.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["net", "whole_model"])
def test_leaf_running_different_experts_per_rank_trains_as_data_parallel(kind, world):
    want = _reference(kind, world)
    if kind == "net":  # the unused expert's gradient is zero everywhere: SGD leaves it as built
        assert torch.equal(
            want["block.experts.2.weight"], _build(kind, 0).state_dict()["block.experts.2.weight"]
        )
    for got in run_multirank(_rank, world, args=(kind,), timeout=240):
        assert_tensors_close(got, want, rtol=1e-5, atol=1e-6, where=f"{kind} on {world} ranks")


def _unmarked_rank() -> str:
    import zero_core
    from zero_core import comm
    from zero_core.zero.stage3.partitioned_param import Stage3CollectiveError

    model = _build("net", comm.get_rank())
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    with pytest.raises(Stage3CollectiveError) as info:
        engine(*_batch(0, comm.get_rank()))
    return str(info.value)


def test_without_the_leaf_mark_the_error_says_to_mark_the_block():
    # each rank gathers its own expert: caught by the agreement check on every rank, never a hang
    for text in run_multirank(_unmarked_rank, 2, timeout=120):
        assert "ranks ran different submodules inside 'block.experts'" in text
        assert "zero.utils.set_z3_leaf_modules(model, [BlockClass])" in text
