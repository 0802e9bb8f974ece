"""``offload_optimizer.fast_init``: the NVMe swap files are not written at initialize.

Without it every swap file of the optimizer states is written with zeros through the same
asynchronous I/O path training uses, so a disk that refuses writes fails at initialize; with it
the zeros of the preallocated files are trusted and nothing is written until the first step.
Training is the same either way (see ``test_offload_parity.py``).
"""

from __future__ import annotations

import torch
from zero_core.testing import run_multirank
from zero_core.testing.models import MLPClassifier


def _writes_at_initialize(nvme: str, fast_init: bool) -> int:
    import zero_core
    from zero_ops.aio import AsyncIOHandle

    calls = []
    original = AsyncIOHandle.async_pwrite

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    AsyncIOHandle.async_pwrite = counting
    try:
        torch.manual_seed(0)
        model = MLPClassifier(32, 64, 8)
        off = {"device": "nvme", "nvme_path": nvme, "fast_init": fast_init}
        cfg = {
            "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": 2, "sub_group_size": 1000, "offload_optimizer": off},
        }
        engine, *_ = zero_core.initialize(
            model=model, optimizer=torch.optim.Adam(model.parameters()), config=cfg
        )
        engine.destroy()
    finally:
        AsyncIOHandle.async_pwrite = original
    return len(calls)


def test_fast_init_skips_the_zero_writes(tmp_path) -> None:
    slow, fast = run_multirank(
        lambda: (
            _writes_at_initialize(str(tmp_path / "a"), False),
            _writes_at_initialize(str(tmp_path / "b"), True),
        ),
        1,
    )[0]
    assert slow > 0 and fast == 0, (slow, fast)
