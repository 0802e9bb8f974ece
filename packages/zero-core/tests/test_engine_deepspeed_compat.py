"""DeepSpeed engine behaviour scripts rely on (issue 26): ``no_sync()``, what ``backward`` returns,
attribute forwarding to the module, and ``initialize`` without an optimizer.

Training results are compared with single-process PyTorch on the same data (fp32, 1e-5 relative).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from zero_core.protocols.optimizer_offload import NoOptimizerOffload
from zero_core.testing import run_multirank
from zero_core.testing.parity import assert_tensors_close

WORLD, MICRO, DIM = 2, 2, 6


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(DIM, 8)
        self.l2 = nn.Linear(8, 3)
        self.num_local_experts = 4  # an attribute DeepSpeed scripts read through the engine

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.l2(torch.tanh(self.l1(x))), y)

    def describe(self, prefix: str) -> str:
        return f"{prefix}:{self.l1.out_features}"


def _batch(step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of micro-step ``k`` of ``step``: WORLD * MICRO rows (rank r takes its slice)."""
    g = torch.Generator().manual_seed(100 * step + k)
    return torch.randn(WORLD * MICRO, DIM, generator=g), torch.randint(0, 3, (WORLD * MICRO,), generator=g)


def _cfg(stage: int, gas: int = 1, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10**6,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        **extra,
    }


STEPS, LOCAL_MICROS = 2, 3  # per step: 2 micro-batches inside no_sync, then 1 synced


