"""``engine.sparse_tensor_module_names``: DeepSpeed's bookkeeping of ``sparse_gradients``.

[Note: sparse gradients]
DeepSpeed's ``sparse_gradients: true`` sends the gradients of every ``nn.Embedding`` /
``nn.EmbeddingBag`` weight as row-sparse tensors in data parallelism (only the rows a rank
touched, with their indices); the engine lists those weights in
``engine.sparse_tensor_module_names``, saves the set in its checkpoints and, on load, takes the
checkpoint's (merged with its own on a non-strict load of a different model). The averaged
gradient is the same either way; only the bytes on the wire differ.

zero reduces them the same way at stage 0 (See [Note: sparse gradient reduction] in
``engine/sparse_grads.py``; stages 1-3 refuse sparse gradients at ``initialize``).
The set is kept as DeepSpeed keeps it (built at ``initialize``, saved, restored), so code that
reads it behaves the same.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def sparse_module_names(module: torch.nn.Module, enabled: bool) -> set[str]:
    """The weight names ``sparse_gradients`` covers: every embedding's ``<name>.weight``."""
    if not enabled:
        return set()
    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    return {
        f"{name}.weight" if name else "weight" for name, m in module.named_modules() if isinstance(m, kinds)
    }


def restored_names(
    own: set[str], saved: Iterable[str], own_params: set[str], saved_params: set[str], strict: bool
) -> set[str]:
    """The set after loading a checkpoint that recorded ``saved``: the checkpoint's on a strict
    load; on a non-strict one, this engine's names minus those the saved model had as dense, plus
    the saved names this model has (DeepSpeed's merge)."""
    saved = set(saved)
    if strict:
        return saved
    keep = {n for n in own if not (n in saved_params and n not in saved)}
    return keep | {n for n in saved if n in own_params}
