"""FLOP and MAC formulas for the ATen operators a model actually executes.

[Note: FLOP conventions]
The profiler counts at the level of ATen operators (see :mod:`zero_profiler.tracking`), so a
formula here is keyed by the operator overload packet (``aten.mm``), whatever Python spelling
produced it (``nn.Linear``, ``F.linear``, ``@``, ``torch.matmul``, ``einsum`` ...). The
conventions, chosen to agree with ``torch.utils.flop_counter`` on the operators both count and
with DeepSpeed's per-functional estimates elsewhere:

* Matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``) and convolutions: one MAC per
  multiply-add, FLOPs = 2 * MACs. The bias added by ``addmm``/``baddbmm``/``convolution`` is not
  counted (as in ``torch.utils.flop_counter`` and DeepSpeed).
* Attention kernels (``scaled_dot_product_attention`` in every backend): the two matrix products
  ``Q @ K^T`` and ``P @ V`` (MACs = B*H*Lq*Lk*(E + Ev)) plus one FLOP per score element for the
  softmax, i.e. exactly what the same attention written with ``@`` and ``softmax`` counts. Causal
  masking is not subtracted (kernels that skip masked blocks still report the dense count, like
  ``torch.utils.flop_counter``). Backward: the five products of the standard backward
  (recomputed scores, dV, dP, dQ, dK) plus two FLOPs per score element for the softmax backward.
* Pointwise arithmetic and activations: 1 FLOP per output element, MACs 0. ``*_backward``
  pointwise kernels: 2 FLOPs per element (the local derivative and the product with the
  incoming gradient).
* Softmax / log-softmax: 1 FLOP per element (DeepSpeed's estimate); their backward 2.
* Normalisations (layer, group, batch, RMS): 5 FLOPs per element with an affine weight, 4
  without; their backward 2x the forward.
* Reductions (``sum``, ``mean``, ``var`` ...): 1 FLOP per input element.
* Data movement (views, copies, ``embedding`` lookups, indexing, ``cat``) and comparisons: 0.

Every formula returns ``(flops, macs)`` as Python ints.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload, OpOverloadPacket

aten = torch.ops.aten

Formula = Callable[..., tuple[int, int]]

# Overload packet -> formula(args, kwargs, out) -> (flops, macs).
FORMULAS: dict[Any, Formula] = {}


def _register(*packets: OpOverloadPacket) -> Callable[[Formula], Formula]:
    def wrap(fn: Formula) -> Formula:
        for packet in packets:
            FORMULAS[packet] = fn
        return fn

    return wrap


def _numel(x: object) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, (tuple, list)):
        return sum(_numel(t) for t in x)
    return 0


def _first_tensor_out(out: object) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for t in out:
            if isinstance(t, torch.Tensor):
                return t
    return None


# --- matrix products ----------------------------------------------------------------------------


@_register(aten.mm)
def _mm(args, kwargs, out):
    a, b = args[0], args[1]
    macs = a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * macs, macs


@_register(aten.addmm)
def _addmm(args, kwargs, out):
    return _mm(args[1:], kwargs, out)


@_register(aten.bmm)
def _bmm(args, kwargs, out):
    a, b = args[0], args[1]
    macs = a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    return 2 * macs, macs


@_register(aten.baddbmm)
def _baddbmm(args, kwargs, out):
    return _bmm(args[1:], kwargs, out)


@_register(aten.mv)
def _mv(args, kwargs, out):
    macs = args[0].shape[0] * args[0].shape[1]
    return 2 * macs, macs


@_register(aten.dot, aten.vdot)
def _dot(args, kwargs, out):
    macs = args[0].numel()
    return 2 * macs, macs


# --- convolutions -------------------------------------------------------------------------------


def _conv_macs(x_shape, w_shape, out_shape, transposed: bool) -> int:
    # Every output element of a (non-transposed) convolution is a dot product over
    # C_in/groups * prod(kernel) inputs; w_shape[1] is C_in/groups already. A transposed
    # convolution is the adjoint: every *input* element scatters into C_out/groups * prod(kernel)
    # outputs, and its weight is laid out (C_in, C_out/groups, *kernel).
    kernel = math.prod(w_shape[2:])
    if transposed:
        return math.prod(x_shape) * w_shape[1] * kernel
    return math.prod(out_shape) * w_shape[1] * kernel


@_register(aten.convolution, aten._convolution)
def _convolution(args, kwargs, out):
    x, w = args[0], args[1]
    transposed = bool(args[6]) if len(args) > 6 else bool(kwargs.get("transposed", False))
    macs = _conv_macs(x.shape, w.shape, out.shape, transposed)
    return 2 * macs, macs


@_register(aten.convolution_backward)
def _convolution_backward(args, kwargs, out):
    grad_out, x, w = args[0], args[1], args[2]
    transposed = bool(args[7])
    output_mask = args[-1]
    fwd_macs = _conv_macs(x.shape, w.shape, grad_out.shape, transposed)
    # grad_input and grad_weight are each a convolution with the forward's MAC count; the bias
    # gradient is a reduction over grad_out.
    macs = fwd_macs * (int(bool(output_mask[0])) + int(bool(output_mask[1])))
    flops = 2 * macs + (grad_out.numel() if output_mask[2] else 0)
    return flops, macs


# --- attention ----------------------------------------------------------------------------------


def _sdpa_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    batch_heads = math.prod(q.shape[:-2])
    lq, e = q.shape[-2], q.shape[-1]
    lk, ev = k.shape[-2], v.shape[-1]
    macs = batch_heads * lq * lk * (e + ev)
    return 2 * macs + batch_heads * lq * lk, macs


def _sdpa_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    batch_heads = math.prod(q.shape[:-2])
    lq, e = q.shape[-2], q.shape[-1]
    lk, ev = k.shape[-2], v.shape[-1]
    # scores S = Q K^T (recomputed) and dQ = dS K, dK = dS^T Q: e-sized products;
    # dV = P^T dO and dP = dO V^T: ev-sized products.
    macs = batch_heads * lq * lk * (3 * e + 2 * ev)
    return 2 * macs + 2 * batch_heads * lq * lk, macs


# The fused kernels take (query, key, value, ...) in the layout (B, H, L, E).
@_register(
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
)
def _sdpa_fused(args, kwargs, out):
    return _sdpa_fwd(args[0], args[1], args[2])


# The backward kernels take (grad_out, query, key, value, ...).
@_register(
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
)
def _sdpa_fused_backward(args, kwargs, out):
    return _sdpa_bwd(args[1], args[2], args[3])


# --- normalisations -----------------------------------------------------------------------------


def _norm_factor(weight: object) -> int:
    return 5 if isinstance(weight, torch.Tensor) else 4


@_register(aten.native_layer_norm)
def _layer_norm(args, kwargs, out):
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    return args[0].numel() * _norm_factor(weight), 0


@_register(aten.native_group_norm)
def _group_norm(args, kwargs, out):
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    return args[0].numel() * _norm_factor(weight), 0


@_register(aten._fused_rms_norm)
def _rms_norm(args, kwargs, out):
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    return args[0].numel() * _norm_factor(weight), 0


@_register(
    aten.native_batch_norm,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_no_training,
    aten.cudnn_batch_norm,
)
def _batch_norm(args, kwargs, out):
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    return args[0].numel() * _norm_factor(weight), 0


@_register(aten.native_layer_norm_backward)
def _layer_norm_backward(args, kwargs, out):
    weight = args[4] if len(args) > 4 else None
    return 2 * args[0].numel() * _norm_factor(weight), 0


@_register(aten.native_group_norm_backward, aten._fused_rms_norm_backward)
def _other_norm_backward(args, kwargs, out):
    return 2 * args[0].numel() * 5, 0


@_register(aten.native_batch_norm_backward, aten.cudnn_batch_norm_backward)
def _batch_norm_backward(args, kwargs, out):
    weight = args[2] if len(args) > 2 else None
    return 2 * args[0].numel() * _norm_factor(weight), 0


# --- softmax ------------------------------------------------------------------------------------


@_register(aten._softmax, aten._log_softmax, aten._safe_softmax)
def _softmax(args, kwargs, out):
    return args[0].numel(), 0


@_register(aten._softmax_backward_data, aten._log_softmax_backward_data)
def _softmax_backward(args, kwargs, out):
    return 2 * args[0].numel(), 0


# --- pointwise and reductions -------------------------------------------------------------------


def _per_output_element(args, kwargs, out):
    t = _first_tensor_out(out)
    return (t.numel() if t is not None else 0), 0


def _two_per_output_element(args, kwargs, out):
    t = _first_tensor_out(out)
    return (2 * t.numel() if t is not None else 0), 0


def _per_input_element(args, kwargs, out):
    return (args[0].numel() if isinstance(args[0], torch.Tensor) else 0), 0


_POINTWISE = [
    "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "neg", "neg_", "reciprocal",
    "pow", "pow_", "sqrt", "rsqrt", "rsqrt_", "exp", "exp_", "exp2", "expm1", "log", "log_", "log1p",
    "log2", "abs", "sin", "cos", "tanh", "tanh_", "sigmoid", "sigmoid_", "relu", "relu_", "gelu",
    "gelu_", "silu", "silu_", "mish", "elu", "elu_", "leaky_relu", "leaky_relu_", "hardtanh",
    "hardtanh_", "hardswish", "hardsigmoid", "softplus", "erf", "clamp", "clamp_", "clamp_min",
    "clamp_max", "addcmul", "addcmul_", "addcdiv", "addcdiv_", "lerp", "lerp_", "square",
    "prelu", "_prelu_kernel", "threshold", "glu", "logit", "xlogy",
]  # fmt: skip

_POINTWISE_BACKWARD = [
    "threshold_backward", "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward",
    "elu_backward", "leaky_relu_backward", "hardtanh_backward", "hardswish_backward",
    "hardsigmoid_backward", "softplus_backward", "mish_backward", "glu_backward",
    "_prelu_kernel_backward",
]  # fmt: skip

_REDUCTIONS = [
    "sum", "mean", "var", "std", "var_mean", "std_mean", "norm", "linalg_vector_norm", "amax",
    "amin", "max", "min", "prod", "logsumexp", "cumsum",
]  # fmt: skip

for _name in _POINTWISE:
    if hasattr(aten, _name):
        FORMULAS[getattr(aten, _name)] = _per_output_element
for _name in _POINTWISE_BACKWARD:
    if hasattr(aten, _name):
        FORMULAS[getattr(aten, _name)] = _two_per_output_element
for _name in _REDUCTIONS:
    if hasattr(aten, _name):
        FORMULAS[getattr(aten, _name)] = _per_input_element


def op_cost(func: OpOverload, args: tuple, kwargs: dict, out: object) -> tuple[int, int]:
    """The ``(flops, macs)`` of one executed ATen overload ``func`` (0, 0 when not counted)."""
    formula = FORMULAS.get(func.overloadpacket)
    if formula is None:
        return 0, 0
    return formula(args, kwargs, out)
