"""1-bit Adam, 0/1 Adam, 1-bit LAMB: construction, config, warm-up parity, the compressed phase
through the engine (bytes on the wire, ranks in step, precisions, accumulation), checkpoints."""

from __future__ import annotations

import pytest
import torch
import zero_core
from zero_core import comm
from zero_core.comm import comms_logger
from zero_core.optim import build_optimizer
from zero_core.testing import multirank, run_multirank
from zero_core.testing.models import TinyLM, token_batch
from zero_ops.adam import FusedAdam
from zero_ops.lamb import Lamb
from zero_ops.onebit import OnebitAdam, OnebitLamb, ZeroOneAdam

ONEBIT = {"OneBitAdam": OnebitAdam, "ZeroOneAdam": ZeroOneAdam, "OneBitLamb": OnebitLamb}


def _params():
    return [torch.nn.Parameter(torch.ones(3))]


# -- construction and config ----------------------------------------------------------
@pytest.mark.parametrize(
    "name, cls",
    [
        ("OneBitAdam", OnebitAdam),
        ("onebitadam", OnebitAdam),
        ("OnebitAdam", OnebitAdam),
        ("ZeroOneAdam", ZeroOneAdam),
        ("zero_one_adam", ZeroOneAdam),
        ("OneBitLamb", OnebitLamb),
        ("onebitlamb", OnebitLamb),
    ],
)
def test_builder_names(name, cls):
    assert type(build_optimizer(_params(), name, {"lr": 0.1, "max_grad_norm": 0.0})) is cls


def test_documented_defaults():
    a = OnebitAdam(_params())
    assert a.freeze_step == 100000 and a.comm_backend_name == "nccl" and not a.cuda_aware
    z = ZeroOneAdam(_params())
    assert (z.var_freeze_step, z.var_update_scaler, z.local_step_scaler, z.local_step_clipper) == (
        100000,
        16,
        32678,
        16,
    )
    b = OnebitLamb(_params())
    assert (b.freeze_step, b.coeff_beta, b.factor_max, b.factor_min, b.factor_threshold) == (
        100000,
        0.9,
        4.0,
        0.5,
        0.1,
    )
    g = b.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["max_coeff"], g["min_coeff"]) == (
        1e-3,
        (0.9, 0.999),
        1e-8,
        10.0,
        0.01,
    )


def test_config_section_builds_them():
    from zero_core.config import load_config

    for spelling in ("OneBitAdam", "onebitadam", "ZeroOneAdam", "OnebitLamb", "ONEBITLAMB"):
        cfg = load_config(
            {"train_batch_size": 2, "optimizer": {"type": spelling, "params": {"freeze_step": 3}}}
        )
        assert cfg.optimizer.type.lower() == spelling.lower()


@pytest.mark.parametrize("cls", [OnebitAdam, ZeroOneAdam, OnebitLamb])
def test_bad_arguments_are_clear_errors(cls):
    with pytest.raises(ValueError, match="comm_backend_name='hccl_x' is not a backend"):
        cls(_params(), comm_backend_name="hccl_x")
    with pytest.raises(ValueError, match="amsgrad"):
        cls(_params(), amsgrad=True)
    with pytest.raises(ValueError, match="gradient_clipping"):
        cls(_params(), max_grad_norm=1.0)
    with pytest.raises(ValueError, match="betas"):
        cls(_params(), betas=(0.9, 1.5))
    with pytest.warns(UserWarning, match="cuda_aware=True has no effect"):
        cls(_params(), cuda_aware=True)
    for backend in ("gloo", "nccl", "mpi"):
        assert cls(_params(), comm_backend_name=backend).comm_backend_name == backend
    with pytest.raises(ValueError, match="optimizer.params.max_grad_norm"):
        build_optimizer(_params(), cls.__name__, {"max_grad_norm": 1.0})


def test_freeze_and_interval_arguments_are_checked():
    with pytest.raises(ValueError, match="freeze_step must be an integer >= 1"):
        OnebitAdam(_params(), freeze_step=0)
    with pytest.raises(ValueError, match="var_update_scaler"):
        ZeroOneAdam(_params(), var_update_scaler=0)
    with pytest.raises(ValueError, match="factor_min"):
        OnebitLamb(_params(), factor_min=5.0, factor_max=4.0)


@multirank(world_sizes=(1,))
def test_zero_stages_are_refused_at_initialize():
    for stage in (1, 2, 3):
        _refused_at(stage)


def _refused_at(stage: int) -> None:
    cfg = {
        "train_batch_size": 2,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
    }
    with pytest.raises(ValueError, match=f"zero_optimization.stage {stage}"):
        zero_core.initialize(model=TinyLM(), config=cfg)
    model = TinyLM()
    bare = {k: v for k, v in cfg.items() if k != "optimizer"}
    with pytest.raises(ValueError, match="plain data parallelism only"):
        zero_core.initialize(model=model, optimizer=ZeroOneAdam(model.parameters()), config=bare)


