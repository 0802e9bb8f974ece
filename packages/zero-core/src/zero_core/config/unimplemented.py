"""DeepSpeed config features that zero parses but does not implement.

[Note: unimplemented features]
A DeepSpeed user's config file must load unchanged, so every documented section is accepted,
including those of features zero does not have (curriculum learning, compression, the hybrid
engine, ...). Accepting a section must not mean silently ignoring it:
training without the layer drop or the curriculum the user asked for is a different run. So a
section that is *switched on* is an error naming the section and what to do; one that is present
but off (``"enabled": false``, as generated configs often carry) loads silently. Features that
do not change what a run computes in DeepSpeed either would only warn (``autotuning`` was one;
it is implemented now: ``zero run --autotuning``, see [Note: autotuning search]). The
unknown-keys switch (``"zero_allow_unknown_keys": true`` or ``ZERO_CONFIG_UNKNOWN_KEYS=warn``,
see [Note: unknown config keys]) downgrades the errors to warnings, for users who accept the
difference.

A few keys of newer DeepSpeed releases (``torch_autocast``, ``comet``, ``tensor_parallel``, ...)
are not in the key set of DeepSpeed's config documentation; they are taken out of the raw config here, checked the same way,
and never reach the validated model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from zero_core.config.base import show


def _flag(key: str) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, dict) and bool(value.get(key, False))


_enabled = _flag("enabled")


def _compression_on(value: Any) -> bool:
    """DeepSpeed switches compression on per technique: ``{"sparse_pruning": {"shared_parameters":
    {"enabled": true, ...}}, "layer_reduction": {"enabled": true}, ...}``, not with a top-level flag."""
    if not isinstance(value, dict):
        return False
    return _enabled(value) or any(
        _enabled(tech) or (isinstance(tech, dict) and _enabled(tech.get("shared_parameters")))
        for tech in value.values()
    )


def _truthy(value: Any) -> bool:
    return bool(value)


def _tp_size(value: Any) -> bool:
    if not isinstance(value, dict):
        return bool(value)
    size = value.get("autotp_size", value.get("tp_size", 1))
    return isinstance(size, int) and not isinstance(size, bool) and size > 1


#: name -> (is the feature switched on?, what it is, error (True) or warning (False) when on).
UNIMPLEMENTED: dict[str, tuple[Callable[[Any], bool], str, bool]] = {
    "curriculum_learning": (_enabled, "curriculum learning", True),
    "data_efficiency": (_enabled, "the data-efficiency library (curriculum, random-LTD)", True),
    "compression_training": (_compression_on, "compression training", True),
    "eigenvalue": (_enabled, "eigenvalue computation", True),
    "hybrid_engine": (_enabled, "the RLHF hybrid engine", True),
    "elasticity": (_enabled, "elastic training (batch sizes over a range of GPU counts)", True),
    "nebula": (_enabled, "the Nebula checkpoint service", True),
    "compile": (_flag("deepcompile"), "DeepCompile", True),
    # Newer DeepSpeed keys, outside DeepSpeed's documented key set (removed from the config before validation).
    "torch_autocast": (_enabled, "torch.autocast mixed precision (use the bf16 or fp16 sections)", True),
    "comet": (_enabled, "the Comet monitor (use tensorboard, wandb or csv_monitor)", True),
    "weight_quantization": (_truthy, "weight quantization (see zero.init_inference's int8 dtype)", True),
    "quantize_training": (_enabled, "quantization-aware training", True),
    "tensor_parallel": (
        _tp_size,
        "tensor-parallel training (zero.init_inference has tensor parallelism)",
        True,
    ),
    "use_data_before_expert_parallelism": (_truthy, "data-before-expert-parallel MoE ordering", True),
}

#: the keys of UNIMPLEMENTED that the validated model does not know (taken out of the raw config).
NEWER_KEYS = (
    "torch_autocast",
    "comet",
    "weight_quantization",
    "quantize_training",
    "tensor_parallel",
    "use_data_before_expert_parallelism",
)


#: keys accepted so DeepSpeed configs load unchanged that have no effect here: dotted key -> why.
#: Set to true, each warns (the one place that says so). See [Note: unimplemented features].
NO_EFFECT: dict[str, str] = {
    "zero_optimization.round_robin_gradients": (
        "every reduce bucket is already split evenly over the ranks, so there is nothing to rotate "
        "(see [Note: round_robin_gradients] in zero/stage_1_and_2.py)"
    ),
    "sparse_gradients": (
        "embedding gradients are reduced dense, the same averaged values DeepSpeed's row-sparse "
        "exchange gives, with more bytes on the wire; engine.sparse_tensor_module_names is kept "
        "(see [Note: sparse gradients] in utils/sparse_names.py)"
    ),
    "moe.enable_expert_tensor_parallelism": (
        "zero has no tensor model parallelism to split experts over; experts stay whole on their "
        "expert-parallel rank"
    ),
}


def warn_no_effect(key: str, stacklevel: int = 3) -> None:
    """Warn that ``key`` (of :data:`NO_EFFECT`) is set and does nothing here."""
    warnings.warn(
        f"{key} is set but has no effect in zero: {NO_EFFECT[key]}", UserWarning, stacklevel=stacklevel
    )


def check_no_effect(raw: dict[str, Any]) -> None:
    """Warn for every key of :data:`NO_EFFECT` that ``raw`` (the user's config) sets to true."""
    for key in NO_EFFECT:
        section, _, name = key.partition(".")
        value = raw.get(section)
        if value is True if not name else isinstance(value, dict) and value.get(name):
            warn_no_effect(key, stacklevel=4)


def check_unimplemented(raw: dict[str, Any], policy: str, problems: list[str]) -> dict[str, Any]:
    """``raw`` without the newer keys; every switched-on unimplemented feature becomes a problem
    (or, with ``policy="warn"`` or for warning-only features, a warning). See [Note: unimplemented
    features]."""
    check_no_effect(raw)
    for name, (is_on, what, fatal) in UNIMPLEMENTED.items():
        if name not in raw or not is_on(raw[name]):
            continue
        message = (
            f"{name}: {show(raw[name], limit=120)} switches on {what}, which zero does not implement; "
            f"remove the section or switch it off"
        )
        if fatal and policy != "warn":
            problems.append(message)
        else:
            warnings.warn(message + " (ignored)", UserWarning, stacklevel=3)
    return {k: v for k, v in raw.items() if k not in NEWER_KEYS}
