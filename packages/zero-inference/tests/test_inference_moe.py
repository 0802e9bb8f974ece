"""Expert-parallel inference: zero-moe experts sharded over ep_size=2 ranks equal the single-process model."""

from __future__ import annotations

import pytest
import torch
import zero_inference as zi
from torch import nn
from zero_core.testing import run_multirank

TOL = 1e-5


class TinyMoEModel(nn.Module):
    """Embedding -> MoE (4 MLP experts, top-2) -> head: the smallest model with a zero-moe layer."""

    def __init__(self, seed: int = 0, ep_size: int = 1) -> None:
        from zero_moe import MoE

        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(32, 16)
        expert = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.moe = MoE(16, expert, num_experts=4, ep_size=ep_size, k=2, eval_capacity_factor=4.0)
        # Give every expert its own weights (MoE starts them as copies).
        with torch.no_grad():
            for p in self.moe.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        out, _, _ = self.moe(h)
        return self.head(h + out)


def _ep_worker() -> dict[str, float | int]:
    rank = torch.distributed.get_rank()
    x = torch.randint(0, 32, (3, 10), generator=torch.Generator().manual_seed(10 + rank))  # per-rank tokens
    reference = TinyMoEModel().eval()
    with torch.no_grad():
        want = reference(x)
    engine = zi.init_inference(TinyMoEModel(), dtype="fp32", moe={"ep_size": 2})
    out = engine(x)
    local = engine.module.moe.zero_moe.experts.zero_experts
    # Rank r keeps global experts 2r, 2r+1: compare their weights with the full model's.
    kept = all(
        torch.equal(local[i][0].weight, reference.moe.zero_moe.experts.zero_experts[2 * rank + i][0].weight)
        for i in range(2)
    )
    top = zi.init_inference(TinyMoEModel(), dtype="fp32", ep_size=2)  # the top-level spelling
    return {
        "rel": float((out - want).abs().max() / want.abs().max()),
        "rel_top": float((top(x) - want).abs().max() / want.abs().max()),
        "local_experts": len(local),
        "kept": int(kept),
    }


def test_expert_parallel_inference_equals_single_process() -> None:
    for res in run_multirank(_ep_worker, 2, timeout=180):
        assert res["local_experts"] == 2 and res["kept"] == 1, res
        assert res["rel"] < TOL and res["rel_top"] < TOL, res


def test_ep_size_errors() -> None:
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        zi.init_inference(TinyMoEModel(), dtype="fp32", moe={"ep_size": 2})
    with pytest.raises(ValueError, match=r"moe.ep_size \(2\) and ep_size \(4\) conflict"):
        zi.init_inference(TinyMoEModel(), dtype="fp32", moe={"ep_size": 2}, ep_size=4)
    single = zi.init_inference(TinyMoEModel(), dtype="fp32")  # ep_size=1: runs as built
    with torch.no_grad():
        x = torch.randint(0, 32, (2, 5))
        assert torch.equal(single(x), TinyMoEModel().eval()(x))