# -- engine helpers -------------------------------------------------------------------
def _config(opt: str, params: dict, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": extra.pop("gas", 1),
        "optimizer": {"type": opt, "params": {"lr": 3e-3, **params}},
        "steps_per_print": 10**6,
        **extra,
    }


def _engine(opt: str | None, params: dict, seed: int = 0, optimizer=None, **extra):
    torch.manual_seed(seed)
    model = TinyLM(vocab=32, dim=16, hidden=24)
    config = _config(opt or "Adam", params, **extra)
    if optimizer is not None:
        del config["optimizer"]
    engine, *_ = zero_core.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _train(engine, steps: range, world: int, rank: int):
    losses = []
    gas = engine.gradient_accumulation_steps()
    for step in steps:
        for micro in range(gas):
            x, y = token_batch(1000 * step + micro, 4 * world, 8, 32)
            loss = engine(x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _flat(engine) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])


def _same_on_every_rank(t: torch.Tensor) -> None:
    gathered = [torch.empty_like(t) for _ in range(comm.get_world_size())]
    comm.all_gather(gathered, t)
    for other in gathered:
        assert torch.equal(other, t), "the ranks' parameters differ"


# -- warm-up parity -------------------------------------------------------------------
@multirank(world_sizes=(2, 4), timeout=240)
def test_warmup_equals_plain_adam_and_lamb_bit_for_bit(world_size):
    rank = comm.get_rank()
    for onebit, plain in (("OneBitAdam", FusedAdam), ("ZeroOneAdam", FusedAdam), ("OneBitLamb", Lamb)):
        params = (
            {"var_freeze_step": 50, "var_update_scaler": 1000}
            if onebit == "ZeroOneAdam"
            else {"freeze_step": 50}
        )
        a = _engine(onebit, {**params, "weight_decay": 0.01})
        b = _engine(None, {}, optimizer=lambda ps, plain=plain: plain(ps, lr=3e-3, weight_decay=0.01))
        la = _train(a, range(4), world_size, rank)
        lb = _train(b, range(4), world_size, rank)
        assert la == lb, onebit
        assert torch.equal(_flat(a), _flat(b)), onebit


def test_warmup_equals_fused_adam_and_lamb_single_process():
    torch.manual_seed(0)
    w = torch.randn(40)
    grads = [torch.randn(40) for _ in range(5)]
    for make, ref in (
        (
            lambda ps: OnebitAdam(ps, lr=0.01, weight_decay=0.1, freeze_step=10),
            lambda ps: FusedAdam(ps, lr=0.01, weight_decay=0.1),
        ),
        (
            lambda ps: ZeroOneAdam(ps, lr=0.01, weight_decay=0.1, var_freeze_step=10, var_update_scaler=100),
            lambda ps: FusedAdam(ps, lr=0.01, weight_decay=0.1),
        ),
        (
            lambda ps: OnebitLamb(ps, lr=0.01, weight_decay=0.1, freeze_step=10),
            lambda ps: Lamb(ps, lr=0.01, weight_decay=0.1),
        ),
        (
            lambda ps: OnebitAdam(ps, lr=0.01, bias_correction=False, freeze_step=10),
            lambda ps: FusedAdam(ps, lr=0.01, bias_correction=False),
        ),
    ):
        pa, pb = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
        oa, ob = make([pa]), ref([pb])
        for g in grads:
            pa.grad, pb.grad = g.clone(), g.clone()
            oa.step()
            ob.step()
        assert torch.equal(pa, pb), type(oa).__name__


# -- the compressed phase -------------------------------------------------------------
CASES = {
    "OneBitAdam": {"freeze_step": 2},
    "ZeroOneAdam": {
        "var_freeze_step": 4,
        "var_update_scaler": 1,
        "local_step_scaler": 2,
        "local_step_clipper": 4,
    },
    "OneBitLamb": {"freeze_step": 2},
}


