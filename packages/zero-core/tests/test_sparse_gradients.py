"""Sparse embedding gradients at ZeRO stage 0: reduced as rows, equal to the dense reduction.

``nn.Embedding(sparse=True)`` gradients are all-gathered as (row indices, row values), as
DeepSpeed's sparse all-reduce does; ``"sparse_gradients": true`` sends the non-zero rows of
dense embedding gradients the same way. Both train exactly like the dense reduction (to fp32
rounding) and, for a batch touching a few of 1000 rows, move far fewer bytes (counted by the
comms logger). Stages 1-3 refuse sparse gradients with an error. See
[Note: sparse gradient reduction] in zero_core/engine/sparse_grads.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank

VOCAB, DIM, MICRO, STEPS = 1000, 16, 6, 3


class _Net(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM, sparse=sparse)
        self.head = nn.Linear(DIM, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx)).squeeze(-1)


def _idx(step: int, rank: int, micro: int) -> torch.Tensor:
    # a few rows per micro-batch, overlapping across ranks (row 7 always): duplicates must be summed
    g = torch.Generator().manual_seed(10 * step + rank + 100 * micro)
    return torch.cat([torch.tensor([7]), torch.randint(0, 40, (MICRO - 1,), generator=g)])


def _train(sparse: bool, extra: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], int, int]:
    import zero_core
    from zero_core import comm
    from zero_core.comm import comms_logger
    from zero_core.zero.debug_access import safe_get_full_grad

    model = _Net(sparse)
    gas = int(extra.get("gradient_accumulation_steps", 1))
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, **extra}
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.5}}
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    dtype = next(model.parameters()).dtype
    comms_logger.reset()
    comms_logger.enable()
    grads = []
    for step in range(STEPS):
        for micro in range(gas):
            out = engine(_idx(step, comm.get_rank(), micro))
            engine.backward(out.float().pow(2).mean())
            if micro < gas - 1:
                engine.step()
        grads.append(safe_get_full_grad(model.emb.weight))
        engine.step()
    comms_logger.disable()
    sent = comms_logger.bytes_for("all_gather_into_tensor") + comms_logger.bytes_for("all_reduce")
    weights = [p.detach().float().clone() for p in model.parameters()]
    engine.destroy()
    return grads, weights, sent, int(dtype.itemsize)


def _cases() -> list:
    bf16 = {
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "gradient_accumulation_steps": 2,
    }
    return [
        _train(False, {}),  # dense reference
        _train(True, {}),  # nn.Embedding(sparse=True)
        _train(False, {"sparse_gradients": True}),  # dense embedding, rows on the wire
        _train(False, bf16),
        _train(True, bf16),  # sparse rows summed in fp32 over the micro-steps
    ]


@pytest.mark.parametrize("world", [1, 2])
def test_sparse_reduction_equals_dense_and_sends_fewer_bytes(world: int) -> None:
    for dense, sparse, compressed, dense16, sparse16 in run_multirank(_cases, world, timeout=240):
        for other in (sparse, compressed):
            for g, ref in zip(other[0], dense[0]):
                torch.testing.assert_close(g, ref, rtol=1e-6, atol=1e-7)
            for w, ref in zip(other[1], dense[1]):
                torch.testing.assert_close(w, ref, rtol=1e-6, atol=1e-7)
            assert other[2] * 10 < dense[2], (other[2], dense[2])  # rows, not the 1000 x 16 table
        for g, ref in zip(sparse16[0], dense16[0]):
            torch.testing.assert_close(g, ref, rtol=1e-6, atol=1e-6)
        assert sparse16[2] * 10 < dense16[2]


def _stage_error(stage: int) -> str:
    import zero_core

    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    try:
        zero_core.initialize(model=_Net(True), config=cfg)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_stages_1_to_3_refuse_sparse_gradients() -> None:
    from zero_core.config import ConfigError, load_config

    for message in run_multirank(lambda: [_stage_error(s) for s in (1, 2, 3)], 1)[0]:
        assert "does not take sparse ones" in message and "emb.weight" in message, message
    with pytest.raises(
        ConfigError, match="sparse_gradients: true reduces embedding gradients sparsely at ZeRO stage 0"
    ):
        load_config({"train_batch_size": 2, "sparse_gradients": True, "zero_optimization": {"stage": 1}})
