"""Config keys a pipeline does not carry out: a clear error at construction, never ignored.

zero-core's engine implements them; the pipeline engine runs its own loop (see
[Note: pipeline gradient reduction]) where they are not implemented, so each is refused here
with what to do instead (See [Note: config key truth] in zero_core/config/key_paths.py):

* ``wall_clock_breakdown``: the pipeline engine keeps no per-phase timers;
* ``data_types.grad_accum_dtype`` wider than the training dtype: tied weights are reduced
  across stages from ``.grad``, which the wider accumulation empties;
* sparse embedding gradients (``sparse_gradients``, ``nn.Embedding(sparse=True)``): the same
  cross-stage reduction of tied weights takes dense gradients.
"""

from __future__ import annotations

import torch
from zero_core.config import ZeroConfig
from zero_core.engine.strategy_factory import accum_dtype


def check_pipeline_config(cfg: ZeroConfig, module: torch.nn.Module) -> None:
    """Raise ``ValueError`` naming every key of ``cfg`` the pipeline engine does not carry out."""
    problems = []
    if cfg.wall_clock_breakdown:
        problems.append(
            "wall_clock_breakdown: true is not implemented by the pipeline engine (it keeps no per-phase "
            "timers); remove the key"
        )
    if accum_dtype(cfg) is not None:
        problems.append(
            f"data_types.grad_accum_dtype: {cfg.data_types.grad_accum_dtype!r} (wider than the training dtype) "
            "is not implemented with a pipeline; remove the key (gradients accumulate in the training dtype)"
        )
    sparse = [
        name
        for name, m in module.named_modules()
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
    ]
    if cfg.sparse_gradients or sparse:
        what = "sparse_gradients: true" if cfg.sparse_gradients else f"sparse=True embeddings {sparse}"
        problems.append(
            f"{what}: sparse gradients are reduced at ZeRO stage 0 without a pipeline only; use dense "
            "embeddings (sparse=False) and remove the key"
        )
    if problems:
        raise ValueError("pipeline engine: " + "; ".join(problems))
