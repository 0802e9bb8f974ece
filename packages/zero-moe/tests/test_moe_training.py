"""Data-parallel training of a small MoE transformer on 2 ranks matches one process.

Each rank trains on its own micro-batch with ``reduce_moe_gradients`` and AdamW over the
parameter groups of ``split_params_into_different_moe_groups_for_optimizer``. The reference is
one process holding every expert (ep_size=1) that backpropagates the mean of the per-rank losses
(fp32, no gate noise, RTS off). The model mixes an expert-parallel layer (ep_size=2) and a
replicated one (ep_size=1), so both reduction paths are exercised.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from zero_core.testing import run_multirank
from zero_core.testing.parity import assert_tensors_close
from zero_core.zero.stage3.param_records import partition_state
from zero_moe import MoE, reduce_moe_gradients, split_params_into_different_moe_groups_for_optimizer

V, D, SEQ, BATCH, E, STEPS = 16, 16, 8, 2, 4, 3


def _ffn() -> nn.Module:
    return nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))


class Block(nn.Module):
    def __init__(self, ep_size: int, k: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        # No projection biases: the key bias has an exactly-zero gradient (softmax is shift
        # invariant), so its rounding noise would be amplified by Adam into lr-sized updates.
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True, bias=False)
        self.ln2 = nn.LayerNorm(D)
        self.moe = MoE(
            D,
            _ffn(),
            num_experts=E,
            ep_size=ep_size,
            k=k,
            capacity_factor=1.0,
            min_capacity=0,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        out, l_aux, _ = self.moe(self.ln2(x))
        return x + out, l_aux


class TinyMoEModel(nn.Module):
    def __init__(self, ep_sizes: tuple[int, int]) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(ep_sizes[0], 2), Block(ep_sizes[1], 1)])
        self.head = nn.Linear(D, V)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        aux = x.new_zeros(())
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        return F.cross_entropy(self.head(x).reshape(-1, V), labels.reshape(-1)) + 0.01 * aux


def _build(ep_sizes: tuple[int, int], zero_init: dict | None = None) -> TinyMoEModel:
    """The model; with ``zero_init`` (a config) built partitioned under ``zero.Init``."""
    from contextlib import nullcontext

    from zero_core.zero.stage3 import GatheredParameters, Init

    torch.manual_seed(0)
    with Init(config_dict_or_path=zero_init) if zero_init is not None else nullcontext():
        model = TinyMoEModel(ep_sizes)
    g = torch.Generator().manual_seed(7)
    for block in model.blocks:
        states = [
            {n: torch.randn(p.shape, generator=g) * 0.3 for n, p in _ffn().named_parameters()}
            for _ in range(E)
        ]
        offset = block.moe.global_expert_offset
        for i, expert in enumerate(block.moe.zero_moe.experts.zero_experts):
            # each rank writes the experts it holds (a no-op gather without zero.Init)
            with GatheredParameters(list(expert.parameters()), modifier_rank=0):
                expert.load_state_dict(states[offset + i])
    return model


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, V, (BATCH, SEQ), generator=g), torch.randint(0, V, (BATCH, SEQ), generator=g)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters())})
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01)


def _ref_name(model: TinyMoEModel, name: str) -> str:
    if ".zero_experts." not in name:
        return name
    block = model.blocks[int(name.split(".")[1])]
    head, tail = name.split(".zero_experts.")
    local, rest = tail.split(".", 1)
    return f"{head}.zero_experts.{block.moe.global_expert_offset + int(local)}.{rest}"


def _assert_matches_reference(model: TinyMoEModel, ref: TinyMoEModel) -> None:
    """Every parameter of ``model`` equals the reference's (an expert: the one of its global index)."""
    ref_params = dict(ref.named_parameters())
    want = {name: ref_params[_ref_name(model, name)] for name, _ in model.named_parameters()}
    assert_tensors_close(dict(model.named_parameters()), want, rtol=1e-5, atol=1e-6)


def _train_worker() -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build((2, 1)), _build((1, 1))
    opt, ref_opt = _optimizer(model), _optimizer(ref)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(*_batch(step, rank))
        loss.backward()
        reduce_moe_gradients(model)
        opt.step()
        losses.append(loss.item())

        ref_opt.zero_grad()
        for r in range(world):
            (ref(*_batch(step, r)) / world).backward()
        ref_opt.step()

    _assert_matches_reference(model, ref)
    return losses


def test_two_rank_training_matches_single_process():
    losses = run_multirank(_train_worker, 2, timeout=180)
    assert len(losses) == 2 and all(len(rank_losses) == STEPS for rank_losses in losses)
    assert losses[0] != losses[1]  # the ranks really trained on different data


