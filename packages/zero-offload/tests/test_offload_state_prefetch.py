"""Optimizer states read ahead during backward (see [Note: optimizer state prefetch]).

NVMe optimizer offload with several tiles per group, for every pipeline setting and at stages 2
and 3 (ZeRO-Infinity streaming): the trajectory equals the same engine without offload (fp32,
1e-5), the step finds its first tiles prefetched, and an optimizer state set between backward
and the step (``safe_set_full_optimizer_state``, which writes the swap file) is the one the step
uses, not the prefetched old value. Tiles not prefetched go through buffers a prefetch used; a
first version read only the gradients into such a buffer for every tile, which the swap
checksums caught on the 101M-parameter benchmark (its last tile reused that buffer).

Under ZeRO-Infinity streaming the gradients of a reserved tile stay in its buffer: with as many
spare buffers as tiles, every step after the first moves exactly the states' bytes through the
swap files (no gradient written in backward nor read in the step), with fewer the largest tiles
keep the buffers (the group's partial last tile, reached first, gives its buffer up), the gradients read between
backward and the step (``safe_get_full_grad``) are the engine's without offload, and one set
there (``safe_set_full_grad``) is the one the step applies.
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


def _grad_run(nvme: str | None, sub_group_size: int, touch: bool) -> dict:
    import zero_core
    from zero_core import comm
    from zero_core.zero.debug_access import safe_get_full_grad, safe_set_full_grad
    from zero_core.zero.stage3 import GatheredParameters

    torch.manual_seed(0)
    model = TinyLM(VOCAB, 64, 96)
    zc: dict = {"stage": 3, "sub_group_size": sub_group_size, "stage3_param_persistence_threshold": 0}
    if nvme is not None:
        zc["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 4}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "zero_optimization": zc}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, *_ = zero_core.initialize(model=model, optimizer=opt, config=cfg)
    r = comm.get_rank()
    losses, moved, grads = [], [], {}
    for step in range(STEPS):
        before = engine.strategy.offload.swap_io_bytes() if nvme else None
        x, y = token_batch(11 + step, comm.get_world_size() * MICRO, SEQ, VOCAB)
        loss = engine(x[r * MICRO : (r + 1) * MICRO], y[r * MICRO : (r + 1) * MICRO])
        engine.backward(loss)
        if touch and step == 2:  # read every gradient, and change one, between backward and step
            for n, p in model.named_parameters():
                grads[n] = safe_get_full_grad(p).clone()
            p = model.head.weight
            safe_set_full_grad(p, safe_get_full_grad(p) * 0.5)
        engine.step()
        losses.append(float(loss.detach()))
        if nvme:
            after = engine.strategy.offload.swap_io_bytes()
            moved.append((after["read"] - before["read"], after["written"] - before["written"]))
    out = {"losses": losses, "moved": moved, "grads": grads, "weights": {}}
    if nvme:
        groups = engine.strategy.offload.groups
        out["numel"] = sum(g.numel for g in groups)
        out["tiles"] = sum(len(g.swapper.tiles()) for g in groups)
        out["sizes"] = sorted((hi - lo for g in groups for lo, hi in g.swapper.tiles()), reverse=True)
    for n, p in model.named_parameters():
        with GatheredParameters([p]):
            out["weights"][n] = p.detach().clone()
    engine.destroy()
    return out


@pytest.mark.parametrize(("sub_group_size", "touch"), [(4096, False), (4096, True), (1024, False)])
def test_streamed_gradients_stay_in_the_step_buffers(sub_group_size: int, touch: bool, tmp_path) -> None:
    def both(where: str):
        return _grad_run(where, sub_group_size, touch), _grad_run(None, sub_group_size, touch)

    results = run_multirank(both, 2, args=(str(tmp_path),), timeout=180)
    for rank, (off, ref) in enumerate(results):
        states = 3 * 4 * off["numel"]  # exp_avg, exp_avg_sq, master: each read and written once
        for step, (read, written) in enumerate(off["moved"][1:], start=1):
            if touch and step == 2:  # reading the gradients put them in the swap file, the step reads them
                assert read > states + 4 * off["numel"] and written >= states + 4 * off["numel"], (rank, step)
            elif off["tiles"] <= 3:  # 4 buffers, 1 for the step: every tile's gradients in a buffer
                assert (read, written) == (states, states), (rank, step, off["tiles"])
            else:  # the 3 largest tiles keep their buffers, the others' gradients go through the file
                on_disk = 4 * (off["numel"] - sum(off["sizes"][:3]))
                assert written == states + on_disk, (rank, step, off["sizes"])
                # the partial tile's states were read ahead before it gave its buffer up: read again
                evicted = off["sizes"][-1] if off["sizes"][-1] < off["sizes"][2] else 0
                assert read == written + 3 * 4 * evicted, (rank, step, off["sizes"])
        torch.testing.assert_close(off["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        for n, g in ref["grads"].items():
            torch.testing.assert_close(off["grads"][n], g, rtol=1e-5, atol=1e-6, msg=f"grad {n} rank {rank}")
        for n, w in ref["weights"].items():
            torch.testing.assert_close(off["weights"][n], w, rtol=1e-5, atol=1e-6, msg=f"{n} rank {rank}")


def _behind_run(nvme: str | None) -> dict:
    """Steps whose state writes stay in flight, followed by each kind of access that must wait."""
    import zero_core
    from zero_core import comm
    from zero_core.zero.debug_access import safe_get_full_optimizer_state, safe_set_full_optimizer_state

    torch.manual_seed(0)
    model = TinyLM(VOCAB, 64, 96)
    zc: dict = {"stage": 3, "sub_group_size": 1024, "stage3_param_persistence_threshold": 0}
    if nvme is not None:
        zc["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 4}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "zero_optimization": zc}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, *_ = zero_core.initialize(model=model, optimizer=opt, config=cfg)
    pool = engine.strategy.offload.pool if nvme else None
    r, p = comm.get_rank(), model.head.weight
    out: dict = {"losses": [], "left": [], "settled": [], "seen": []}
    for step in range(STEPS):
        x, y = token_batch(11 + step, comm.get_world_size() * MICRO, SEQ, VOCAB)
        loss = engine(x[r * MICRO : (r + 1) * MICRO], y[r * MICRO : (r + 1) * MICRO])
        engine.backward(loss)
        if pool is not None:
            out["settled"].append(not pool._behind)  # the backward waited for the last step's writes
        engine.step()
        out["losses"].append(float(loss.detach()))
        if pool is not None:
            out["left"].append(bool(pool._behind))
        if step == 1:  # read right after the step: the values its writes carry
            out["seen"].append(safe_get_full_optimizer_state(p, "exp_avg_sq").clone())
        if step == 2:  # write right after the step: not overwritten by them
            safe_set_full_optimizer_state(p, safe_get_full_optimizer_state(p, "exp_avg") * 0.5, "exp_avg")
            out["seen"].append(safe_get_full_optimizer_state(p, "exp_avg").clone())
        if pool is not None and step in (1, 2):
            out["settled"].append(not pool._behind)
    engine.destroy()
    return out


def test_state_writes_behind_the_step_are_waited_for(tmp_path) -> None:
    def both(where: str):
        return _behind_run(where), _behind_run(None)

    for rank, (off, ref) in enumerate(run_multirank(both, 2, args=(str(tmp_path),), timeout=180)):
        assert all(off["left"]), (rank, off["left"])  # every step left its last writes in flight
        assert all(off["settled"]), (rank, off["settled"])  # and every later access waited for them
        torch.testing.assert_close(off["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        for got, want in zip(off["seen"], ref["seen"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
