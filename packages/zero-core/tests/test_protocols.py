"""The five shared protocols: concrete implementations satisfy them and behave per contract."""

from __future__ import annotations

import pytest
import torch
import zero_core.comm
from zero_core.accelerator import CpuAccelerator, CudaAccelerator
from zero_core.offload_memory import MemoryOffloadBackend
from zero_core.optim_kernels import TorchAdamKernel
from zero_core.protocols import (
    Accelerator,
    CommBackend,
    FlatOptimizerKernel,
    Monitor,
    OffloadBackend,
)


class _ListMonitor:
    def __init__(self) -> None:
        self.enabled = True
        self.events: list[tuple[str, float, int]] = []

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        self.events.extend(events)

    def close(self) -> None:
        self.enabled = False


def test_concrete_implementations_satisfy_protocols():
    assert isinstance(CpuAccelerator(), Accelerator)
    assert isinstance(CudaAccelerator(), Accelerator)
    assert isinstance(zero_core.comm, CommBackend)
    assert isinstance(MemoryOffloadBackend(), OffloadBackend)
    assert isinstance(TorchAdamKernel(), FlatOptimizerKernel)
    assert isinstance(_ListMonitor(), Monitor)


def test_unrelated_objects_do_not_satisfy_protocols():
    for proto in (Accelerator, CommBackend, OffloadBackend, FlatOptimizerKernel, Monitor):
        assert not isinstance(object(), proto)
    assert not isinstance(MemoryOffloadBackend(), Accelerator)
    assert not isinstance(TorchAdamKernel(), OffloadBackend)


def test_monitor_protocol_usage():
    m = _ListMonitor()
    m.write_events([("Train/loss", 0.5, 10), ("Train/lr", 1e-3, 10)])
    assert m.events == [("Train/loss", 0.5, 10), ("Train/lr", 1e-3, 10)]


# -- MemoryOffloadBackend ----------------------------------------------------------------------


def test_memory_offload_round_trip_sync_and_async():
    store = MemoryOffloadBackend()
    src = torch.randn(4, 5)
    original = src.clone()
    store.swap_out("a", src)
    src.add_(1.0)  # the store holds the values at swap-out time
    assert store.contains("a") and not store.contains("b")
    out = torch.empty(4, 5)
    store.swap_in("a", out)
    assert torch.equal(out, original)

    bf = torch.randn(7).to(torch.bfloat16)
    store.swap_out("b", bf, async_op=True)
    store.wait()
    out_bf = torch.empty(7, dtype=torch.bfloat16)
    store.swap_in("b", out_bf, async_op=True)
    store.wait()
    assert torch.equal(out_bf, bf)
    assert store.nbytes() == 4 * 5 * 4 + 7 * 2


def test_memory_offload_overwrite_remove_close():
    store = MemoryOffloadBackend()
    store.swap_out("k", torch.ones(3))
    store.swap_out("k", torch.full((3,), 2.0))
    out = torch.empty(3)
    store.swap_in("k", out)
    assert out.tolist() == [2.0, 2.0, 2.0]
    store.swap_out("k", torch.zeros(2, dtype=torch.int64))  # new shape/dtype replaces the buffer
    out_i = torch.empty(2, dtype=torch.int64)
    store.swap_in("k", out_i)
    assert out_i.tolist() == [0, 0]
    store.remove("k")
    assert not store.contains("k")
    with pytest.raises(KeyError, match="nothing is stored under key 'k'"):
        store.remove("k")
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.swap_out("k", torch.ones(1))


def test_memory_offload_validation():
    store = MemoryOffloadBackend()
    with pytest.raises(ValueError, match="non-empty str"):
        store.swap_out("", torch.ones(1))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        store.swap_out("x", [1.0])
    with pytest.raises(KeyError, match="missing"):
        store.swap_in("missing", torch.empty(1))
    store.swap_out("x", torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"holds \(2, 2\) torch.float32, but out is \(4,\)"):
        store.swap_in("x", torch.empty(4))


# -- TorchAdamKernel ---------------------------------------------------------------------------


