"""``cpu_lion_step``: one Lion update of flat CPU buffers, in place.

Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"):
``p = p * (1 - lr*wd) - lr * sign(beta1*m + (1-beta1)*g)``, then ``m = beta2*m + (1-beta2)*g``.
"""

from __future__ import annotations

import torch

from zero_ops import _flat, _native

_WHERE = "cpu_lion_step"


def cpu_lion_step(
    params_fp32: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    low_precision_out: torch.Tensor | None = None,
    threads: int | None = None,
) -> None:
    """Applies one Lion update in place (buffers follow :func:`zero_ops.adam.cpu_adam_step`)."""
    numel, lp_code = _flat.check_buffers(_WHERE, params_fp32, grads, {"exp_avg": exp_avg}, low_precision_out)
    lr = _flat.check_scalar(_WHERE, "lr", lr, low=0.0)
    beta1 = _flat.check_scalar(_WHERE, "beta1", beta1, low=0.0, high=1.0)
    beta2 = _flat.check_scalar(_WHERE, "beta2", beta2, low=0.0, high=1.0)
    weight_decay = _flat.check_scalar(_WHERE, "weight_decay", weight_decay, low=0.0)
    n_threads = _flat.resolve_threads(_WHERE, threads)
    decay = 1 - lr * weight_decay if weight_decay != 0 else 1.0
    if numel == 0:
        return
    _native.run(
        _WHERE,
        lambda C: C.lion_step(
            params_fp32.data_ptr(),
            grads.data_ptr(),
            _flat.DTYPE_CODES[grads.dtype],
            exp_avg.data_ptr(),
            _flat.ptr(low_precision_out),
            lp_code,
            numel,
            lr,
            beta1,
            beta2,
            decay,
            n_threads,
        ),
        lambda: lion_step_torch(
            params_fp32, grads, exp_avg, low_precision_out, lr=lr, beta1=beta1, beta2=beta2, decay=decay
        ),
    )


def lion_update(u: _flat.FlatUpdate) -> None:
    """:func:`cpu_lion_step` for ``u``: hyper-parameters ``betas``, ``weight_decay``; state
    ``exp_avg``; ``u.step`` is not used (Lion has no bias correction). See
    [Note: one update function]."""
    beta1, beta2 = u.hparams["betas"]
    cpu_lion_step(
        u.params,
        u.grads,
        u.states["exp_avg"],
        lr=u.lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=u.hparams["weight_decay"],
        low_precision_out=u.low_precision_out,
        threads=u.threads,
    )


def lion_step_torch(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    low_precision_out: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    decay: float,
) -> None:
    """The pure-torch path of cpu_lion_step (see [Note: native or fallback])."""
    g = grad.float()
    if decay != 1.0:
        param.mul_(decay)
    c = exp_avg * beta1 + g * (1 - beta1)
    param.add_(torch.sign(c), alpha=-lr)
    exp_avg.mul_(beta2).add_(g * (1 - beta2))
    if low_precision_out is not None:
        low_precision_out.copy_(param)
