"""Function-level FLOP rules: what the fast path counts without looking at ATen operators.

See [Note: function-level fast path] in :mod:`zero_profiler.function_mode`. Each rule states,
for one torch function (``F.linear``, ``Tensor.add``, ``F.layer_norm`` ...), the ATen operators
that function executes and their cost under [Note: FLOP conventions], so that counting the
function equals counting its operators. A rule may only be listed when that is true for every
call it accepts; any call it declines (an unusual layout, a decomposition that depends on
strides or on a backend choice we do not mirror) goes to the ATen-level counter instead, which
is always exact. ``tests/test_profiler_fast_path.py`` runs every rule on the fast path and at
ATen level and compares the counts operator by operator.

Table values:

* :data:`PASS`: the function never runs a counted operator (views, metadata, copies, factories,
  comparisons): it runs with no bookkeeping at all.
* :class:`Pointwise`: one pointwise operator, 1 FLOP per output element.
* :class:`Rule`: ``count(args, kwargs)`` decides before the call: ``None`` (not mirrored: count
  at ATen level), ``(flops, macs, aten overload packet)``, or a function of the call's output
  returning that triple (when the count needs the output's shape).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch._ops import OpOverloadPacket

# The arithmetic is the ATen-level counter's: the rules here only decide which ATen operator a call
# becomes (see [Note: FLOP conventions]).
from zero_profiler.flop_formulas import _bmm as aten_bmm_cost
from zero_profiler.flop_formulas import _conv_macs, _norm_factor, _sdpa_fwd
from zero_profiler.flop_formulas import _mm as aten_mm_cost

aten = torch.ops.aten
Tensor = torch.Tensor
_strided = torch.strided
_ADDMM, _FLASH_CPU = aten.addmm, aten._scaled_dot_product_flash_attention_for_cpu
_NATIVE_LAYER_NORM = aten.native_layer_norm


Cost = tuple[int, int, Any]  # (flops, macs, ATen overload packet)


class Pointwise(NamedTuple):
    """A function that runs exactly one pointwise operator, ``packet``: 1 FLOP per output element."""

    packet: OpOverloadPacket


class Rule(NamedTuple):
    """A function counted by ``count(args, kwargs)``; see the module docstring."""

    count: Callable[[tuple, dict], Cost | Callable[[Any], Cost] | None]


PASS = object()  # marker: never runs a counted operator

# function object (as __torch_function__ receives it) -> PASS, Pointwise or Rule
FUNCTION_RULES: dict[Any, Any] = {}


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _dense(t: Tensor) -> bool:
    """A strided tensor (no sparse, mkldnn or nested layout): the decompositions we mirror assume it.

    A non-tensor raises AttributeError, which the mode takes as "count at ATen level".
    """
    return t.layout is _strided and not t.is_nested


def _resolve(names: list[str], holders: tuple = (torch, Tensor)) -> list[Any]:
    """The function objects behind ``names`` on each holder (missing ones skipped)."""
    found = []
    for holder in holders:
        for name in names:
            fn = getattr(holder, name, None)
            if fn is not None:
                found.append(fn)
    return found


def _add(fns: list[Any], value: object) -> None:
    for fn in fns:
        FUNCTION_RULES[fn] = value


# --- no counted operator ------------------------------------------------------------------------

_TENSOR_PASS = [
    "view", "view_as", "reshape", "reshape_as", "transpose", "transpose_", "permute", "t", "split",
    "split_with_sizes", "chunk", "unbind", "contiguous", "unsqueeze", "unsqueeze_", "squeeze",
    "squeeze_", "flatten", "unflatten", "expand", "expand_as", "narrow", "select", "size", "dim",
    "numel", "stride", "storage_offset", "is_contiguous", "__getitem__", "__setitem__", "__len__",
    "detach", "detach_", "clone", "to", "type_as", "float", "half", "bfloat16", "double", "long", "int",
    "bool", "cpu", "masked_fill", "masked_fill_", "fill_", "zero_", "copy_", "repeat", "flip", "movedim",
    "new_zeros", "new_ones", "new_empty", "new_full", "requires_grad_", "item", "tolist", "eq", "ne",
    "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "logical_not", "logical_and", "logical_or", "index_select", "gather", "tril", "triu", "roll",
]  # fmt: skip
_TORCH_PASS = [
    "cat", "concat", "stack", "arange", "zeros", "ones", "empty", "full", "zeros_like", "ones_like",
    "empty_like", "full_like", "tensor", "as_tensor", "where", "split", "chunk", "unbind", "transpose",
    "reshape", "flatten", "unsqueeze", "squeeze", "permute", "narrow", "index_select", "gather", "tril",
    "triu", "randn", "rand", "randint", "eq", "ne", "lt", "le", "gt", "ge", "logical_not",
]  # fmt: skip
_add(_resolve(_TENSOR_PASS, (Tensor,)) + _resolve(_TORCH_PASS, (torch,)), PASS)
# Property getters arrive as the getter's ``__get__`` (equal, though not identical, each time).
for _name in ("shape", "dtype", "device", "ndim", "T", "mT", "is_cuda", "requires_grad", "layout"):
    _prop = getattr(torch._C.TensorBase, _name, None)
    if hasattr(_prop, "__get__"):
        FUNCTION_RULES[_prop.__get__] = PASS
# embedding (and its max_norm renormalisation) and padding move data only; ``no_grad`` and
# ``enable_grad`` switch grad mode through ``torch._C._set_grad_enabled``.
_add([F.embedding, F.pad, torch._C._set_grad_enabled], PASS)


# --- pointwise: one operator, 1 FLOP per output element ---------------------------------------

# Names whose torch.* function and Tensor method each run the ATen operator of the same name.
_POINTWISE = [
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "neg", "neg_", "pow", "pow_", "sqrt",
    "rsqrt", "exp", "log", "abs", "sin", "cos", "tanh", "tanh_", "sigmoid", "sigmoid_", "relu",
    "relu_", "erf", "clamp", "clamp_", "reciprocal",
]  # fmt: skip
for _name in _POINTWISE:
    _packet = getattr(aten, _name, None)
    if _packet is not None:
        _add(_resolve([_name]), Pointwise(_packet))
FUNCTION_RULES[Tensor.__rsub__] = Pointwise(aten.rsub)
_add([F.gelu], Pointwise(aten.gelu))
_add([F.tanh], Pointwise(aten.tanh))
_add([F.sigmoid], Pointwise(aten.sigmoid))


def _inplace_activation(packet: OpOverloadPacket, packet_: OpOverloadPacket) -> Rule:
    """``F.relu``/``F.silu``: the in-place operator when ``inplace=True``."""

    def count(args, kwargs):
        chosen = packet_ if _arg(args, kwargs, 1, "inplace", False) else packet
        return lambda out: (out.numel(), 0, chosen)

    return Rule(count)


_add([F.relu], _inplace_activation(aten.relu, aten.relu_))
_add([F.silu], _inplace_activation(aten.silu, aten.silu_))


# --- reductions: 1 FLOP per input element -------------------------------------------------------


def _per_input_element(packet: OpOverloadPacket) -> Rule:
    def count(args, kwargs):
        return _arg(args, kwargs, 0, "input").numel(), 0, packet

    return Rule(count)


for _name in ("sum", "mean", "var"):
    _add(_resolve([_name]), _per_input_element(getattr(aten, _name)))

# --- softmax and normalisations ----------------------------------------------------------------

_add([F.softmax, *_resolve(["softmax"])], _per_input_element(aten._softmax))
_add([F.log_softmax, *_resolve(["log_softmax"])], _per_input_element(aten._log_softmax))


def _norm(packet: OpOverloadPacket, weight_index: int, on_cpu_only: bool = False) -> Rule:
    """5 FLOPs per element with an affine weight, 4 without (see [Note: FLOP conventions])."""

    def count(args, kwargs):
        x = _arg(args, kwargs, 0, "input")
        if not _dense(x) or (on_cpu_only and not x.is_cpu):
            return None
        return x.numel() * _norm_factor(_arg(args, kwargs, weight_index, "weight")), 0, packet

    return Rule(count)


_add([F.layer_norm, torch.layer_norm], _norm(aten.native_layer_norm, 2))


def layer_norm_cost(x: Tensor, weight: Tensor | None) -> Cost | None:
    """``F.layer_norm(x, shape, weight, ...)``'s cost (None when not mirrored)."""
    if not _dense(x):
        return None
    return x.numel() * _norm_factor(weight), 0, _NATIVE_LAYER_NORM


