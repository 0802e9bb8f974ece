"""zero-ops' torch-op optimizers: FusedAdam (DeepSpeed's, for ``"bias_correction": false``) and
LAMB (DeepSpeed's FusedLamb math), built directly and from zero-core's config builder."""

from __future__ import annotations

import math

import pytest
import torch
from zero_core.optim import build_optimizer
from zero_ops.adam import FusedAdam
from zero_ops.lamb import Lamb


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize(
    "name,params,cls",
    [
        ("Lamb", {"lr": 1e-3, "weight_decay": 0.01}, Lamb),
        # torch's Adam always bias-corrects: DeepSpeed's FusedAdam math (BERT pre-training configs)
        ("Adam", {"lr": 1e-3, "bias_correction": False}, FusedAdam),
        ("AdamW", {"lr": 1e-3, "bias_correction": False}, FusedAdam),
    ],
)
def test_the_config_builder_builds_them(name, params, cls):
    opt = build_optimizer(_params(), name, params)
    assert type(opt) is cls
    assert opt.param_groups[0]["lr"] == params["lr"]


def _reference_lamb(ws, grads_per_step, lr, b1, b2, eps, wd, max_coeff, min_coeff, bias_correction=True):
    """FusedLamb's per-tensor update, written from the formula in float64:

    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  (bias-corrected m/(1-b1^t), v/(1-b2^t))
    u = m_hat / (sqrt(v_hat) + eps) + wd * w
    ratio = clamp(||w|| / ||u||, min_coeff, max_coeff), or 1 if either norm is 0
    w = w - lr * ratio * u
    """
    ws = [w.double().clone() for w in ws]
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            g = g.double()
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            m_hat = ms[i] / (1 - b1**t) if bias_correction else ms[i]
            v_hat = vs[i] / (1 - b2**t) if bias_correction else vs[i]
            u = m_hat / (v_hat.sqrt() + eps) + wd * ws[i]
            wn = math.sqrt(float((ws[i] ** 2).sum()))
            un = math.sqrt(float((u**2).sum()))
            ratio = min(max(wn / un, min_coeff), max_coeff) if wn > 0 and un > 0 else 1.0
            ws[i] = ws[i] - lr * ratio * u
    return ws


@pytest.mark.parametrize(
    "wd,bias_correction,max_coeff,min_coeff", [(0.0, True, 10.0, 0.01), (0.1, False, 0.5, 0.3)]
)
def test_lamb_matches_fused_lamb_formula(wd, bias_correction, max_coeff, min_coeff):
    params = _params()  # a random matrix and a zero bias (trust ratio 1 on the first step)
    init = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(6)]
    opt = build_optimizer(
        params,
        "Lamb",
        {
            "lr": 0.05,
            "betas": [0.9, 0.99],
            "eps": 1e-6,
            "weight_decay": wd,
            "bias_correction": bias_correction,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        },
    )
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr.clone()
        opt.step()
    ref = _reference_lamb(init, grads, 0.05, 0.9, 0.99, 1e-6, wd, max_coeff, min_coeff, bias_correction)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r.float(), rtol=1e-5, atol=1e-6)
    assert all(not torch.equal(p.detach(), w0) for p, w0 in zip(params, init))


def test_lamb_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="lr must be >= 0"):
        Lamb(_params(), lr=-1)
    with pytest.raises(ValueError, match=r"betas must be in \[0, 1\)"):
        Lamb(_params(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="eps must be > 0"):
        Lamb(_params(), eps=0)
    with pytest.raises(ValueError, match="min_coeff 2 > max_coeff 1"):
        Lamb(_params(), min_coeff=2, max_coeff=1)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_matches_torch_adam_with_bias_correction(adam_w_mode):
    ours, ref = _params(), _params()
    opt = FusedAdam(ours, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, adam_w_mode=adam_w_mode)
    torch_opt = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(
        ref, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt.step()
        torch_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert opt.state_dict()["state"][0].keys() == torch_opt.state_dict()["state"][0].keys()


def test_fused_adam_without_bias_correction_formula():
    (p,) = _params()[:1]
    w0 = p.detach().clone()
    opt = build_optimizer(
        [p], "Adam", {"lr": 0.1, "betas": [0.9, 0.99], "eps": 1e-8, "bias_correction": False}
    )
    grads = [torch.full_like(p, 0.5), torch.full_like(p, -1.0)]
    m = v = torch.zeros_like(p)
    w = w0.clone()
    for grad in grads:
        p.grad = grad
        opt.step()
        m = 0.9 * m + 0.1 * grad
        v = 0.99 * v + 0.01 * grad * grad
        w = w - 0.1 * m / (v.sqrt() + 1e-8)  # no 1 - beta**step terms
    torch.testing.assert_close(p.detach(), w)
    assert opt.param_groups[0]["bias_correction"] is False and opt.param_groups[0]["adamw_mode"] is True


def test_fused_adam_rejects_bad_hyperparameters():
    for kwargs, match in [
        ({"amsgrad": True}, "amsgrad=True is not supported"),
        ({"lr": -1.0}, "lr must be a finite number >= 0"),
        ({"betas": (0.9, 1.0)}, r"betas must be two numbers in \[0, 1\)"),
        ({"eps": -1.0}, "eps must be >= 0"),
        ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            FusedAdam(_params(), **kwargs)
