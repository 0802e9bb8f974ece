"""Checkpoints of offloaded runs use the ordinary format: save with offload, resume without (and back).

A run of 10 steps is saved, resumed in a fresh engine with the other offload setting, trained
10 more steps, and compared with 20 uninterrupted steps of plain PyTorch (fp32, 1e-5).
"""

from __future__ import annotations

import pytest
import torch
from zero_core.testing import run_multirank
from zero_core.testing.models import TinyLM, token_batch
from zero_core.testing.parity import train_engine, train_reference

VOCAB = 32


def _model() -> TinyLM:
    return TinyLM(VOCAB, 16, 24, mlp="one_layer", norm=False)


def _data(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(7 + step, 2 * world, 6, VOCAB)


def _reference(world: int) -> list[float]:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    return train_reference(model, opt, lambda step: _data(step, world), 20)[0]


def _engine(stage: int, offload: dict | None, nvme: str):
    import zero_core

    torch.manual_seed(0)
    model = _model()
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

    return train_engine(engine, lambda step: _data(step, comm.get_world_size()), range(lo, hi), micro=2)


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
