"""zero: DeepSpeed's ZeRO training system, re-implemented as a family of small packages.

This module is the user-facing facade: DeepSpeed users replace ``deepspeed`` with ``zero``
(``deepspeed.initialize`` → ``zero.initialize``, ``deepspeed.zero.Init`` → ``zero.Init``).
Every name is re-exported lazily from the package that owns it. See [Note: facade] in
``zero._lazy``.
"""

from __future__ import annotations

import importlib
from typing import Any

from zero._lazy import import_owner
from zero.version import __version__

# facade name -> "module:attribute" in the package that owns it
_NAMES: dict[str, str] = {
    "initialize": "zero_core:initialize",
    "init_distributed": "zero_core:init_distributed",
    "add_config_arguments": "zero_core:add_config_arguments",
    "Init": "zero_core:Init",
    "GatheredParameters": "zero_core:GatheredParameters",
    "register_external_parameter": "zero_core:register_external_parameter",
    "unregister_external_parameter": "zero_core:unregister_external_parameter",
    "TiledLinear": "zero_core:TiledLinear",
    "init_inference": "zero_inference:init_inference",
    "InferenceEngine": "zero_inference:InferenceEngine",
    "PipelineModule": "zero_pipe:PipelineModule",
    "OnDevice": "zero_core:OnDevice",
    "MiCS_Init": "zero_core:MiCS_Init",
    "unwrap_model_for_generation": "zero_core:unwrap_model_for_generation",
    "TransformerConfig": "zero_ops.transformer:TransformerConfig",
    "TransformerLayer": "zero_ops.transformer:TransformerLayer",
    "DeepSpeedTransformerConfig": "zero_ops.transformer:DeepSpeedTransformerConfig",
    "DeepSpeedTransformerLayer": "zero_ops.transformer:DeepSpeedTransformerLayer",
}

# facade submodules (zero/<name>.py or zero/<name>/): imported on attribute access
_SUBMODULES = (
    "utils",
    "checkpointing",
    "checkpoint",
    "lr_schedules",
    "pipe",
    "moe",
    "ops",
    "profiling",
    "comm",
    "accelerator",
    "monitor",
    "zero",
    "inference",
    "integrations",
)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        module = importlib.import_module(f"zero.{name}")
        globals()[name] = module
        return module
    where = _NAMES.get(name)
    if where is None:
        raise AttributeError(f"module 'zero' has no attribute '{name}'")
    module, _, attr = where.partition(":")
    return getattr(import_owner(module, f"zero.{name}"), attr)


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAMES, *_SUBMODULES})


__all__ = ["__version__", *_NAMES, *_SUBMODULES]