# The same training through zero-core's engine: it reduces expert gradients over the
# expert-data-parallel group only (zero_core's [Note: expert parameters]) and keeps each
# rank's own experts when it synchronises the initial weights. Stage 3 partitions experts over
# their expert-data-parallel group ([Note: stage 3 expert parameters]); nothing is persistent
# and buckets are small, so gathers and reduce-scatters mix dense parameters and both expert
# groups (ep_size 2: a group of one rank; ep_size 1: both ranks) and are split by group.
def _engine_worker(stage: int, clip: float = 0.0, zero_init: bool = False) -> list[float]:
    import zero_core
    from zero_core.zero.stage3 import GatheredParameters

    rank, world = dist.get_rank(), dist.get_world_size()
    zero_opt = {"stage": stage}
    if stage == 3:
        zero_opt.update(
            param_persistence_threshold=0,
            reduce_bucket_size=3000,
            prefetch_bucket_size=2000,
        )
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "zero_optimization": zero_opt,
    }
    model, ref = _build((2, 1), config if zero_init else None), _build((1, 1))
    if zero_init:
        _check_partition_groups(model, world)
    engine, _, _, _ = zero_core.initialize(model=model, optimizer=_optimizer(model), config=config)
    ref_opt = _optimizer(ref)
    losses = []
    for step in range(STEPS):
        loss = engine(*_batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        ref_opt.zero_grad()
        for r in range(world):
            (ref(*_batch(step, r)) / world).backward()
        if clip > 0:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            assert ref_norm > clip  # the clipping really scales the step
            assert abs(engine.get_global_grad_norm() - ref_norm.item()) <= 1e-5 * ref_norm.item()
        ref_opt.step()
    with GatheredParameters(list(model.parameters()), enabled=stage == 3):
        _assert_matches_reference(model, ref)
    return losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_training_matches_single_process(stage):
    losses = run_multirank(_engine_worker, 2, args=(stage,), timeout=180)
    assert losses[0] != losses[1]


def _check_partition_groups(model: TinyMoEModel, world: int) -> None:
    """Experts of the ep_size-2 layer are whole on each rank (expert-data-parallel group of one
    rank); those of the ep_size-1 layer and dense parameters are split over both ranks."""
    from zero_core.zero.stage3 import is_partitioned

    for name, p in model.named_parameters():
        assert is_partitioned(p), name
        st = partition_state(p)
        # blocks.0 has ep_size 2: its experts are split over world // 2 ranks
        expected = world // 2 if name.startswith("blocks.0.") and ".zero_experts." in name else world
        assert st.world == expected, (name, st.world)
        assert st.grad_divisor == world, name
        assert p.zero_shard.numel() == -(-p.zero_numel // expected), name


def test_stage3_zero_init_partitions_experts_over_their_group_and_trains():
    losses = run_multirank(_engine_worker, 2, args=(3, 0.0, True), timeout=180)
    assert losses[0] != losses[1]


def test_stage3_four_ranks_partitions_experts_over_two_rank_groups():
    # ep_size 2 on 4 ranks: expert-data-parallel groups {0, 2} and {1, 3} hold halves of each
    # expert (real all-gathers and reduce-scatters outside the data-parallel group), while the
    # gradient is still averaged over all 4 ranks; built under zero.Init, clipped.
    losses = run_multirank(_engine_worker, 4, args=(3, 0.05, True), timeout=240)
    assert len({tuple(x) for x in losses}) == 4


def test_stage3_gradient_clipping_uses_the_global_norm_over_experts():
    # Each expert element lives in exactly one rank's shard, so the summed norm shares are the
    # norm of the whole model's gradient (the single-process reference's clip_grad_norm_).
    losses = run_multirank(_engine_worker, 2, args=(3, 0.05), timeout=180)
    assert losses[0] != losses[1]


def _sync_counts() -> list[tuple[int, int]]:
    import zero_core
    from zero_core import comm
    from zero_core.testing.host_syncs import count_host_syncs

    comm.set_device_check(True)
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "steps_per_print": 10**6,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = zero_core.initialize(model=TinyMoEModel((2, 1)), config=cfg)
    out = []
    for _ in range(2):
        tokens, labels = torch.randint(0, V, (BATCH, SEQ)), torch.randint(0, V, (BATCH, SEQ))
        with count_host_syncs() as micro:
            engine.backward(engine(tokens, labels))
        with count_host_syncs() as step:
            engine.step()
        out.append((micro.total, step.total))
    comm.set_device_check(False)
    return out


def test_moe_step_has_no_host_syncs():
    """Gating, the all-to-alls and the ZeRO-1 step of an MoE model read nothing back to the host
    (See [Note: scalars stay on the device in the step]); collective tensors on the backend's device."""
    for counts in run_multirank(_sync_counts, 2, timeout=200):
        assert counts == [(0, 0), (0, 0)], counts
