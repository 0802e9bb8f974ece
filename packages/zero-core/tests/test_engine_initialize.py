"""``zero_core.initialize``: every argument of its signature, its errors, and the engine's API."""

from __future__ import annotations

import argparse
import functools
import json

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank
from zero_core.testing.models import TinyLM, token_batch

VOCAB = 16
MICRO = 2


# emb -> l1 -> tanh -> head
_model = functools.partial(TinyLM, VOCAB, 8, 12, mlp="one_layer", norm=False)


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(77 + step, n, 5, VOCAB)


def _cfg(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, **extra}


# -- errors that need no process group ----------------------------------------------------
def test_argument_errors_before_distributed_init():
    import zero_core

    with pytest.raises(ValueError, match="initialize: model is required"):
        zero_core.initialize(config=_cfg())
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        zero_core.initialize(model={"w": 1}, config=_cfg())
    with pytest.raises(ValueError, match="config= or config_params=, not both"):
        zero_core.initialize(model=_model(), config=_cfg(), config_params=_cfg())


def _errors_in_process(tmp: str) -> list[str]:
    import zero_core
    from zero_core.config import ConfigError

    seen = []
    # without an optimizer the engine is for evaluation (test_engine_deepspeed_compat.py): a
    # scheduler has nothing to drive
    with pytest.raises(ValueError, match="an LR scheduler .* needs an optimizer"):
        zero_core.initialize(model=_model(), config=_cfg(scheduler={"type": "WarmupLR", "params": {}}))
    seen.append("no optimizer")
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer or a callable, got int"):
        zero_core.initialize(model=_model(), optimizer=3, config=_cfg())
    seen.append("bad optimizer")
    with pytest.raises(TypeError, match="the optimizer callable returned str"):
        zero_core.initialize(model=_model(), optimizer=lambda ps: "adam", config=_cfg())
    seen.append("bad callable")
    with pytest.raises(ConfigError, match="no config given"):
        zero_core.initialize(model=_model(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    seen.append("no config")
    with pytest.raises(ConfigError, match='optimizer.type: "Nope": unknown optimizer'):
        zero_core.initialize(model=_model(), config=_cfg(optimizer={"type": "Nope", "params": {}}))
    seen.append("bad type")
    return seen


def test_errors_after_distributed_init(tmp_path):
    (seen,) = run_multirank(_errors_in_process, 1, args=(str(tmp_path),))
    assert len(seen) == 5


# -- the config's sources ------------------------------------------------------------------
def _config_sources(path: str) -> dict[str, int]:
    import zero_core

    opt = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    out = {}
    out["dict"] = zero_core.initialize(
        model=_model(), optimizer=opt, config=_cfg(train_micro_batch_size_per_gpu=3)
    )
    out["path"] = zero_core.initialize(model=_model(), optimizer=opt, config=path)
    out["config_params"] = zero_core.initialize(model=_model(), optimizer=opt, config_params=path)
    out["args.zero_config"] = zero_core.initialize(
        args=argparse.Namespace(zero_config=path), model=_model(), optimizer=opt
    )
    out["args.deepspeed_config"] = zero_core.initialize(
        args=argparse.Namespace(deepspeed_config=path), model=_model(), optimizer=opt
    )
    micro = {k: v[0].train_micro_batch_size_per_gpu() for k, v in out.items()}
    # stage 0's bucket size: 25 MiB of fp32 unless reduce_bucket_size is given (see [Note: gradient buckets])
    buckets = {}
    for name, zc in (
        ("default", {"stage": 0}),
        ("explicit", {"stage": 0, "reduce_bucket_size": 500_000_000}),
    ):
        big = nn.Sequential(nn.Linear(2600, 2600), nn.Linear(2600, 2600))  # 6.76M elements each
        engine = zero_core.initialize(model=big, optimizer=opt, config=_cfg(zero_optimization=zc))[0]
        buckets[name] = len(engine.strategy.reducers[0].buckets)
    return {**micro, "buckets": buckets}


def test_config_from_dict_path_args_and_config_params(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(_cfg(train_micro_batch_size_per_gpu=5)))
    (micro,) = run_multirank(_config_sources, 1, args=(str(path),))
    # default: each 6.76M weight exceeds 25 MiB of fp32, so bias, weight, bias, weight get a bucket each
    assert micro.pop("buckets") == {"default": 4, "explicit": 1}
    assert micro == {
        "dict": 3,
        "path": 5,
        "config_params": 5,
        "args.zero_config": 5,
        "args.deepspeed_config": 5,
    }


# -- optimizers: client object, callable, config section ---------------------------------
def _optimizer_sources() -> dict[str, str]:
    import zero_core

    out = {}
    model = _model()
    client = torch.optim.Adagrad(model.parameters(), lr=0.1)
    engine, opt, _, _ = zero_core.initialize(model=model, optimizer=client, config=_cfg())
    assert opt is client and engine.optimizer is client
    out["client"] = type(opt).__name__

    model = _model()
    engine, opt, _, _ = zero_core.initialize(
        model=model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.25), config=_cfg()
    )
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in model.parameters()}
    out["callable"] = f"{type(opt).__name__}@{opt.param_groups[0]['lr']}"

    for name in ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop"):  # Lamb: zero-ops' test_fused_adam_lamb.py
        model = _model()
        _, opt, _, _ = zero_core.initialize(
            model=model, config=_cfg(optimizer={"type": name, "params": {"lr": 0.01}})
        )
        out[name] = type(opt).__name__
        # the engine trains with it: parameters move
        before = [p.detach().clone() for p in model.parameters()]
        x, y = _batch(0, MICRO)
        loss = model(x, y)
        loss.backward()
        opt.step()
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))

    # model_parameters restricts what the config-built optimizer sees
    model = _model()
    _, opt, _, _ = zero_core.initialize(
        model=model,
        model_parameters=model.head.parameters(),
        config=_cfg(optimizer={"type": "SGD", "params": {"lr": 0.01}}),
    )
    out["model_parameters"] = str(len(opt.param_groups[0]["params"]))
    return out