def _no_sync_reference() -> dict[str, torch.Tensor]:
    """DDP's no_sync semantics in one process: the step applies the sum over micro-batches of the
    global-batch gradients (each rank's local sum, averaged over ranks)."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        for k in range(LOCAL_MICROS):
            model(*_batch(step, k)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _no_sync_rank(stage: int) -> dict:
    import zero_core
    from zero_core import comm
    from zero_core.engine.no_sync import NoSyncError

    rank = comm.get_rank()
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, _, _, _ = zero_core.initialize(model=model, optimizer=opt, config=_cfg(stage))
    out: dict = {}
    for step in range(STEPS):
        with engine.no_sync():
            for k in range(LOCAL_MICROS - 1):
                x, y = _batch(step, k)
                engine.backward(
                    engine(x[rank * MICRO : (rank + 1) * MICRO], y[rank * MICRO : (rank + 1) * MICRO])
                )
            if step == 0:
                with pytest.raises(AssertionError, match="illegal to call Engine.step.. inside no_sync"):
                    engine.step()
                with pytest.raises(NoSyncError, match="reentry is unsupported"):
                    with engine.no_sync():
                        pass
        x, y = _batch(step, LOCAL_MICROS - 1)
        engine.backward(engine(x[rank * MICRO : (rank + 1) * MICRO], y[rank * MICRO : (rank + 1) * MICRO]))
        engine.step()
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_accumulates_locally_then_the_synced_backward_averages(stage):
    ref = _no_sync_reference()
    for r in run_multirank(_no_sync_rank, WORLD, args=(stage,), timeout=180):
        assert_tensors_close(r["state"], ref, rtol=1e-5, atol=1e-6, where=f"stage {stage}")


def _api_rank() -> dict:
    import zero_core
    from zero_core.engine.eval_only import NoOptimizerError
    from zero_core.engine.no_sync import NoSyncError

    out: dict = {}
    # no_sync where gradients are partitioned: DeepSpeed's AssertionError and message
    for stage in (2, 3):
        torch.manual_seed(0)
        m = _Net()
        engine, _, _, _ = zero_core.initialize(
            model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), config=_cfg(stage)
        )
        with pytest.raises(AssertionError) as info:
            with engine.no_sync():
                pass
        assert isinstance(info.value, NoSyncError) and isinstance(info.value, RuntimeError)
        assert f"incompatible with gradient partitioning logic of ZeRO stage {stage}" in str(info.value)

    # backward returns loss / gradient_accumulation_steps; the engine's own logging keeps the loss
    torch.manual_seed(0)
    m = _Net()
    engine, _, _, _ = zero_core.initialize(
        model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), config=_cfg(0, gas=2)
    )
    seen = []
    for k in range(2):
        x, y = _batch(0, k)
        loss = engine(x[:MICRO], y[:MICRO])
        ret = engine.backward(loss)
        torch.testing.assert_close(ret, loss / 2, rtol=0, atol=0)
        assert ret.requires_grad  # the scaled loss tensor, as DeepSpeed returns it
        seen.append(loss.item())
        engine.step()
    out["last_loss"], out["seen"] = engine.last_loss, seen
    x, y = _batch(1, 0)
    loss = engine(x[:MICRO], y[:MICRO])
    assert engine.backward(loss, scale_wrt_gas=False) is loss

    # attributes the engine lacks come from the module
    assert engine.describe("n") == "n:8"
    assert engine.num_local_experts == 4
    assert engine.l1 is m.l1  # submodules through the wrapped module
    assert not hasattr(engine, "nothing_here")
    with pytest.raises(AttributeError, match=r"'ZeroEngine' object has no attribute 'nothing_here'.*'_Net'"):
        engine.nothing_here  # noqa: B018
    bare = type(engine).__new__(type(engine))  # as copy/pickle see it: no __init__ yet, no recursion
    with pytest.raises(AttributeError):
        bare.module  # noqa: B018
    with pytest.raises(AttributeError):
        bare.__deepcopy__  # noqa: B018
    assert copy.copy(engine.l1.weight) is not None

    # without an optimizer: an evaluation engine (stage 0 and stage 3 bf16)
    torch.manual_seed(0)
    ref_model = _Net()
    x, y = _batch(2, 0)
    want = ref_model(x, y)
    for stage, extra in ((0, {}), (3, {"bf16": {"enabled": True}})):
        model = copy.deepcopy(ref_model)
        cfg = _cfg(stage, **extra)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter partitioned
        engine, opt, _, sched = zero_core.initialize(model=model, config=cfg)
        assert opt is None and sched is None and engine.optimizer is None
        with torch.no_grad():
            got = engine(x.to(engine.compute_dtype), y)
        tol = 1e-6 if stage == 0 else 3e-2
        torch.testing.assert_close(got.float(), want.detach(), rtol=tol, atol=tol)
        if stage == 3:
            w = model.l1.weight
            assert w.numel() == 0 and w.zero_shard.numel() == 8 * DIM // 2  # partitioned, released
            assert w.zero_shard.dtype == torch.bfloat16
            assert not engine.strategy.master  # no fp32 masters for an evaluation engine
        with pytest.raises(
            NoOptimizerError, match="engine.backward: this engine was built without an optimizer"
        ):
            engine.backward(engine(x.to(engine.compute_dtype), y))
        with pytest.raises(NoOptimizerError, match="engine.step"):
            engine.step()
    # an offload_optimizer section has nothing to hold without an optimizer: forward still works
    cfg = _cfg(3)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, opt, _, _ = zero_core.initialize(model=copy.deepcopy(ref_model), config=cfg)
    assert opt is None and isinstance(engine.strategy.offload, NoOptimizerOffload)
    with torch.no_grad():
        torch.testing.assert_close(engine(x, y), want.detach(), rtol=1e-6, atol=1e-6)
    return out


def test_no_sync_errors_backward_return_attribute_forwarding_and_eval_engine():
    for r in run_multirank(_api_rank, WORLD, timeout=180):
        assert r["last_loss"] == pytest.approx(sum(r["seen"]) / 2, rel=1e-6)


def _backward_return_rank(dtype: str) -> bool:
    import zero_core

    for gas in (1, 2):
        torch.manual_seed(0)
        extra = {} if dtype == "fp32" else {dtype: {"enabled": True}}
        cfg = _cfg(0, gas=gas, optimizer={"type": "SGD", "params": {"lr": 0.1}}, **extra)
        cfg["train_batch_size"] = MICRO * gas
        engine, *_ = zero_core.initialize(model=_Net(), config=cfg)
        x, y = _batch(0, 0)
        loss = engine(x[:MICRO].to(engine.compute_dtype), y[:MICRO])
        assert loss.dtype == engine.compute_dtype
        ret = engine.backward(loss)
        if gas == 1:
            assert ret is loss
        else:
            assert ret.dtype == torch.float32 and ret.requires_grad
            torch.testing.assert_close(ret, loss.float() / gas, rtol=0, atol=0)
        loss = engine(x[MICRO:].to(engine.compute_dtype), y[MICRO:])
        assert engine.backward(loss, scale_wrt_gas=False) is loss
    return True


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_backward_returns_the_fp32_loss_over_gas(dtype):
    # DeepSpeed divides loss.float() by gradient_accumulation_steps and returns that (an fp32
    # tensor in fp16/bf16 runs too); with one step, or scale_wrt_gas=False, the loss itself.
    # (initialize sets up a process group: in a forked rank, never in the test process)
    assert run_multirank(_backward_return_rank, 1, args=(dtype,), timeout=120) == [True]
