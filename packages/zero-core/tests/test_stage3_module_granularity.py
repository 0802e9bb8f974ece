"""``zero_optimization.module_granularity_threshold``: fine-grained modules fetched as one unit.

See [Note: module granularity threshold]: DeepSpeed's rule picks the modules, which become z3
leaves; fewer hooks fire and fewer all-gathers run per step, and training matches single-process
PyTorch (fp32, 1e-5) at world sizes 1, 2 and 4.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank
from zero_core.testing.parity import assert_trajectory_close, state_snapshot, train_engine, train_reference

W, VOCAB, BLOCKS, MICRO, SEQ, STEPS = 8, 64, 6, 2, 4, 3
THRESHOLD = 40  # a block's granularity is 29, the whole model's 76


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(W)
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(self.norm(x)))


class Net(nn.Module):
    """An embedding, many small blocks (in a ModuleList) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, W)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.act = nn.GELU()  # no parameters: never a leaf
        self.head = nn.Linear(W, VOCAB)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(self.act(x)).flatten(0, 1), y.flatten())


def test_granularity_follows_deepspeeds_rule() -> None:
    from zero_core.zero.stage3.leaf_modules import get_z3_leaf_modules
    from zero_core.zero.stage3.module_granularity import granularities, mark_fine_grained_leaves

    model = Net()
    sizes = granularities(model)
    # a block: (16 + 72) parameters over 3 layers (LayerNorm, Linear, itself)
    assert sizes[id(model.blocks[0])] == 88 // 3
    # the model: 512 + 6 * 88 + 576 parameters over 1 + 6 * 3 + 1 + 1 layers
    assert sizes[id(model)] == (512 + 6 * 88 + 576) // 21
    for never in (
        model.blocks,
        model.act,
        model.embed,
        model.blocks[0].proj,
    ):  # container, no params, childless
        assert sizes[id(never)] == sys.maxsize
    assert mark_fine_grained_leaves(model, 0) == [] and get_z3_leaf_modules(model) == []
    with pytest.warns(
        UserWarning, match="threshold=28 has no effect: the smallest module granularity here is 29"
    ):
        assert mark_fine_grained_leaves(model, 28) == []
    assert mark_fine_grained_leaves(model, THRESHOLD) == list(model.blocks)
    assert get_z3_leaf_modules(model) == list(model.blocks)
    assert all(p.zero_z3_leaf_module for p in model.blocks.parameters())
    whole = Net()
    assert mark_fine_grained_leaves(whole, 80) == [whole]  # the parent first, as DeepSpeed walks
    with pytest.raises(ValueError, match="module_granularity_threshold must be an int >= 0, got -1"):
        mark_fine_grained_leaves(Net(), -1)


def test_the_key_warns_below_stage_3() -> None:
    from zero_core.config import load_config

    with pytest.warns(
        UserWarning, match="module_granularity_threshold: applies to stage 3's parameter fetches only"
    ):
        load_config(
            {"train_batch_size": 2, "zero_optimization": {"stage": 2, "module_granularity_threshold": 5}}
        )


def _batch(world: int):  # noqa: ANN202
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, VOCAB, (world * MICRO, SEQ + 1), generator=g)
        return ids[:, :-1], ids[:, 1:]

    return batch


def _config(threshold: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "zero_optimization": {
            "stage": 3,
            "module_granularity_threshold": threshold,
            "stage3_param_persistence_threshold": 0,  # every parameter is fetched and released
            "stage3_prefetch_bucket_size": 0,  # one fetch per hook: what the threshold changes
        },
    }


def _train(threshold: int, world: int) -> dict:
    import zero_core
    from zero_core import comm

    torch.manual_seed(0)
    model = Net()
    engine, _, _, _ = zero_core.initialize(
        model=model,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        config=_config(threshold),
    )
    losses = train_engine(engine, _batch(world), range(1), micro=MICRO)  # records the trace
    comm.comms_logger.enable()
    comm.comms_logger.reset()
    losses += train_engine(engine, _batch(world), range(1, STEPS), micro=MICRO)
    gathers = comm.comms_logger.count_for("all_gather_into_tensor") / (STEPS - 1)
    comm.comms_logger.disable()
    trace = engine.strategy.coordinator.traces[(True, True)]  # one fetch per module hook fired
    leaves = [type(m).__name__ for m in engine.strategy.granularity_leaves]
    return {
        "losses": losses,
        "state": state_snapshot(model, gathered=True),
        "fetches": len(trace),
        "handles": len(engine.strategy.hooks.handles),
        "gathers": gathers,
        "leaves": leaves,
    }


def _both(world: int) -> dict:
    return {"off": _train(0, world), "on": _train(THRESHOLD, world)}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_threshold_fetches_blocks_whole_and_trains_like_torch(world: int) -> None:
    torch.manual_seed(0)
    ref = Net()
    ref_losses, ref_state = train_reference(
        ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), _batch(world), STEPS
    )
    for rank, r in enumerate(run_multirank(_both, world, args=(world,), timeout=240)):
        off, on = r["off"], r["on"]
        for run in (off, on):
            assert_trajectory_close(
                run["losses"], run["state"], ref_losses, ref_state, rtol=1e-5, atol=1e-6, where=f"rank {rank}"
            )
        assert on["leaves"] == ["Block"] * BLOCKS and off["leaves"] == []
        # a fetch per module in forward and in backward: root, embed, 6 x (block, norm, proj), act, head
        # = 22 -> root, embed, 6 blocks, act, head = 10
        assert (off["fetches"], on["fetches"]) == (2 * 22, 2 * 10), (off["fetches"], on["fetches"])
        assert on["handles"] < off["handles"]
        if world > 1:
            # one all-gather per forward fetch of a module with parameters (backward reuses them:
            # max_reuse_distance): embed, 6 x (norm, proj), head = 14 -> embed, 6 blocks, head = 8
            assert (off["gathers"], on["gathers"]) == (14, 8), (off["gathers"], on["gathers"])
