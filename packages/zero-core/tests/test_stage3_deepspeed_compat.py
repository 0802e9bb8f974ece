"""DeepSpeed's ZeRO API that scripts use beyond the training loop (issue 26): z3 leaf modules,
unwrap_model_for_generation, OnDevice, MiCS_Init, safe_set_*_grad, safe_get_* on frozen and stage-0
bf16 parameters, offload_states / reload_states, and zero.utils.set_random_seed."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank
from zero_core.testing.parity import assert_tensors_close
from zero_core.zero.stage3.param_records import partition_state

DIM, WORLD = 4, 2


class _Experts(nn.Module):
    """Runs its two experts in a data-dependent order (as MoE blocks run only the chosen experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.e0 = nn.Linear(DIM, DIM)
        self.e1 = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = (self.e0, self.e1) if float(x.detach().sum()) > 0 else (self.e1, self.e0)
        first, second = (e(x) for e in order)
        return first + second  # exact in either order


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), _Experts(), nn.Linear(DIM, 2))


def _leaf_net() -> nn.Module:
    """:func:`_net` with its experts block marked a ZeRO-3 leaf (ranks run its experts in different orders)."""
    from zero_core.utils import set_z3_leaf_modules

    model = _net()
    set_z3_leaf_modules(model, [_Experts])
    return model


def _cfg(stage: int, **extra) -> dict:
    zo = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "zero_optimization": zo,
        **extra,
    }


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(2 * WORLD, DIM, generator=g).abs()
    x[2:] = -x[2:]  # rank 0's rows sum > 0, rank 1's < 0: the experts run in opposite orders
    y = torch.randn(2 * WORLD, 2, generator=g)
    return (x, y) if rank < 0 else (x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])


def _leaf_rank() -> dict:
    import zero_core
    from zero_core import comm
    from zero_core.utils import (
        get_z3_leaf_modules,
        set_z3_leaf_modules,
        unset_z3_leaf_modules,
        z3_leaf_module,
    )
    from zero_core.zero.stage3.partitioned_param import Stage3CollectiveError

    rank = comm.get_rank()
    model = _net()
    with pytest.raises(ValueError, match=r"no module of type \['Conv2d'\] found"):
        set_z3_leaf_modules(model, [nn.Conv2d])
    assert set_z3_leaf_modules(model, ["_Experts"]) == [model[1]]  # a class name works too
    assert unset_z3_leaf_modules(model, [_Experts]) == [model[1]] and not z3_leaf_module(model[1])
    assert set_z3_leaf_modules(model, [_Experts]) == [model[1]]
    assert get_z3_leaf_modules(model) == [model[1]] and z3_leaf_module(model[1])
    engine, _, _, _ = zero_core.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=_cfg(3)
    )
    losses = []
    for step in range(2):
        x, y = _data(step, rank)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = _gathered_state(zero_core, model)

    # without the leaf mark the ranks gather the experts in different orders: caught, not hung
    plain = _net()
    engine2, _, _, _ = zero_core.initialize(
        model=plain, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1), config=_cfg(3)
    )
    x, y = _data(0, rank)
    with pytest.raises(Stage3CollectiveError, match="ranks disagree on the next collective"):
        engine2(x)
    return {"state": state, "losses": losses}


def _gathered_state(zero_core, model: nn.Module) -> dict[str, torch.Tensor]:
    with zero_core.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_z3_leaf_module_is_gathered_whole_and_trains_like_torch():
    ref = _net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x, y = _data(step, -1)
        # the mean over both ranks' rows: each rank's batch alone decides its expert order
        loss = sum(
            nn.functional.mse_loss(ref(x[2 * r : 2 * r + 2]), y[2 * r : 2 * r + 2]) for r in range(WORLD)
        )
        (loss / WORLD).backward()
        opt.step()
        opt.zero_grad()
    want = {k: v.detach() for k, v in ref.state_dict().items()}
    for r in run_multirank(_leaf_rank, WORLD, timeout=180):
        assert_tensors_close(r["state"], want, rtol=1e-5, atol=1e-6)


