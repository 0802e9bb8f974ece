"""What the engine prints about itself: ``dump_state`` at initialize, ``memory_breakdown`` per report.

DeepSpeed's ``dump_state`` prints the engine's settings once, after the engine is built, and
``memory_breakdown`` adds memory figures to its logs; both only print (global rank 0), so they
never change what a run computes. Here ``dump_state`` prints the resolved engine state (ZeRO
stage, dtypes, world, batch sizes, strategy and optimizer, then the whole validated config as
JSON), and ``memory_breakdown`` appends this rank's bytes per category of
``engine.memory_breakdown()`` (in MiB) to every progress line (every ``steps_per_print`` steps).
"""

from __future__ import annotations

import json
from typing import Any


def engine_state(engine: Any) -> dict[str, Any]:
    """The engine's resolved settings, as JSON-compatible values (``ZeroEngine`` or zero-pipe's
    ``PipelineEngine``)."""
    optimizer = engine.optimizer
    scheduler = getattr(engine, "lr_scheduler", None)
    return {
        "zero_stage": int(engine.config.zero_optimization.stage),
        "compute_dtype": str(engine.compute_dtype).replace("torch.", ""),
        "data_parallel_world_size": getattr(engine, "dp_world_size", getattr(engine, "dp_size", None)),
        "train_batch_size": engine.train_batch_size(),
        "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "engine": type(engine).__name__,
        "strategy": type(engine.strategy).__name__,
        "optimizer": None if optimizer is None else type(optimizer).__name__,
        "lr_scheduler": None if scheduler is None else type(scheduler).__name__,
        "loss_scale": engine.loss_scaler.loss_scale,
        "device": str(getattr(engine, "device", "")),
        "config": engine.config.to_dict(),
    }


def dump_engine_state(engine: Any) -> None:
    """Print :func:`engine_state` on global rank 0 (``"dump_state": true``)."""
    from zero_core import comm

    if not comm.is_initialized() or comm.get_rank() == 0:
        text = json.dumps(engine_state(engine), indent=2, sort_keys=True, default=str)
        print(f"[zero] engine state (dump_state):\n{text}", flush=True)


def breakdown_text(breakdown: dict[str, int]) -> str:
    """``memory_breakdown()`` as a progress-line field: ``"memory parameters 1.0 MiB, ..."``."""
    parts = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in breakdown.items() if v)
    return f"memory (this rank) {parts or 'none'}"