@multirank(world_sizes=(2, 4), timeout=300)
def test_compressed_phase_bytes_and_ranks_in_step(world_size):
    rank = comm.get_rank()
    for name, params in CASES.items():
        torch.manual_seed(0)
        model = TinyLM(vocab=64, dim=64, hidden=128)
        engine, *_ = zero_core.initialize(model=model, config=_config(name, params))
        psi = sum(p.numel() for p in model.parameters())
        opt = engine.optimizer
        for step in range(12):
            x, y = token_batch(step, 4 * world_size, 8, 64)
            compressed = opt.communicates_gradients()
            comms_logger.reset()
            comms_logger.enable()
            loss = engine(x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4])
            engine.backward(loss)
            engine.step()
            comms_logger.disable()
            total = sum(s.bytes for s in comms_logger.summary().values())
            if compressed:
                assert comms_logger.bytes_for("all_reduce") == 0, (
                    f"{name} step {step}: gradients were all-reduced"
                )
                assert total * 25 <= 4 * psi, f"{name} step {step}: {total} bytes vs dense {4 * psi}"
            else:
                assert comms_logger.bytes_for("all_reduce") >= 4 * psi  # the dense warm-up / variance step
        if name != "ZeroOneAdam" or opt.phase("steps_since_sync") == 0:
            _same_on_every_rank(_flat(engine))
        assert opt._errors, f"{name}: no error-feedback buffer after the compressed steps"
        for worker, server in opt._errors.values():
            assert worker.abs().sum() > 0 and server.abs().sum() > 0


@multirank(world_sizes=(2,), timeout=300)
def test_error_buffers_are_carried_across_steps(world_size):
    # the same run with the buffers wiped before every exchange ends elsewhere
    rank = comm.get_rank()
    a = _engine("OneBitAdam", {"freeze_step": 2})
    b = _engine("OneBitAdam", {"freeze_step": 2})
    before = []
    for step in range(6):
        _train(a, range(step, step + 1), world_size, rank)
        before.append({k: v.clone() for k, v in a.optimizer.rank_local_state().items()})
        b.optimizer.reset_errors()
        _train(b, range(step, step + 1), world_size, rank)
    assert before[3] and not all(torch.equal(before[3][k], before[4][k]) for k in before[3])
    assert not torch.equal(_flat(a), _flat(b))


@multirank(world_sizes=(2,), timeout=300)
def test_precisions_and_accumulation_train(world_size):
    rank = comm.get_rank()
    for name, params in CASES.items():
        for extra in (
            {"fp16": {"enabled": True, "initial_scale_power": 8}},
            {"bf16": {"enabled": True}},
            {"gas": 2},
        ):
            engine = _engine(name, params, **extra)
            losses = _train(engine, range(10), world_size, rank)
            assert all(torch.isfinite(torch.tensor(losses))), (name, extra)
            assert engine.optimizer.phase("compression_step") == 10 - engine.skipped_steps
            if name != "ZeroOneAdam" or engine.optimizer.phase("steps_since_sync") == 0:
                _same_on_every_rank(_flat(engine))


# -- checkpoints ----------------------------------------------------------------------
@multirank(world_sizes=(2,), timeout=400)
def test_resume_across_the_freeze_is_bit_exact(tmp_path, world_size):
    rank = comm.get_rank()
    for name, params in CASES.items():
        for save_at in (1, 6):  # before the freeze, and in the compressed phase
            full = _engine(name, params)
            _train(full, range(10), world_size, rank)
            first = _engine(name, params)
            _train(first, range(save_at), world_size, rank)
            ckpt = str(tmp_path / f"{name}_{save_at}")
            first.save_checkpoint(ckpt, tag="t")
            resumed = _engine(name, params, seed=123)  # other weights: all must come from the checkpoint
            resumed.load_checkpoint(ckpt, tag="t")
            _train(resumed, range(save_at, 10), world_size, rank)
            assert torch.equal(_flat(resumed), _flat(full)), (name, save_at)


def _save_at_two(path: str) -> None:
    rank = comm.get_rank()
    for name, params in CASES.items():
        engine = _engine(name, params)
        _train(engine, range(7), 2, rank)
        engine.save_checkpoint(f"{path}/{name}", tag="t")


def _resume_at_four(path: str) -> None:
    rank = comm.get_rank()
    for name, params in CASES.items():
        engine = _engine(name, params, seed=5)
        with pytest.warns(
            UserWarning,
            match="error-feedback buffers were reset.*saved with 2 data-parallel ranks, loaded with 4",
        ):
            engine.load_checkpoint(f"{path}/{name}", tag="t")
        assert engine.optimizer.phase("compression_step") == 7
        assert not engine.optimizer._errors
        losses = _train(engine, range(7, 10), 4, rank)
        assert all(torch.isfinite(torch.tensor(losses))), name
        if name != "ZeroOneAdam":  # (0/1 Adam's next exchange is at its next synchronisation)
            assert engine.optimizer._errors, name  # rebuilt for the new world size
        if name != "ZeroOneAdam" or engine.optimizer.phase("steps_since_sync") == 0:
            _same_on_every_rank(_flat(engine))


def test_resume_at_another_world_size(tmp_path):
    run_multirank(_save_at_two, 2, kwargs={"path": str(tmp_path)}, timeout=300)
    run_multirank(_resume_at_four, 4, kwargs={"path": str(tmp_path)}, timeout=300)
