"""``bf16.bf16_master_weights_and_grads`` + ``bf16.bf16_optimizer_states`` (DeepSpeed 0.18's memory mode).

See [Note: bf16 master weights]. At stages 1-3 the run is exactly a plain-PyTorch bf16 model
stepped by a torch optimizer (bf16 weights, gradients and Adam states): bitwise on 1 rank, and on
2 ranks against a reference that sums the ranks' halved gradients as the reduction does; close on
4 ranks (the sum of four bf16 terms depends on its order). ``engine.memory_breakdown()`` shows the
bytes per parameter of the Note's table, for both modes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank
from zero_core.testing.parity import assert_states_equal, assert_tensors_close, state_snapshot

DIM, MICRO, STEPS = 16, 2, 3
BOTH = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _net() -> nn.Module:
    torch.manual_seed(0)
    # every tensor holds a multiple of 4 elements: no padding at 1, 2 or 4 ranks
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 4))


def _adam(params) -> torch.optim.Optimizer:  # noqa: ANN001
    return torch.optim.Adam(params, lr=1e-2, foreach=False)


def _sgd(params) -> torch.optim.Optimizer:  # noqa: ANN001
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False)


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(world * MICRO, DIM, generator=g).bfloat16()
    return x, torch.randn(world * MICRO, 4, generator=g).bfloat16()


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _reference(world: int, make_opt) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """A bf16 model and a torch optimizer on it (bf16 states); each rank's micro-batch backward
    with the loss over ``world`` (the engine's reduction divides before it sums)."""
    model = _net().bfloat16()
    opt = make_opt(model.parameters())
    for step in range(STEPS):
        x, y = _batch(step, world)
        for r in range(world):
            rows = slice(r * MICRO, (r + 1) * MICRO)
            (_loss(model, x[rows], y[rows]) / world).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return state_snapshot(model)


def _config(stage: int, bf16: dict, **zero) -> dict:  # noqa: ANN003
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "bf16": bf16,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }


def _train(stage: int, bf16: dict, make_opt, **zero) -> dict:  # noqa: ANN001, ANN003
    import zero_core
    from zero_core import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    model = _net()
    engine, _, _, _ = zero_core.initialize(
        model=model, optimizer=make_opt, config=_config(stage, bf16, **zero)
    )
    breakdown = {}
    for step in range(STEPS):
        x, y = _batch(step, world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(_loss(engine, x[rows], y[rows]))
        if step == STEPS - 1:  # the states exist (stepped before) and the gradients too
            breakdown = engine.memory_breakdown()
        engine.step()
    opt = engine.strategy.optimizer
    dtypes = {str(t.dtype) for s in opt.state.values() for t in s.values() if t.dim() > 0}
    dtypes |= {str(m.dtype) for g in opt.param_groups for m in g["params"]}
    scalars = sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() == 0
    )
    return {
        "state": state_snapshot(model, gathered=stage == 3),
        "aliased": getattr(engine.strategy, "master_aliases_params", stage == 3),
        "dtypes": dtypes,
        "breakdown": breakdown,
        "scalars": scalars,
        "numel": sum(p.numel() for p in _net().parameters()),
    }


def _stages(make_opt) -> dict:  # noqa: ANN001
    out = {stage: _train(stage, BOTH, make_opt) for stage in (1, 2, 3)}
    # small buckets: a rank's shard is pieces of several chunks, so the master is a bf16 copy
    out["2, several chunks"] = _train(2, BOTH, make_opt, reduce_bucket_size=100)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_masters_train_exactly_like_a_torch_bf16_model(world: int) -> None:
    want = _reference(world, _adam)
    for rank, by_stage in enumerate(run_multirank(_stages, world, args=(_adam,), timeout=240)):
        for stage, r in by_stage.items():
            assert_states_equal(r["state"], want, where=f"stage {stage}, rank {rank} of {world}")
            assert r["dtypes"] == {"torch.bfloat16"}, (stage, r["dtypes"])  # masters and Adam's moments
            assert r["aliased"] == (stage != "2, several chunks"), (stage, world)


