"""Exact resume: a run resumed from a checkpoint in a new process group is bitwise the uninterrupted run."""

from __future__ import annotations

import torch
import torch._dynamo  # noqa: F401  (imported once here, not ~4 s in every forked rank)
import torch.nn as nn
import torch.nn.functional as F
import zero_core.engine  # noqa: F401
from zero_core.testing import run_multirank

STAGES = (0, 1, 2, 3)

D = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(D, 13)
        self.drop = nn.Dropout(0.2)  # consumes the torch RNG: resume must restore it
        self.l2 = nn.Linear(13, 5)
        self.register_buffer("counter", torch.zeros(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.counter += 1
        return F.cross_entropy(self.l2(self.drop(torch.tanh(self.l1(x)))), y)


def config(stage: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 15, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50},
        **extra,
    }


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(2, D, generator=g), torch.randint(0, 5, (2,), generator=g)


def make_engine(stage: int, seed: int = 0, **extra):
    import zero_core

    torch.manual_seed(seed)
    engine, *_ = zero_core.initialize(model=Net(), config=config(stage, **extra))
    return engine


def train(engine, first: int, last: int) -> list[float]:
    import torch.distributed as dist

    rank = dist.get_rank()
    losses = []
    for step in range(first, last):
        for micro in range(engine.gradient_accumulation_steps()):
            loss = engine(*batch(step, micro, rank))
            engine.backward(loss)
            engine.step()
        losses.append(engine.last_loss)
    return losses


def _uninterrupted(tmp: str) -> dict[int, list[float]]:
    # every stage in one launch: forked ranks are cheap, process-group setups are not free
    out = {}
    for stage in STAGES:
        d = f"{tmp}/s{stage}"
        engine = make_engine(stage)
        train(engine, 0, 10)
        engine.save_checkpoint(d, tag="step10", client_state={"epoch": 3, "note": "mid"})
        out[stage] = train(engine, 10, 20)
        engine.save_checkpoint(d, tag="end_a", save_latest=False)
    return out


def _resumed(tmp: str) -> dict[int, tuple[list[float], dict, int]]:
    out = {}
    for stage in STAGES:
        d = f"{tmp}/s{stage}"
        engine = make_engine(stage, seed=1234)  # different init: everything must come from the checkpoint
        torch.manual_seed(4321)  # and a different RNG: the checkpoint's must be restored
        path, client = engine.load_checkpoint(d)  # 'latest' names step10
        assert path.endswith("step10"), path
        losses = train(engine, 10, 20)
        engine.save_checkpoint(d, tag="end_b", save_latest=False)
        out[stage] = (losses, client, engine.global_steps)
    return out


def test_exact_resume_bitwise(tmp_path):
    """Stages 0-3: train 10 steps, save, continue to 20; a new process group resumes bitwise."""
    from zero_core.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tmp = str(tmp_path)
    a = run_multirank(_uninterrupted, 2, args=(tmp,))
    b = run_multirank(_resumed, 2, args=(tmp,))
    for stage in STAGES:
        for rank in range(2):
            losses_b, client, steps = b[rank][stage]
            assert client == {"epoch": 3, "note": "mid"}
            assert steps == 20
            assert losses_b == a[rank][stage], f"stage {stage} rank {rank}: resumed losses differ"
        wa = get_fp32_state_dict_from_zero_checkpoint(f"{tmp}/s{stage}", tag="end_a")
        wb = get_fp32_state_dict_from_zero_checkpoint(f"{tmp}/s{stage}", tag="end_b")
        assert wa.keys() == wb.keys() and "counter" in wa
        for k in wa:
            assert torch.equal(wa[k], wb[k]), (stage, k)
