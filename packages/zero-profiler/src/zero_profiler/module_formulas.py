"""Leaf-module rules: common ``torch.nn`` layers counted without entering their functional.

See [Note: leaf modules] in :mod:`zero_profiler.function_mode`. A built-in layer such as
``nn.Linear`` runs exactly one functional (``F.linear(input, self.weight, self.bias)``), so its
cost is that functional's rule from :mod:`zero_profiler.function_formulas` applied to the
module's own arguments. A rule here only applies when that is provably what runs:

* the module's class is exactly the layer (subclasses, and ``torch.nn.utils.parametrize``'s
  generated classes, override ``forward`` or compute the weight);
* that class's ``forward`` is still the one this module was written against, and the functional
  it calls is still the one torch defines (nobody patched either);
* the input and the parameters are plain tensors (a subclass's ``__torch_function__`` could run
  anything) and there is exactly one positional input.

``rule(module, x)`` returns ``(flops, macs, packet)`` or None (count the ordinary way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._ops import OpOverloadPacket

from zero_profiler.function_formulas import NO_FLOPS, Cost, dropout_cost, layer_norm_cost, linear_cost

aten = torch.ops.aten
_PLAIN = (torch.Tensor, nn.Parameter)
_NO_KWARGS: dict = {}
_MISSING = object()

# The functionals the layers call, as torch defines them (checked again at every call).
_LINEAR, _LAYER_NORM, _EMBEDDING, _DROPOUT = F.linear, F.layer_norm, F.embedding, F.dropout
_GELU, _RELU, _SILU = F.gelu, F.relu, F.silu

LeafRule = Callable[[nn.Module, Any], Cost | None]


def _params(m: nn.Module) -> tuple[Any, Any] | None:
    """``(m.weight, m.bias)`` as the forward will see them, read without ``Module.__getattr__``;
    None unless both are registered parameters (or None) of plain tensor type."""
    params = m._parameters
    w, b = params.get("weight", _MISSING), params.get("bias", _MISSING)
    if w is _MISSING or b is _MISSING or "weight" in m.__dict__ or "bias" in m.__dict__:
        return None
    if (w is not None and w.__class__ not in _PLAIN) or (b is not None and b.__class__ not in _PLAIN):
        return None
    return w, b


def _linear_rule(m: nn.Linear, x: object) -> Cost | None:
    wb = _params(m)
    if wb is None or x.__class__ not in _PLAIN or F.linear is not _LINEAR:
        return None
    return linear_cost((x, wb[0], wb[1]), _NO_KWARGS)


def _layer_norm_rule(m: nn.LayerNorm, x: object) -> Cost | None:
    wb = _params(m)
    if wb is None or x.__class__ not in _PLAIN or F.layer_norm is not _LAYER_NORM:
        return None
    return layer_norm_cost(x, wb[0])


def _embedding_rule(m: nn.Embedding, x: object) -> Cost | None:
    # A lookup (and, with max_norm, a renormalisation): no counted operator.
    w = m._parameters.get("weight")
    if w is None or w.__class__ not in _PLAIN or x.__class__ not in _PLAIN or F.embedding is not _EMBEDDING:
        return None
    return NO_FLOPS


def _dropout_rule(m: nn.Dropout, x: object) -> Cost | None:
    if x.__class__ not in _PLAIN or F.dropout is not _DROPOUT:
        return None
    return dropout_cost((x, m.p, m.training, m.inplace), _NO_KWARGS)


def _activation_rule(
    functional: str,
    original: Callable[..., torch.Tensor],
    packet: OpOverloadPacket,
    packet_: OpOverloadPacket | None = None,
) -> LeafRule:
    """One pointwise operator: 1 FLOP per output element, and the output has the input's shape."""

    def rule(m: nn.Module, x: object) -> Cost | None:
        if x.__class__ not in _PLAIN or getattr(F, functional) is not original:
            return None
        return x.numel(), 0, packet_ if packet_ is not None and m.inplace else packet

    return rule


# layer class -> (the forward the rule was written against, rule)
MODULE_RULES: dict[type, tuple[Any, LeafRule]] = {
    nn.Linear: (nn.Linear.forward, _linear_rule),
    nn.LayerNorm: (nn.LayerNorm.forward, _layer_norm_rule),
    nn.Embedding: (nn.Embedding.forward, _embedding_rule),
    nn.Dropout: (nn.Dropout.forward, _dropout_rule),
    nn.GELU: (nn.GELU.forward, _activation_rule("gelu", _GELU, aten.gelu)),
    nn.ReLU: (nn.ReLU.forward, _activation_rule("relu", _RELU, aten.relu, aten.relu_)),
    nn.SiLU: (nn.SiLU.forward, _activation_rule("silu", _SILU, aten.silu, aten.silu_)),
}


# Marker "rule" for TorchScript modules: their operators are invisible to a torch-function mode,
# so the whole call is counted at ATen level.
AT_ATEN_LEVEL: Any = object()


def leaf_rule(module: nn.Module) -> LeafRule | None:
    """The rule for ``module`` when it is exactly a known layer with its own class forward
    (``AT_ATEN_LEVEL`` for a TorchScript module)."""
    if isinstance(module, torch.jit.ScriptModule):
        return AT_ATEN_LEVEL
    entry = MODULE_RULES.get(type(module))
    if entry is None or type(module).forward is not entry[0] or "forward" in module.__dict__:
        return None
    return entry[1]
