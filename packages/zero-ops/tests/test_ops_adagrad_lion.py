"""CPUAdagrad against torch.optim.Adagrad; CPULion against a plain-torch Lion reference."""

from __future__ import annotations

import pytest
import torch
from zero_ops.adagrad import CPUAdagrad, CPUAdagradKernel, DeepSpeedCPUAdagrad, cpu_adagrad_step
from zero_ops.adagrad.functional import adagrad_step_torch
from zero_ops.lion import CPULion, CPULionKernel, DeepSpeedCPULion, cpu_lion_step
from zero_ops.lion.functional import lion_step_torch

SIZES = [3, 1001, 65541]


def close(a, b, rtol=1e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * max(b.abs().max().item(), 1e-30))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adagrad_matches_torch_100_steps(weight_decay):
    init = [torch.randn(n) for n in SIZES]
    ours = [torch.nn.Parameter(p.clone()) for p in init]
    ref = [torch.nn.Parameter(p.clone()) for p in init]
    opt = CPUAdagrad(ours, lr=1e-2, eps=1e-10, weight_decay=weight_decay, lr_decay=0.01)
    ref_opt = torch.optim.Adagrad(ref, lr=1e-2, eps=1e-10, weight_decay=weight_decay, lr_decay=0.01)
    for _ in range(100):
        for a, b in zip(ours, ref):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        close(a.detach(), b.detach())
        close(opt.state[a]["sum"], ref_opt.state[b]["sum"])


def test_adagrad_state_dict_from_torch():
    b = torch.nn.Parameter(torch.randn(100))
    ref_opt = torch.optim.Adagrad([b], lr=0.1)
    b.grad = torch.randn(100)
    ref_opt.step()
    a = torch.nn.Parameter(b.detach().clone())
    opt = CPUAdagrad([a])
    opt.load_state_dict(ref_opt.state_dict())
    g = torch.randn(100)
    a.grad, b.grad = g.clone(), g.clone()
    opt.step()
    ref_opt.step()
    close(a.detach(), b.detach())


def _lion_reference(p, g, m, lr, b1, b2, wd):
    p = p * (1 - lr * wd)
    update = torch.sign(m * b1 + g * (1 - b1))
    return p - lr * update, m * b2 + g * (1 - b2)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lion_matches_reference_100_steps(weight_decay):
    init = [torch.randn(n) for n in SIZES]
    ours = [torch.nn.Parameter(p.clone()) for p in init]
    ref = [p.clone() for p in init]
    ref_m = [torch.zeros_like(p) for p in init]
    opt = CPULion(ours, lr=1e-3, betas=(0.9, 0.99), weight_decay=weight_decay)
    for _ in range(100):
        for i, a in enumerate(ours):
            g = torch.randn_like(a)
            a.grad = g
            ref[i], ref_m[i] = _lion_reference(ref[i], g, ref_m[i], 1e-3, 0.9, 0.99, weight_decay)
        opt.step()
    for i, a in enumerate(ours):
        close(a.detach(), ref[i], rtol=1e-5)
        close(opt.state[a]["exp_avg"], ref_m[i], rtol=1e-5)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_native_equals_fallback(grad_dtype):
    n = 30_011
    p, g, s = torch.randn(n), torch.randn(n).to(grad_dtype), torch.rand(n)
    out_n, out_f = torch.empty(n, dtype=torch.float16), torch.empty(n, dtype=torch.float16)
    pn, sn = p.clone(), s.clone()
    cpu_adagrad_step(
        pn, g, sn, step=3, lr=0.1, eps=1e-10, weight_decay=0.01, lr_decay=0.1, low_precision_out=out_n
    )
    pf, sf = p.clone(), s.clone()
    adagrad_step_torch(pf, g, sf, out_f, clr=0.1 / (1 + 2 * 0.1), eps=1e-10, weight_decay=0.01)
    close(pn, pf)
    close(sn, sf)
    assert torch.equal(out_n, pn.half())
    m = torch.randn(n)
    pn, mn, pf, mf = p.clone(), m.clone(), p.clone(), m.clone()
    cpu_lion_step(pn, g, mn, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
    lion_step_torch(pf, g, mf, None, lr=1e-3, beta1=0.9, beta2=0.99, decay=1 - 1e-3 * 0.1)
    close(pn, pf)
    close(mn, mf)


def test_kernels_and_names():
    assert DeepSpeedCPUAdagrad is CPUAdagrad and DeepSpeedCPULion is CPULion
    k = CPUAdagradKernel(tile_numel=7)
    assert k.state_names() == ("sum",)
    p = torch.randn(20)
    states = k.init_states(p)
    ref_p, ref_s = p.clone(), torch.zeros(20)
    g = torch.randn(20)
    k.step(p, g, states, step=1, lr=0.1)
    cpu_adagrad_step(ref_p, g, ref_s, step=1, lr=0.1, eps=1e-10, weight_decay=0.0)
    assert torch.equal(p, ref_p) and torch.equal(states["sum"], ref_s)
    lk = CPULionKernel(betas=(0.5, 0.9))
    assert lk.state_names() == ("exp_avg",)
    st = lk.init_states(p)
    lk.step(p, g, st, step=1, lr=0.1)
    assert torch.equal(st["exp_avg"], g * (1 - 0.9))


def test_validation():
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        CPUAdagrad([torch.nn.Parameter(torch.randn(2))], amsgrad=True)
    with pytest.raises(ValueError, match="betas"):
        CPULion([torch.nn.Parameter(torch.randn(2))], betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="must be on the CPU|must be contiguous|elements"):
        cpu_lion_step(
            torch.randn(4), torch.randn(5), torch.randn(4), lr=1, beta1=0.9, beta2=0.9, weight_decay=0
        )