def _run_reference(opt_cls, p0, grads, lrs, **kw):
    p = torch.nn.Parameter(p0.clone())
    opt = opt_cls([p], lr=lrs[0], **kw)
    for g, lr in zip(grads, lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt.state[p]


@pytest.mark.parametrize(
    "adamw_mode,opt_cls,wd",
    [(True, torch.optim.AdamW, 0.01), (True, torch.optim.AdamW, 0.0), (False, torch.optim.Adam, 0.1)],
)
def test_torch_adam_kernel_matches_torch_optim(adamw_mode, opt_cls, wd):
    torch.manual_seed(0)
    n = 1000
    p0 = torch.randn(n)
    grads = [torch.randn(n) for _ in range(5)]
    lrs = [1e-3, 2e-3, 5e-4, 1e-3, 3e-3]  # the LR changes per step, like a schedule
    ref_p, ref_state = _run_reference(opt_cls, p0, grads, lrs, betas=(0.8, 0.99), eps=1e-6, weight_decay=wd)

    kernel = TorchAdamKernel(betas=(0.8, 0.99), eps=1e-6, weight_decay=wd, adamw_mode=adamw_mode)
    params = p0.clone()
    states = kernel.init_state(params)
    assert set(states) == set(kernel.state_names()) == {"exp_avg", "exp_avg_sq"}
    for step, (g, lr) in enumerate(zip(grads, lrs), start=1):
        kernel.step(params, g, states, step=step, lr=lr)
    torch.testing.assert_close(params, ref_p, rtol=1e-5, atol=0)
    torch.testing.assert_close(states["exp_avg"], ref_state["exp_avg"], rtol=1e-5, atol=0)
    torch.testing.assert_close(states["exp_avg_sq"], ref_state["exp_avg_sq"], rtol=1e-5, atol=0)


def test_torch_adam_kernel_hparam_override_and_low_precision_out():
    torch.manual_seed(1)
    p0, g = torch.randn(64), torch.randn(64)
    ref_p, _ = _run_reference(
        torch.optim.AdamW, p0, [g], [0.01], betas=(0.5, 0.9), eps=1e-3, weight_decay=0.2
    )
    kernel = TorchAdamKernel()  # defaults differ; the call overrides them
    params = p0.clone()
    states = kernel.init_state(params)
    out16 = torch.empty(8, 8, dtype=torch.bfloat16)
    kernel.step(
        params,
        g,
        states,
        step=1,
        lr=0.01,
        betas=(0.5, 0.9),
        eps=1e-3,
        weight_decay=0.2,
        low_precision_out=out16,
    )
    torch.testing.assert_close(params, ref_p, rtol=1e-5, atol=0)
    assert torch.equal(out16.view(-1), params.to(torch.bfloat16))


def test_torch_adam_kernel_without_bias_correction():
    p, g = torch.tensor([1.0]), torch.tensor([0.5])
    kernel = TorchAdamKernel(betas=(0.9, 0.999), eps=0.0, bias_correction=False)
    states = kernel.init_state(p)
    kernel.step(p, g, states, step=1, lr=0.1)
    # m = 0.05, v = 0.00025 -> update = 0.1 * 0.05 / sqrt(0.00025)
    expected = 1.0 - 0.1 * 0.05 / (0.00025**0.5)
    assert p.item() == pytest.approx(expected, rel=1e-6)


def test_torch_adam_kernel_validation():
    kernel = TorchAdamKernel()
    p = torch.zeros(4)
    states = kernel.init_state(p)
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        kernel.step(p, torch.zeros(4), states, step=0, lr=0.1)
    with pytest.raises(ValueError, match="lr must be a finite number"):
        kernel.step(p, torch.zeros(4), states, step=1, lr=float("nan"))
    with pytest.raises(ValueError, match="unknown hyper-parameter"):
        kernel.step(p, torch.zeros(4), states, step=1, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="grads"):
        kernel.step(p, torch.zeros(5), states, step=1, lr=0.1)
    with pytest.raises(ValueError, match="exactly the keys"):
        kernel.step(p, torch.zeros(4), {"exp_avg": states["exp_avg"]}, step=1, lr=0.1)
    with pytest.raises(TypeError, match="params must be a float32"):
        kernel.step(p.double(), torch.zeros(4), states, step=1, lr=0.1)
    with pytest.raises(TypeError, match="low_precision_out"):
        kernel.step(p, torch.zeros(4), states, step=1, lr=0.1, low_precision_out=torch.zeros(4))
    with pytest.raises(ValueError, match="betas must lie in"):
        TorchAdamKernel(betas=(0.9, 1.0))