_add([F.group_norm, torch.group_norm], _norm(aten.native_group_norm, 2))
# Other devices may pick cudnn/miopen kernels: counted at ATen level there.
_add([F.batch_norm], _norm(aten.native_batch_norm, 3, on_cpu_only=True))

NO_FLOPS: Cost = (0, 0, None)


def dropout_cost(args, kwargs):
    # Not training (or p == 0) returns the input; training draws a mask and multiplies (counted
    # operators): left to the ATen-level counter.
    training = _arg(args, kwargs, 2, "training", True)
    return NO_FLOPS if not training or _arg(args, kwargs, 1, "p", 0.5) == 0 else None


_add([F.dropout], Rule(dropout_cost))


# --- matrix products ----------------------------------------------------------------------------


def _mm(args, kwargs):
    if not (_dense(args[0]) and _dense(args[1])):
        return None
    return (*aten_mm_cost(args, kwargs, None), aten.mm)


def _bmm(args, kwargs):
    if not (_dense(args[0]) and _dense(args[1])):
        return None
    return (*aten_bmm_cost(args, kwargs, None), aten.bmm)


def _shifted(count: Callable, packet: OpOverloadPacket) -> Rule:
    """``addmm``/``baddbmm``: the product of args 1 and 2; the added input is not counted."""

    def shifted(args, kwargs):
        cost = count(args[1:], kwargs)
        return None if cost is None else (cost[0], cost[1], packet)

    return Rule(shifted)