def _grads_rank() -> dict:
    import zero_core
    from zero_core.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_get_local_grad,
        safe_get_local_optimizer_state,
        safe_set_full_grad,
        safe_set_local_grad,
    )

    x, y = _data(0, __import__("zero_core.comm").comm.get_rank())
    for stage in (0, 1, 2, 3):
        model = _leaf_net()
        model[0].bias.requires_grad_(False)
        engine, _, _, _ = zero_core.initialize(
            model=model,
            optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
            config=_cfg(stage),
        )
        engine.backward(nn.functional.mse_loss(engine(x), y))
        frozen = model[0].bias
        assert safe_get_full_fp32_param(frozen) is None and safe_get_full_grad(frozen) is None
        assert safe_get_local_fp32_param(frozen) is None and safe_get_local_grad(frozen) is None
        assert safe_get_full_optimizer_state(frozen, "momentum_buffer") is None
        assert safe_get_local_optimizer_state(frozen, "momentum_buffer") is None
        w, v = model[0].weight, model[2].weight
        w_before, v_before = safe_get_full_fp32_param(w), safe_get_full_fp32_param(v)
        v_grad = safe_get_full_grad(v)
        new_grad = torch.arange(DIM * DIM, dtype=torch.float32).reshape(DIM, DIM) / 10
        safe_set_full_grad(w, new_grad)
        safe_set_local_grad(v, 2 * safe_get_local_grad(v))  # this rank's part only, doubled
        engine.step()
        torch.testing.assert_close(
            safe_get_full_fp32_param(w), w_before - 0.1 * new_grad, msg=f"stage {stage}"
        )
        torch.testing.assert_close(safe_get_full_fp32_param(v), v_before - 0.2 * v_grad, msg=f"stage {stage}")

    # stage 0 with bf16: the fp32 values are the optimizer's masters, not the bf16 module copy
    model = _leaf_net()
    engine, _, _, _ = zero_core.initialize(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        config=_cfg(0, bf16={"enabled": True}),
    )
    engine.backward(nn.functional.mse_loss(engine(x.bfloat16()).float(), y))
    engine.step()
    w = model[0].weight
    master = engine.strategy.master[w]
    got = safe_get_full_fp32_param(w)
    assert got.dtype == torch.float32 and torch.equal(got, master.detach())
    assert not torch.equal(got, w.detach().float())  # the bf16 copy is rounded
    assert torch.equal(safe_get_full_optimizer_state(w, "exp_avg"), engine.optimizer.state[master]["exp_avg"])
    return {}


def test_safe_set_grads_frozen_params_and_stage0_bf16():
    run_multirank(_grads_rank, WORLD, timeout=240)


def _storage_ptrs(engine) -> dict[str, list[int]]:
    s = engine.strategy
    return {
        "lp_params": [partition_state(p).shard.data_ptr() for p in s.params],
        "optim_states": [t.data_ptr() for st in s.optimizer.state.values() for t in st.values() if t.dim()],
    }


def _offload_rank() -> dict:
    import zero_core

    rank = __import__("zero_core.comm").comm.get_rank()

    def train(engine, steps):
        for step in steps:
            x, y = _data(step, rank)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()

    def build():
        model = _leaf_net()
        engine, _, _, _ = zero_core.initialize(
            model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01), config=_cfg(3)
        )
        return model, engine

    ref_model, ref = build()
    train(ref, range(3))
    model, engine = build()
    train(engine, range(1))
    before = _storage_ptrs(engine)
    x, y = _data(1, rank)
    # only the optimizer states: forward (generation) still works, training does not
    engine.offload_states(include=[zero_core.OffloadStateTypeEnum.optim_states], pin_memory=True)
    assert all(a != b for a, b in zip(_storage_ptrs(engine)["optim_states"], before["optim_states"]))
    with torch.no_grad():
        engine(x)
    with pytest.raises(RuntimeError, match=r"model states \['optim_states'\] are offloaded"):
        engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.zero_grad()
    engine.reload_states()
    # everything
    engine.offload_states()
    moved = _storage_ptrs(engine)
    assert all(a != b for a, b in zip(moved["lp_params"], before["lp_params"]))
    for p in engine.strategy.params:  # fp32: the master *is* the shard, and stays so
        assert engine.strategy.master[partition_state(p).id].data_ptr() == partition_state(p).shard.data_ptr()
        assert partition_state(p).shard.device.type == "cpu"
    with pytest.raises(RuntimeError, match="call engine.reload_states"):
        engine(x)
    with pytest.raises(RuntimeError, match="offloaded already"):
        engine.offload_states(include=["lp_params"])
    engine.reload_states(non_blocking=True)
    zero_core.get_accelerator().synchronize()
    train(engine, range(1, 3))
    with pytest.raises(ValueError, match="unknown state kind 'gpu_cache'"):
        engine.offload_states(include=["gpu_cache"])
    with pytest.raises(ValueError, match="device must be 'cpu'"):
        engine.offload_states(device=zero_core.OffloadDeviceEnum.nvme)
    plain = _leaf_net()
    e0, _, _, _ = zero_core.initialize(
        model=plain, optimizer=torch.optim.Adam(plain.parameters(), lr=0.01), config=_cfg(0)
    )
    with pytest.raises(NotImplementedError, match="ZeRO stage 3 only"):
        e0.offload_states()
    return {"got": _gathered_state(zero_core, model), "want": _gathered_state(zero_core, ref_model)}


