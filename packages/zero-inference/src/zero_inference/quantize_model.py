"""``quantize_model_``: the int8 pass over a whole model (see [Note: int8 weight groups] in
``quantize.py``): every ``nn.Linear`` becomes a :class:`QuantizedLinear`, and the tensor-parallel
linears of ``tp_layers.py`` (which hold their own int8 weights) quantize in place. It sits above
both modules, which need nothing of it."""

from __future__ import annotations

from torch import nn

from zero_inference.quantize import QuantizedLinear
from zero_inference.tp_layers import ShardedLinear


def quantize_model_(model: nn.Module, q_groups: int = 1, *, skip: tuple[str, ...] = ()) -> int:
    """Quantize every linear of ``model`` in place (``nn.Linear`` and our TP linears); returns the count.

    Embeddings, norms and the modules whose qualified names are in ``skip`` stay unquantized.
    """
    count = 0
    for name, module in list(model.named_modules()):
        if name in skip:
            continue
        if isinstance(module, ShardedLinear):
            if isinstance(module.weight, nn.Parameter):
                module.quantize_(q_groups)
                count += 1
        elif isinstance(module, nn.Linear):
            _set_submodule(model, name, QuantizedLinear(module.weight, module.bias, q_groups))
            count += 1
    return count


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)
