"""``cpu_adam_step``: one Adam/AdamW update of flat CPU buffers, in place.

This is the kernel the ZeRO-Offload engine calls on its fp32 partition; the CPUAdam optimizer and
CPUAdamKernel are built on it. Formulas and their order follow torch.optim.Adam/AdamW
(for-loop implementation), so results match torch to fp32 rounding.
"""

from __future__ import annotations

import torch

from zero_ops import _flat, _native

_WHERE = "cpu_adam_step"


def adam_scalars(
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
) -> dict[str, float]:
    """The per-step scalars, computed in double exactly as torch.optim.Adam(W) computes them."""
    if bias_correction:
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    else:
        bias_correction1 = 1.0
        bias_correction2_sqrt = 1.0
    return {
        "step_size": lr / bias_correction1,
        "bias_correction2_sqrt": bias_correction2_sqrt,
        "decoupled_decay": 1 - lr * weight_decay if (adamw_mode and weight_decay != 0) else 1.0,
        "l2_decay": weight_decay if (not adamw_mode and weight_decay != 0) else 0.0,
    }


def cpu_adam_step(
    params_fp32: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    amsgrad_max: torch.Tensor | None = None,
    low_precision_out: torch.Tensor | None = None,
    threads: int | None = None,
) -> None:
    """Applies one Adam (``adamw_mode=False``) or AdamW update in place.

    Args:
        params_fp32: fp32 master parameters (contiguous, CPU); updated in place.
        grads: gradients, fp32, bf16 or fp16, same number of elements.
        exp_avg, exp_avg_sq: fp32 first and second moments; updated in place.
        step: the step number of this update (1 for the first), used for bias correction.
        amsgrad_max: fp32 running maximum of ``exp_avg_sq`` (AMSGrad) or None.
        low_precision_out: optional bf16/fp16 buffer that receives the updated parameters,
            rounded to nearest-even, written in the same pass over memory.
        threads: kernel threads (default: ``torch.get_num_threads()``).
    """
    numel, lp_code = _flat.check_buffers(
        _WHERE,
        params_fp32,
        grads,
        {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "amsgrad_max": amsgrad_max},
        low_precision_out,
    )
    step = _flat.check_step(_WHERE, step)
    lr = _flat.check_scalar(_WHERE, "lr", lr, low=0.0)
    beta1 = _flat.check_scalar(_WHERE, "beta1", beta1, low=0.0, high=1.0, high_open=True)
    beta2 = _flat.check_scalar(_WHERE, "beta2", beta2, low=0.0, high=1.0, high_open=True)
    eps = _flat.check_scalar(_WHERE, "eps", eps, low=0.0)
    weight_decay = _flat.check_scalar(_WHERE, "weight_decay", weight_decay, low=0.0)
    n_threads = _flat.resolve_threads(_WHERE, threads)
    s = adam_scalars(
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        adamw_mode=bool(adamw_mode),
        bias_correction=bool(bias_correction),
    )
    if numel == 0:
        return
    _adam_kernel(
        (params_fp32, grads, exp_avg, exp_avg_sq, amsgrad_max, low_precision_out),
        lp_code,
        numel,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        scalars=s,
        threads=n_threads,
    )


def _adam_kernel(
    buffers: tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None
    ],
    lp_code: int,
    numel: int,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    scalars: dict[str, float],
    threads: int,
) -> None:
    """The checked update on ``(params, grads, exp_avg, exp_avg_sq, amsgrad_max, low_precision_out)``:
    the compiled kernel, or its pure-torch path (see [Note: native or fallback])."""
    params_fp32, grads, exp_avg, exp_avg_sq, amsgrad_max, low_precision_out = buffers
    s = scalars
    _native.run(
        _WHERE,
        lambda C: C.adam_step(
            params_fp32.data_ptr(),
            grads.data_ptr(),
            _flat.DTYPE_CODES[grads.dtype],
            exp_avg.data_ptr(),
            exp_avg_sq.data_ptr(),
            _flat.ptr(amsgrad_max),
            _flat.ptr(low_precision_out),
            lp_code,
            numel,
            beta1,
            beta2,
            eps,
            s["step_size"],
            s["bias_correction2_sqrt"],
            s["decoupled_decay"],
            s["l2_decay"],
            threads,
        ),
        lambda: adam_step_torch(
            params_fp32,
            grads,
            exp_avg,
            exp_avg_sq,
            amsgrad_max,
            low_precision_out,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            **s,
        ),
    )


def adam_update(u: _flat.FlatUpdate) -> None:
    """:func:`cpu_adam_step` for ``u``: hyper-parameters ``betas``, ``eps``, ``weight_decay``,
    ``adamw_mode``, ``bias_correction``; states ``exp_avg``, ``exp_avg_sq`` and, with AMSGrad,
    ``max_exp_avg_sq``. See [Note: one update function]."""
    h = u.hparams
    beta1, beta2 = h["betas"]
    cpu_adam_step(
        u.params,
        u.grads,
        u.states["exp_avg"],
        u.states["exp_avg_sq"],
        step=u.step,
        lr=u.lr,
        beta1=beta1,
        beta2=beta2,
        eps=h["eps"],
        weight_decay=h["weight_decay"],
        adamw_mode=h["adamw_mode"],
        bias_correction=h["bias_correction"],
        amsgrad_max=u.states.get("max_exp_avg_sq"),
        low_precision_out=u.low_precision_out,
        threads=u.threads,
    )


def adam_step_torch(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    amsgrad_max: torch.Tensor | None,
    low_precision_out: torch.Tensor | None,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    step_size: float,
    bias_correction2_sqrt: float,
    decoupled_decay: float,
    l2_decay: float,
) -> None:
    """The pure-torch path of cpu_adam_step (same formulas; see [Note: native or fallback])."""
    g = grad.float()
    if l2_decay != 0.0:
        g = g.add(param, alpha=l2_decay)
    if decoupled_decay != 1.0:
        param.mul_(decoupled_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    second = exp_avg_sq
    if amsgrad_max is not None:
        torch.maximum(amsgrad_max, exp_avg_sq, out=amsgrad_max)
        second = amsgrad_max
    denom = (second.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if low_precision_out is not None:
        low_precision_out.copy_(param)