def test_offload_states_moves_states_and_training_continues_identically():
    for r in run_multirank(_offload_rank, WORLD, timeout=240):
        assert_tensors_close(r["got"], r["want"], rtol=0, atol=0)


def _generation_rank() -> dict:
    import zero_core

    model = _leaf_net()
    ref = _leaf_net()
    engine, _, _, _ = zero_core.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=_cfg(3)
    )
    x, _ = _data(0, __import__("zero_core.comm").comm.get_rank())
    with zero_core.unwrap_model_for_generation(engine) as bare:
        assert bare is model
        for _ in range(3):  # decoding-like repeated forwards: parameters stay gathered throughout
            out = bare(x)
            assert all(p.numel() == p.zero_numel for p in model.parameters())
        torch.testing.assert_close(out, ref(x))
    assert all(p.numel() == 0 for p in model.parameters())  # released on exit
    engine.backward(out.new_zeros(()) + nn.functional.mse_loss(engine(x), torch.zeros(2, 2)))
    engine.step()  # training resumes with the hooks active
    with zero_core.unwrap_model_for_generation(engine, gather_params=False) as bare, torch.no_grad():
        bare(x)
        assert model[0].weight.numel() == 0  # gathered per module only: released after its forward
    return {}


def test_unwrap_model_for_generation_gathers_once():
    run_multirank(_generation_rank, WORLD, timeout=180)


def test_on_device_builds_on_meta_in_dtype_and_restores():
    import zero_core as zero  # zero-core's own names: its tests run without the facade

    before = torch.get_default_dtype()
    with zero.OnDevice(dtype=torch.bfloat16, device="meta"):
        big = nn.Linear(4096, 4096)
        idx = torch.arange(3)
    assert big.weight.device.type == "meta" and big.weight.dtype == torch.bfloat16
    assert idx.dtype == torch.int64
    assert torch.get_default_dtype() == before and torch.empty(1).device.type == "cpu"
    with zero.OnDevice(dtype=torch.float16, enabled=False):
        assert nn.Linear(2, 2).weight.device.type == "cpu"
    with pytest.raises(ValueError, match="dtype must be a floating-point"):
        zero.OnDevice(dtype=torch.int32)


def test_mics_init_needs_the_shard_size():
    import zero_core as zero  # zero-core's own names: its tests run without the facade

    # MiCS itself: test_stage3_mics_hpz.py
    with pytest.raises(ValueError, match="must set zero_optimization.mics_shard_size"):
        zero.MiCS_Init()
    with pytest.raises(ValueError, match="must set zero_optimization.mics_shard_size"):
        zero.MiCS_Init(config_dict_or_path={"train_batch_size": 2, "zero_optimization": {"stage": 3}})


def test_set_random_seed_seeds_python_numpy_and_torch():
    import numpy as np
    import zero_core as zero  # zero-core's own names: its tests run without the facade

    zero.utils.set_random_seed(11)
    a = (random.random(), np.random.rand(), torch.rand(2))
    zero.utils.set_random_seed(11)
    b = (random.random(), np.random.rand(), torch.rand(2))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
    with pytest.raises(TypeError, match="seed must be an int"):
        zero.utils.set_random_seed(1.5)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        zero.utils.set_random_seed(-1)
