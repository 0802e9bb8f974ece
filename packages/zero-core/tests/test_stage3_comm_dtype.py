"""``communication_data_type`` under ZeRO stage 3: gradient buckets are reduce-scattered in that
dtype (as stages 0-2 do), not in the 16-bit training dtype."""

from __future__ import annotations

import torch
from zero_core.testing import run_multirank


def _reduced_dtypes(comm_type: str | None) -> list[str]:
    import zero_core
    from zero_core import comm

    seen: list[str] = []
    real = comm.reduce_scatter_tensor

    def recording(output, tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        seen.append(str(tensor.dtype))
        return real(output, tensor, *args, **kwargs)

    comm.reduce_scatter_tensor = recording
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "bf16": {"enabled": True},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        if comm_type is not None:
            cfg["communication_data_type"] = comm_type
        engine, *_ = zero_core.initialize(model=model, config=cfg)
        x = torch.randn(2, 6, generator=torch.Generator().manual_seed(comm.get_rank())).bfloat16()
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    finally:
        comm.reduce_scatter_tensor = real
    return sorted(set(seen))


def test_reduce_scatter_uses_communication_data_type():
    assert run_multirank(_reduced_dtypes, 2, args=("fp32",)) == [["torch.float32"]] * 2
    assert run_multirank(_reduced_dtypes, 2, args=(None,)) == [["torch.bfloat16"]] * 2
