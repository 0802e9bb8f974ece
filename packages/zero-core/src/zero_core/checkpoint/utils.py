"""``clone_tensors_for_torch_save`` (``deepspeed.checkpoint.utils``)."""

from __future__ import annotations

from typing import Any

import torch

from zero_core.utils.nested import map_tensors


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """Copy of ``item`` whose tensors are clones on ``device``, each with storage of its own size.

    ``torch.save`` of a view writes the view's whole underlying storage (a slice of a flat
    ZeRO buffer drags the whole buffer along); cloning gives every tensor its own compact
    storage. Walks dicts, lists and tuples as :func:`~zero_core.utils.nested.map_tensors` does
    (types preserved, namedtuples included) and leaves other values as they are.
    """
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(
            f"clone_tensors_for_torch_save: device must be a torch.device or device string: {e}"
        ) from None
    return map_tensors(item, lambda t: t.detach().clone().to(device))