_add(_resolve(["mm"]), Rule(_mm))
_add(_resolve(["bmm"]), Rule(_bmm))
_add(_resolve(["addmm"]), _shifted(_mm, aten.addmm))
_add(_resolve(["baddbmm"]), _shifted(_bmm, aten.baddbmm))


def _folds(x: Tensor) -> bool:
    """``matmul``'s test for folding an N-d operand into a matrix without a copy.

    Its batch dimensions must be laid out like a contiguous block (strides of size-1
    dimensions included, unlike ``is_contiguous``), or the operand empty.
    """
    if x.numel() == 0:
        return True
    shape, stride = x.shape, x.stride()
    return all(stride[i] == stride[i + 1] * shape[i + 1] for i in range(x.dim() - 2))


def _matmul_packet(da: int, db: int, a: Tensor, b_requires_grad: bool) -> OpOverloadPacket | None:
    """The ATen product ``torch.matmul(a, b)`` runs (``a``, ``b`` of ``da``, ``db`` dims), or None
    when we do not mirror the choice.

    ``b_requires_grad``: whether ``b`` requires grad as matmul sees it (a larger ``a`` is then
    folded whatever its strides, so that the backward stays a matrix product).
    """
    if da == 1 and db == 1:
        return aten.dot
    if da == 2 and db == 1:
        return aten.mv
    if da <= 2 and db == 2:
        return aten.mm
    if da >= 3 and db >= 3:
        return aten.bmm
    if da >= 3 and (b_requires_grad or _folds(a)):
        return aten.mm if db == 2 else aten.mv
    return None  # a 1-d/2-d left operand against a batch, or a copy: not mirrored


