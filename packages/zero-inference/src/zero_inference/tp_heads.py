"""Per-head tensors entering a tensor-parallel attention module are cut to the heads it keeps.

[Note: per-head attention inputs]
After tensor parallelism an attention module of rank ``r`` computes heads
``[r * h, (r + 1) * h)`` of the model's ``H = h * tp_size`` (column splits keep whole heads
in order, see [Note: auto TP discovery]). Some models build tensors with one slice per head
*outside* the attention and pass them in: BLOOM's ALiBi biases (``alibi``,
``[batch * H, 1, kv]``) and, for Falcon with ``alibi=True``, an attention mask with the biases
baked in (``[batch, H, q, kv]``). A forward pre-hook on each sharded attention module keeps
this rank's heads of such arguments: ``alibi`` laid out ``[batch * H, ...]`` or
``[batch, H, ...]``, and a 4-D ``attention_mask`` whose head dimension is ``H`` (an ordinary
mask broadcasts over heads with a head dimension of 1 and is left alone). DeepSpeed's AutoTP
does the same for BLOOM by slicing its ALiBi tensor per rank.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

#: argument names that may carry one slice per head
PER_HEAD_ARGUMENTS = ("alibi", "attention_mask")


def _cut(name: str, value: object, heads: int, start: int, stop: int) -> object:
    if not isinstance(value, torch.Tensor) or heads <= 1:
        return value
    if value.dim() == 4 and value.shape[1] == heads:
        return value[:, start:stop]
    if name == "alibi" and value.dim() == 3 and value.shape[0] % heads == 0:
        batch = value.shape[0] // heads
        per_head = value.reshape(batch, heads, *value.shape[1:])[:, start:stop]
        return per_head.reshape(batch * (stop - start), *value.shape[1:])
    return value


def install_head_slicing(module: nn.Module, heads: int, rank: int, world: int) -> RemovableHandle | None:
    """Cut per-head arguments of ``module`` (which keeps ``heads // world`` of ``heads``) to rank's heads.

    Returns the hook handle, or None when ``module.forward`` takes none of
    :data:`PER_HEAD_ARGUMENTS`. See [Note: per-head attention inputs].
    """
    if heads % world:
        raise ValueError(f"cannot split {heads} attention heads over {world} tensor-parallel ranks")
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):  # a forward without an inspectable signature
        return None
    names = [n for n in PER_HEAD_ARGUMENTS if n in params]
    if not names:
        return None
    local = heads // world
    start, stop = rank * local, (rank + 1) * local
    position = {n: params.index(n) for n in names}

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = list(args)
        for name in names:
            if name in kwargs:
                kwargs[name] = _cut(name, kwargs[name], heads, start, stop)
            elif position[name] < len(args):
                args[position[name]] = _cut(name, args[position[name]], heads, start, stop)
        return tuple(args), kwargs

    return module.register_forward_pre_hook(hook, with_kwargs=True)
