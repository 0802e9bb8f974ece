"""Optimizer states read ahead during backward (see [Note: optimizer state prefetch]).

NVMe optimizer offload with several tiles per group, for every pipeline setting and at stages 2
and 3 (ZeRO-Infinity streaming): the trajectory equals the same engine without offload (fp32,
1e-5), the step finds its first tiles prefetched, and an optimizer state set between backward
and the step (``safe_set_full_optimizer_state``, which writes the swap file) is the one the step
uses, not the prefetched old value. Tiles not prefetched go through buffers a prefetch used; a
first version read only the gradients into such a buffer for every tile, which the swap
checksums caught on the 101M-parameter benchmark (its last tile reused that buffer).
"""

from __future__ import annotations

import pytest
import torch
from zero_core.testing import run_multirank
from zero_core.testing.models import TinyLM, token_batch

VOCAB, SEQ, MICRO, STEPS = 32, 8, 2, 4


def _engine(nvme: str | None, stage: int, pipeline: tuple[bool, bool]):
    import zero_core

    torch.manual_seed(0)
    model = TinyLM(VOCAB, 64, 96)  # 16.7k parameters
    # 1024-element tiles (the smallest): every group spans several, the last one partial
    zc: dict = {"stage": stage, "sub_group_size": 1024}
    if stage == 3:
        zc["stage3_param_persistence_threshold"] = 0
    if nvme is not None:
        zc["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": nvme,
            "buffer_count": 4,
            "pipeline_read": pipeline[0],
            "pipeline_write": pipeline[1],
        }
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "zero_optimization": zc}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, *_ = zero_core.initialize(model=model, optimizer=opt, config=cfg)
    return engine, model


def _train(nvme: str | None, stage: int, pipeline: tuple[bool, bool], set_state: bool) -> dict:
    from zero_core import comm
    from zero_core.zero.debug_access import safe_get_full_optimizer_state, safe_set_full_optimizer_state
    from zero_core.zero.stage3 import GatheredParameters
    from zero_offload.nvme_swapper import StateSwapper

    engine, model = _engine(nvme, stage, pipeline)
    offload = engine.strategy.offload
    used: list[int] = []
    run = StateSwapper.run

    def counted(self: StateSwapper, update) -> None:
        used.append(len(self.prefetched))  # tiles found read ahead
        run(self, update)

    StateSwapper.run = counted  # type: ignore[method-assign]
    losses, r = [], comm.get_rank()
    try:
        for step in range(STEPS):
            x, y = token_batch(11 + step, comm.get_world_size() * MICRO, SEQ, VOCAB)
            loss = engine(x[r * MICRO : (r + 1) * MICRO], y[r * MICRO : (r + 1) * MICRO])
            engine.backward(loss)
            if set_state and step == 2:  # after the prefetch started, before the step reads it
                p = next(iter(model.parameters()))
                avg = safe_get_full_optimizer_state(p, "exp_avg")
                safe_set_full_optimizer_state(p, avg * 0.5, "exp_avg")
            engine.step()
            losses.append(float(loss.detach()))
    finally:
        StateSwapper.run = run  # type: ignore[method-assign]
    tiles = sum(len(g.swapper.tiles()) for g in offload.groups if g.swapper is not None) if nvme else 0
    weights = {}
    for n, p in model.named_parameters():
        if stage == 3:
            with GatheredParameters([p]):
                weights[n] = p.detach().clone()
        else:
            weights[n] = p.detach().clone()
    engine.destroy()
    return {"losses": losses, "weights": weights, "prefetched": sum(used), "runs": len(used), "tiles": tiles}


def _both(nvme: str, stage: int, pipeline: tuple[bool, bool], set_state: bool) -> tuple[dict, dict]:
    return _train(nvme, stage, pipeline, set_state), _train(None, stage, pipeline, set_state)


@pytest.mark.parametrize(
    ("stage", "pipeline", "world"),
    [(3, (False, False), 2), (3, (True, False), 1), (3, (True, True), 2), (2, (False, False), 2)],
)
def test_prefetched_states_train_as_without_offload(
    stage: int, pipeline: tuple, world: int, tmp_path
) -> None:
    for set_state in (False, True):
        where = str(tmp_path / f"s{int(set_state)}")
        results = run_multirank(_both, world, args=(where, stage, pipeline, set_state), timeout=180)
        for rank, (off, ref) in enumerate(results):
            # every step after the first found the tiles the idle buffers hold read ahead
            spare = 4 - (1 + pipeline[0] + pipeline[1])
            assert off["tiles"] > spare, off["tiles"]
            assert off["prefetched"] >= (STEPS - 1) * spare, (rank, off["prefetched"], off["runs"])
            torch.testing.assert_close(off["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
            for n, w in ref["weights"].items():
                torch.testing.assert_close(off["weights"][n], w, rtol=1e-5, atol=1e-6, msg=f"{n} rank {rank}")