def _matmul(args, kwargs):
    a, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other")
    da, db = a.dim(), b.dim()
    if "out" in kwargs or da == 0 or db == 0 or not (_dense(a) and _dense(b)):
        return None
    packet = _matmul_packet(da, db, a, b.requires_grad)
    if packet is None:
        return None
    k = a.shape[-1]

    def cost(out: Tensor) -> Cost:
        macs = out.numel() * k  # every output element is a dot product of length k
        return 2 * macs, macs, packet

    return cost


_add(_resolve(["matmul"]) + [Tensor.__matmul__], Rule(_matmul))


def linear_cost(args, kwargs):
    # The hottest rule (every nn.Linear): written for few attribute reads.
    if len(args) == 3 and not kwargs:  # nn.Linear's spelling
        x, w, bias = args
    else:
        x, w = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
        bias = _arg(args, kwargs, 2, "bias")
    ws = w.shape
    # mkldnn, sparse or nested operands take other kernels
    if len(ws) != 2 or x.layout is not _strided or w.layout is not _strided or x.is_nested:
        return None
    dx = x.dim()
    if bias is not None:
        # linear's fused path (x flattened to a matrix, one addmm); otherwise matmul and a
        # separate bias add, left to the ATen-level counter. The bias's layout plays no part.
        if not (dx == 2 or (x.is_contiguous() and (dx == 3 or bias.dim() == 1))):
            return None
        packet = _ADDMM
    else:
        if dx == 0:
            return None
        # matmul(x, w.t()); w.t() is made inside linear, so it requires grad only in grad mode.
        packet = _matmul_packet(dx, 2, x, w.requires_grad and torch.is_grad_enabled())
        if packet is None:
            return None
    macs = x.numel() * ws[0]  # (x.numel() / in) rows times an (in x out) product
    return 2 * macs, macs, packet


_add([F.linear], Rule(linear_cost))


# --- convolutions -------------------------------------------------------------------------------


def _conv(transposed: bool) -> Rule:
    def count(args, kwargs):
        x, w = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
        if not (_dense(x) and _dense(w)):
            return None
        if transposed:
            # counted over the input elements (an unbatched input has the same numel once ATen batches it)
            macs = _conv_macs(x.shape, w.shape, None, True)
            return 2 * macs, macs, aten.convolution

        def cost(out: Tensor) -> Cost:
            macs = _conv_macs(x.shape, w.shape, out.shape, False)
            return 2 * macs, macs, aten.convolution

        return cost

    return Rule(count)


_add([F.conv1d, F.conv2d, F.conv3d], _conv(transposed=False))
_add([F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d], _conv(transposed=True))


# --- attention ----------------------------------------------------------------------------------

_SDPA_FLASH = 1  # torch._fused_sdp_choice's code for the flash kernel


def _sdpa(args, kwargs):
    n = len(args)
    if n >= 3:
        q, k, v = args[0], args[1], args[2]
    else:
        q, k, v = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key"), _arg(args, kwargs, 2, "value")
    if not q.is_cpu:
        return None
    # The same backend choice SDPA makes (the flash kernel refuses nested and non-strided
    # inputs itself): only the fused CPU kernel is counted here; the math fallback decomposes
    # into operators the ATen-level counter sees.
    mask = args[3] if n > 3 else kwargs.get("attn_mask")
    dropout_p = args[4] if n > 4 else kwargs.get("dropout_p", 0.0)
    is_causal = args[5] if n > 5 else kwargs.get("is_causal", False)
    scale, gqa = kwargs.get("scale"), kwargs.get("enable_gqa", False)
    if scale is None and not gqa:
        choice = torch._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal)
    else:
        choice = torch._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=gqa)
    if choice != _SDPA_FLASH:
        return None
    return (*_sdpa_fwd(q, k, v), _FLASH_CPU)


_add([F.scaled_dot_product_attention], Rule(_sdpa))