def _stage3_on_4() -> dict:
    return _train(3, BOTH, _sgd)


def test_bf16_masters_on_4_ranks_stay_close_to_torch() -> None:
    want = _reference(4, _sgd)
    results = run_multirank(_stage3_on_4, 4, timeout=240)
    for rank, r in enumerate(results):
        assert_tensors_close(r["state"], want, rtol=2e-2, atol=2e-3, where=f"rank {rank}")
        assert_states_equal(r["state"], results[0]["state"], where=f"rank {rank} vs rank 0")


def _both_modes() -> dict:
    fp32_masters = {"enabled": True}
    return {
        (stage, mode): _train(stage, bf16, _adam)
        for stage in (1, 2, 3)
        for mode, bf16 in (("fp32", fp32_masters), ("bf16", BOTH))
    }


def test_memory_breakdown_shows_the_formula() -> None:
    from zero_core.utils.master_dtype import model_state_bytes_per_param

    world = 2
    bf16_torch = _reference(world, _adam)
    for (stage, mode), r in run_multirank(_both_modes, world, timeout=240)[0].items():
        # the keys change the run: only the bf16 masters match the bf16 torch model
        same = all(torch.equal(r["state"][k], v) for k, v in bf16_torch.items())
        assert same == (mode == "bf16"), (stage, mode)
        b = r["breakdown"]
        states = b["parameters"] + b["gradients"] + b["master_weights"] + b["optimizer_states"] - r["scalars"]
        want = model_state_bytes_per_param(stage, world, mode == "bf16")
        assert states / r["numel"] == want, (stage, mode, states / r["numel"], want, b)
        if mode == "bf16":  # the masters are the bf16 parameters (their shard) themselves
            assert b["master_weights"] == 0, (stage, b)
    assert model_state_bytes_per_param(3, 2, True) / model_state_bytes_per_param(3, 2, False) == 0.5


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"zero_optimization": {"stage": 0}}, "needs zero_optimization.stage 1, 2 or 3"),
        ({"bf16": {**BOTH, "enabled": False}}, "needs bf16.enabled: true"),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
            "cannot be combined with zero_optimization.offload_optimizer",
        ),
    ],
)
def test_unsupported_combinations_are_named_errors(extra: dict, says: str) -> None:
    from zero_core.config import ConfigError, load_config

    cfg = {"train_batch_size": 2, "bf16": BOTH, "zero_optimization": {"stage": 3}, **extra}
    with pytest.raises(ConfigError, match=rf"bf16.bf16_master_weights_and_grads: true {says}"):
        load_config(cfg)
    for stage in (1, 2, 3):  # both keys together load at the stages DeepSpeed supports
        assert load_config({"train_batch_size": 2, "bf16": BOTH, "zero_optimization": {"stage": stage}})


def _resume(path: str) -> list[bool]:
    """Per stage: does a run saved after 2 steps and resumed take the same third step (and keep bf16 states)?"""
    import zero_core
    from zero_core import comm

    rank, world = comm.get_rank(), comm.get_world_size()

    def step(engine, s: int) -> None:  # noqa: ANN001
        x, y = _batch(s, world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(_loss(engine, x[rows], y[rows]))
        engine.step()

    same = []
    for stage in (1, 2, 3):
        runs = []
        for resumed in (False, True):
            model = _net()
            engine, _, _, _ = zero_core.initialize(model=model, optimizer=_adam, config=_config(stage, BOTH))
            if resumed:
                engine.load_checkpoint(f"{path}/stage{stage}")
            else:
                for s in range(2):
                    step(engine, s)
                engine.save_checkpoint(f"{path}/stage{stage}")
            step(engine, 2)
            opt = engine.strategy.optimizer
            assert {t.dtype for s in opt.state.values() for t in s.values() if t.dim() > 0} == {
                torch.bfloat16
            }
            runs.append(state_snapshot(model, gathered=stage == 3))
        same.append(all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0]))
    return same


def test_checkpoint_resume_is_exact(tmp_path) -> None:  # noqa: ANN001
    for r in run_multirank(_resume, 2, args=(str(tmp_path),), timeout=240):
        assert r == [True, True, True], r