def test_optimizer_client_callable_and_config():
    (out,) = run_multirank(_optimizer_sources, 1)
    assert out == {
        "client": "Adagrad",
        "callable": "SGD@0.25",
        "Adam": "AdamW",
        "AdamW": "AdamW",
        "SGD": "SGD",
        "Adagrad": "Adagrad",
        "RMSprop": "RMSprop",
        "model_parameters": "2",
    }


# -- LR schedulers: client object, callable, config section; step(lr_kwargs) ------------
class RecordingScheduler:
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.calls: list[dict] = []

    def step(self, **kwargs) -> None:
        self.calls.append(kwargs)
        for g in self.optimizer.param_groups:
            g["lr"] = kwargs.get("lr", g["lr"])


def _train(engine, steps: int) -> None:
    for s in range(steps):
        x, y = _batch(s, MICRO)
        engine.backward(engine(x, y))
        engine.step()


def _scheduler_sources() -> dict[str, object]:
    import zero_core
    from zero_core.lr_schedules import WarmupLR

    out: dict[str, object] = {}
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    client = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    engine, _, _, sched = zero_core.initialize(model=model, optimizer=opt, lr_scheduler=client, config=_cfg())
    assert sched is client
    _train(engine, 5)
    out["object"] = engine.get_lr()  # 1.0 * 0.5 ** (5 // 2)

    model = _model()
    engine, _, _, sched = zero_core.initialize(
        model=model,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)),
        config=_cfg(),
    )
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR) and sched.optimizer is engine.optimizer
    _train(engine, 3)
    out["callable"] = engine.get_lr()  # 1 / 4

    params = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"}
    model = _model()
    engine, _, _, sched = zero_core.initialize(
        model=model,
        config=_cfg(
            optimizer={"type": "SGD", "params": {"lr": 0.5}}, scheduler={"type": "WarmupLR", "params": params}
        ),
    )
    assert isinstance(sched, WarmupLR)
    twin = WarmupLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5), **params)
    lrs, twin_lrs = [], []
    for _ in range(4):
        lrs.append(engine.get_lr()[0])
        twin_lrs.append(twin.get_lr()[0])
        _train(engine, 1)
        twin.step()
    out["config"] = (lrs, twin_lrs)

    model = _model()
    engine, _, _, sched = zero_core.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        lr_scheduler=RecordingScheduler,
        config=_cfg(gradient_accumulation_steps=2),
    )
    x, y = _batch(0, MICRO)
    engine.backward(engine(x, y))
    engine.step(lr_kwargs={"lr": 0.125})  # not a boundary: the scheduler is not stepped
    engine.backward(engine(x, y))
    engine.step(lr_kwargs={"lr": 0.125})
    out["lr_kwargs"] = (sched.calls, engine.get_lr())
    return out


