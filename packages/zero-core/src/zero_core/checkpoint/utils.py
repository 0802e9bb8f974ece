"""``clone_tensors_for_torch_save`` (``deepspeed.checkpoint.utils``)."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """Copy of ``item`` whose tensors are clones on ``device``, each with storage of its own size.

    ``torch.save`` of a view writes the view's whole underlying storage (a slice of a flat
    ZeRO buffer drags the whole buffer along); cloning gives every tensor its own compact
    storage. Walks dicts, lists and tuples (types preserved, namedtuples included) and leaves
    other values as they are.
    """
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(
            f"clone_tensors_for_torch_save: device must be a torch.device or device string: {e}"
        ) from None
    return _clone(item, device)


def _clone(item: Any, device: torch.device) -> Any:
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, dict):
        cloned = {k: _clone(v, device) for k, v in item.items()}
        if type(item) is dict:
            return cloned
        try:  # OrderedDict and friends keep their type; a defaultdict cannot be rebuilt from a dict
            return type(item)(cloned)
        except TypeError:
            return cloned
    if isinstance(item, list):
        return [_clone(v, device) for v in item]
    if isinstance(item, tuple):
        values = [_clone(v, device) for v in item]
        return type(item)(*values) if hasattr(item, "_fields") else type(item)(values)
    return item
