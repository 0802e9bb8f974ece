"""``cpu_adagrad_step``: one Adagrad update of flat CPU buffers, in place (torch.optim.Adagrad's formulas)."""

from __future__ import annotations

import torch

from zero_ops import _flat, _native

_WHERE = "cpu_adagrad_step"


def cpu_adagrad_step(
    params_fp32: torch.Tensor,
    grads: torch.Tensor,
    state_sum: torch.Tensor,
    *,
    step: int,
    lr: float,
    eps: float,
    weight_decay: float,
    lr_decay: float = 0.0,
    low_precision_out: torch.Tensor | None = None,
    threads: int | None = None,
) -> None:
    """Applies one Adagrad update in place: ``sum += g*g; p -= clr * g / (sqrt(sum) + eps)``.

    ``clr = lr / (1 + (step - 1) * lr_decay)``; weight decay is added to the gradient (L2), as in
    torch.optim.Adagrad. Buffers follow the rules of :func:`zero_ops.adam.cpu_adam_step`.
    """
    numel, lp_code = _flat.check_buffers(
        _WHERE, params_fp32, grads, {"state_sum": state_sum}, low_precision_out
    )
    step = _flat.check_step(_WHERE, step)
    lr = _flat.check_scalar(_WHERE, "lr", lr, low=0.0)
    eps = _flat.check_scalar(_WHERE, "eps", eps, low=0.0)
    weight_decay = _flat.check_scalar(_WHERE, "weight_decay", weight_decay, low=0.0)
    lr_decay = _flat.check_scalar(_WHERE, "lr_decay", lr_decay, low=0.0)
    n_threads = _flat.resolve_threads(_WHERE, threads)
    clr = lr / (1 + (step - 1) * lr_decay)
    if numel == 0:
        return
    _native.run(
        _WHERE,
        lambda C: C.adagrad_step(
            params_fp32.data_ptr(),
            grads.data_ptr(),
            _flat.DTYPE_CODES[grads.dtype],
            state_sum.data_ptr(),
            _flat.ptr(low_precision_out),
            lp_code,
            numel,
            clr,
            eps,
            weight_decay,
            n_threads,
        ),
        lambda: adagrad_step_torch(
            params_fp32, grads, state_sum, low_precision_out, clr=clr, eps=eps, weight_decay=weight_decay
        ),
    )


def adagrad_update(u: _flat.FlatUpdate) -> None:
    """:func:`cpu_adagrad_step` for ``u``: hyper-parameters ``eps``, ``weight_decay``,
    ``lr_decay``; state ``sum``. See [Note: one update function]."""
    h = u.hparams
    cpu_adagrad_step(
        u.params,
        u.grads,
        u.states["sum"],
        step=u.step,
        lr=u.lr,
        eps=h["eps"],
        weight_decay=h["weight_decay"],
        lr_decay=h["lr_decay"],
        low_precision_out=u.low_precision_out,
        threads=u.threads,
    )


def adagrad_step_torch(
    param: torch.Tensor,
    grad: torch.Tensor,
    state_sum: torch.Tensor,
    low_precision_out: torch.Tensor | None,
    *,
    clr: float,
    eps: float,
    weight_decay: float,
) -> None:
    """The pure-torch path of cpu_adagrad_step (see [Note: native or fallback])."""
    g = grad.float()
    if weight_decay != 0.0:
        g = g.add(param, alpha=weight_decay)
    state_sum.addcmul_(g, g, value=1)
    std = state_sum.sqrt().add_(eps)
    param.addcdiv_(g, std, value=-clr)
    if low_precision_out is not None:
        low_precision_out.copy_(param)
