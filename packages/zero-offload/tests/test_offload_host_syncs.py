"""With CPU optimizer offload the step still keeps its scalars on the device: no host read in a
micro-step and at most one per optimizer step (the clip coefficient handed to the CPU step),
counted by ``zero_core.testing.host_syncs`` as zero-core's per-stage test does; every collective
tensor on the backend's device (the comm layer's device check is on)."""

from __future__ import annotations

import torch
import torch.nn as nn
from zero_core.testing import run_multirank

MICRO, GAS, DIM = 2, 2, 8


def _offload_syncs() -> tuple[list[int], list[int]]:
    import zero_core
    from zero_core import comm
    from zero_core.testing.host_syncs import count_host_syncs

    comm.set_device_check(True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.5,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    micro_syncs, step_syncs = [], []
    for step in range(3):  # the first optimizer step is a warm-up
        for micro in range(GAS):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + comm.get_rank())
            x, y = torch.randn(MICRO, DIM, generator=g), torch.randn(MICRO, DIM, generator=g)
            with count_host_syncs() as c:
                engine.backward(nn.functional.mse_loss(engine(x), y))
                if micro < GAS - 1:
                    engine.step()
            if micro == GAS - 1:
                with count_host_syncs() as s:
                    engine.step()
                if step > 0:
                    step_syncs.append(s.total)
            if step > 0:
                micro_syncs.append(c.total)
    assert engine.was_step_applied() and engine.get_global_grad_norm() > 0
    comm.set_device_check(False)
    engine.destroy()
    return micro_syncs, step_syncs


def test_step_syncs_with_cpu_optimizer_offload() -> None:
    for micro, step in run_multirank(_offload_syncs, 2, timeout=300):
        assert micro == [0] * len(micro) and max(step) <= 1, (micro, step)
