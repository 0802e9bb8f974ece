"""Checkpoints of offloaded runs use the ordinary format: save with offload, resume without (and back).

A run of 10 steps is saved, resumed in a fresh engine with the other offload setting, trained
10 more steps, and compared with 20 uninterrupted steps of plain PyTorch (fp32, 1e-5).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from zero_core.testing import run_multirank

VOCAB = 32


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.l1 = nn.Linear(16, 24)
        self.head = nn.Linear(24, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(torch.tanh(self.l1(self.emb(x)))).reshape(-1, VOCAB), y.reshape(-1))


def _data(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    return torch.randint(0, VOCAB, (2 * world, 6), generator=g), torch.randint(
        0, VOCAB, (2 * world, 6), generator=g
    )


def _reference(world: int) -> list[float]:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    out = []
    for step in range(20):
        loss = model(*_data(step, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _engine(stage: int, offload: dict | None, nvme: str):
    import zero_core

    torch.manual_seed(0)
    model = Tiny()
    zc = {"stage": stage, "sub_group_size": 700}
    if offload is not None:
        offload = dict(offload)
        param = offload.pop("param", None)
        if param is not None:  # stage-3 parameter offload too
            zc["offload_param"] = {"device": param, **({"nvme_path": nvme} if param == "nvme" else {})}
        zc["offload_optimizer"] = {**offload, "nvme_path": nvme} if offload["device"] == "nvme" else offload
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "zero_optimization": zc,
    }
    engine, *_ = zero_core.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=2e-3), config=cfg
    )
    return engine


def _steps(engine, lo: int, hi: int) -> list[float]:
    from zero_core import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    out = []
    for step in range(lo, hi):
        x, y = _data(step, world)
        engine.backward(engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
        engine.step()
        t = torch.tensor([engine.last_loss])
        comm.all_reduce(t)
        out.append(t.item() / world)
    return out


def _save_resume(cases: list, ckpt_root: str, nvme: str) -> list[list[float]]:
    from zero_core import comm

    results = []
    for k, (stage, first, second) in enumerate(cases):
        path = f"{ckpt_root}/case{k}"
        a = _engine(stage, first, nvme)
        losses = _steps(a, 0, 10)
        a.save_checkpoint(path, tag="t10")
        a.destroy()
        comm.barrier()
        b = _engine(stage, second, nvme)
        b.load_checkpoint(path, tag="t10")
        losses += _steps(b, 10, 20)
        b.destroy()
        results.append(losses)
    return results


NVME = {"device": "nvme", "pipeline_read": True, "pipeline_write": True}
CPU = {"device": "cpu"}
CASES = [
    (2, NVME, None),
    (2, None, NVME),
    (3, NVME, None),
    (3, None, CPU),
    (1, CPU, NVME),
    (3, None, NVME),  # load into masters and states on NVMe (ZeRO-Infinity)
    (3, {**NVME, "param": "nvme"}, {**CPU, "param": "cpu"}),
]


@pytest.mark.parametrize("world", [1, 2])
def test_offload_checkpoint_switches_offload_between_save_and_resume(world: int, tmp_path) -> None:
    results = run_multirank(
        _save_resume, world, args=(CASES, str(tmp_path / "ckpt"), str(tmp_path / "nvme")), timeout=240
    )
    ref = torch.tensor(_reference(world))
    for case, losses in zip(CASES, results[0]):
        torch.testing.assert_close(torch.tensor(losses), ref, rtol=1e-5, atol=1e-6, msg=f"{case}")