def test_lr_scheduler_object_callable_config_and_lr_kwargs():
    (out,) = run_multirank(_scheduler_sources, 1)
    assert out["object"] == [0.25]
    assert out["callable"] == [pytest.approx(0.25)]
    lrs, twin_lrs = out["config"]
    assert lrs == pytest.approx(twin_lrs), (lrs, twin_lrs)
    assert lrs[1] < lrs[2] < lrs[3] <= 0.1, lrs
    assert out["lr_kwargs"] == ([{"lr": 0.125}], [0.125])


# -- the engine's API against single-process PyTorch ---------------------------------------
STEPS, GAS, CLIP, WORLD = 4, 2, 0.3, 2


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    norms = []
    for s in range(STEPS):
        x, y = _batch(s, WORLD * GAS * MICRO)
        model(x, y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return norms, {k: v.clone() for k, v in model.state_dict().items()}


def _engine_api() -> dict:
    import zero_core
    from zero_core import comm

    rank = comm.get_rank()
    torch.manual_seed(0)
    model = _model()
    engine, _, _, _ = zero_core.initialize(
        model=model,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=0.05),
        config=_cfg(gradient_accumulation_steps=GAS, gradient_clipping=CLIP),
    )
    assert engine.module is model
    assert norm_before_any_step(engine) is None
    out: dict = {"boundaries": [], "steps": [], "samples": [], "norms": []}
    for s in range(STEPS):
        x, y = _batch(s, WORLD * GAS * MICRO)
        for m in range(GAS):
            lo = (m * WORLD + rank) * MICRO
            xb, yb = x[lo : lo + MICRO], y[lo : lo + MICRO]
            loss = engine(xb, yb)
            assert torch.equal(loss, model(xb, yb))  # engine(*args) is the module's forward
            out["boundaries"].append(engine.is_gradient_accumulation_boundary())
            engine.backward(loss)
            engine.step()
            out["steps"].append(engine.global_steps)
            out["samples"].append(engine.global_samples)
        out["norms"].append(engine.get_global_grad_norm())
    out["sizes"] = (
        engine.train_batch_size(),
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
    )
    engine.eval()
    out["eval"] = (engine.training, model.training)
    engine.train()
    out["train"] = (engine.training, model.training)
    # zero_grad drops accumulated (not yet reduced) gradients
    x, y = _batch(0, MICRO)
    engine.backward(engine(x, y))
    had_grads = all(p.grad is not None for p in model.parameters())
    engine.zero_grad()
    out["zero_grad"] = (had_grads, all(p.grad is None for p in model.parameters()))
    out["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def norm_before_any_step(engine) -> float | None:
    return engine.get_global_grad_norm()


def test_engine_api_matches_single_process():
    ref_norms, ref_state = _reference()
    for out in run_multirank(_engine_api, WORLD):
        assert out["boundaries"] == [False, True] * STEPS
        assert out["steps"] == [0, 1, 1, 2, 2, 3, 3, 4]
        assert out["samples"] == [MICRO * WORLD * (i + 1) for i in range(STEPS * GAS)]
        assert out["sizes"] == (MICRO * GAS * WORLD, MICRO, GAS)
        assert out["eval"] == (False, False) and out["train"] == (True, True)
        assert out["zero_grad"] == (True, True)
        # the norm before clipping, as torch's clip_grad_norm_ returns it
        assert out["norms"] == pytest.approx(ref_norms, rel=1e-5)
        assert max(ref_norms) > CLIP  # clipping was active
        for k, v in ref_state.items():
            torch.testing.assert_close(out["state"][k], v, rtol=1e-5, atol=1e-6)
