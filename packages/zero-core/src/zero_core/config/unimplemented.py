"""DeepSpeed config features that zero parses but does not implement: set, they are errors.

[Note: unimplemented features]
A DeepSpeed user's config file must load unchanged, so every documented key is accepted,
including those of features zero does not have (curriculum learning,
compression, sequence parallelism, ...). Accepting a key must not mean silently ignoring it:
training without the curriculum or the compression the user asked for is a different run. So
every such key is listed in :data:`UNIMPLEMENTED`, in one of two forms:

* a whole section with a switch (``"curriculum_learning"`` with ``is_on``): the section
  *switched on* is an error naming it and what to do; present but off (``"enabled": false``, as
  generated configs often carry) it loads silently, as its other keys do nothing then in
  DeepSpeed either. Checked on the raw config, before validation;
* a dotted key (``"sequence_parallel_size"``, ``"zero_optimization.legacy_stage1"``): any
  value other than the model's default is an error naming the key and what to use instead.
  Checked on the validated config (every spelling of the key counts), see
  [Note: config key truth] in ``key_paths.py``.

The unknown-keys switch (``"zero_allow_unknown_keys": true`` or
``ZERO_CONFIG_UNKNOWN_KEYS=warn``, see [Note: unknown config keys]) downgrades the errors to
warnings, for users who accept the difference. Keys that cannot change what a run computes
are not here but in ``no_effect.py`` (they warn).

A few keys of newer DeepSpeed releases (``torch_autocast``, ``comet``, ``tensor_parallel``, ...)
are not in the key set of DeepSpeed's config documentation; they are taken out of the raw
config here, checked the same way, and never reach the validated model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zero_core.config.base import show
from zero_core.config.key_paths import is_set
from zero_core.config.root import ZeroConfig


def _flag(key: str) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, dict) and bool(value.get(key, False))


_enabled = _flag("enabled")


def _compile_on(value: object) -> bool:
    return _enabled(value) or _flag("deepcompile")(value)


def _compression_on(value: object) -> bool:
    """DeepSpeed switches compression on per technique: ``{"sparse_pruning": {"shared_parameters":
    {"enabled": true, ...}}, "layer_reduction": {"enabled": true}, ...}``, not with a top-level flag."""
    if not isinstance(value, dict):
        return False
    return _enabled(value) or any(
        _enabled(tech) or (isinstance(tech, dict) and _enabled(tech.get("shared_parameters")))
        for tech in value.values()
    )


def _truthy(value: object) -> bool:
    return bool(value)


def _tp_size(value: object) -> bool:
    if not isinstance(value, dict):
        return bool(value)
    size = value.get("autotp_size", value.get("tp_size", 1))
    return isinstance(size, int) and not isinstance(size, bool) and size > 1


@dataclass(frozen=True)
class Unimplemented:
    """A feature zero does not implement: ``what`` it is, what to do ``instead``; ``is_on`` (for a
    whole section: is it switched on?) or None (a dotted key: any non-default value)."""

    what: str
    instead: str
    is_on: Callable[[Any], bool] | None = None


_OFF = "remove the section or switch it off"
_MOE = (
    "the moe section configures nothing here: build MoE layers in code with zero.moe.MoE(hidden_size, "
    "expert, num_experts=..., ep_size=..., k=...), as DeepSpeed does, and remove the key"
)


def _moe(what: str) -> Unimplemented:
    return Unimplemented(f"the MoE layers' {what} from the config", _MOE)


#: section or dotted key -> the feature and what to do instead. One entry per line: easy to move
#: an entry to ``effect_tests.EFFECT_TESTS`` when its feature lands.
UNIMPLEMENTED: dict[str, Unimplemented] = {
    # -- whole sections, switched on ------------------------------------------------------------
    "curriculum_learning": Unimplemented("curriculum learning", _OFF, _enabled),
    "data_efficiency": Unimplemented("the data-efficiency library (curriculum, random-LTD)", _OFF, _enabled),
    "compression_training": Unimplemented("compression training", _OFF, _compression_on),
    "eigenvalue": Unimplemented("eigenvalue computation", _OFF, _enabled),
    "hybrid_engine": Unimplemented("the RLHF hybrid engine", _OFF, _enabled),
    "elasticity": Unimplemented("elastic training (batch sizes over a range of GPU counts)", _OFF, _enabled),
    "nebula": Unimplemented("the Nebula checkpoint service", _OFF, _enabled),
    "compile": Unimplemented("torch.compile of the engine's module, or DeepCompile", _OFF, _compile_on),
    "sparse_attention": Unimplemented(
        "DeepSpeed's sparse attention kernels", "use the model's own attention and " + _OFF, _enabled
    ),
    "amp": Unimplemented(
        "NVIDIA Apex AMP (DeepSpeed 0.19 removed it too)", "use the fp16 or bf16 section instead", _enabled
    ),
    # Newer DeepSpeed keys, outside DeepSpeed's documented key set (removed from the config before validation).
    "torch_autocast": Unimplemented(
        "torch.autocast mixed precision", "use the bf16 or fp16 sections", _enabled
    ),
    "comet": Unimplemented("the Comet monitor", "use tensorboard, wandb or csv_monitor", _enabled),
    "weight_quantization": Unimplemented(
        "weight quantization", "see zero.init_inference's int8 dtype; remove the section", _truthy
    ),
    "quantize_training": Unimplemented("quantization-aware training", _OFF, _enabled),
    "tensor_parallel": Unimplemented(
        "tensor-parallel training", "zero.init_inference has tensor parallelism; " + _OFF, _tp_size
    ),
    "use_data_before_expert_parallelism": Unimplemented(
        "data-before-expert-parallel MoE ordering", "remove the key", _truthy
    ),
    # -- dotted keys, any non-default value -----------------------------------------------------
    "sequence_parallel_size": Unimplemented(
        "DeepSpeed-Ulysses sequence parallelism",
        "set it to 1: zero splits the batch over all ranks (ZeRO stage 3 for models that do not fit)",
    ),
    "fp16.fp16_master_weights_and_grads": Unimplemented(
        "fp16 master weights and gradients",
        "remove the key: zero keeps fp32 master weights and gradients with fp16 (offload_optimizer saves the memory)",
    ),
    "zero_optimization.legacy_stage1": Unimplemented(
        "the ZeRO stage 1 of DeepSpeed before 0.5.9 (DeepSpeed refuses it too)",
        "remove the key and use stage 1",
    ),
    "zero_optimization.zeropp_loco_param": Unimplemented(
        "LoCo error feedback for ZeRO++ quantized gradients (DeepSpeed 0.19 removed it)",
        "remove the key (zero_quantized_gradients works without it)",
    ),
    "checkpoint.use_node_local_storage": Unimplemented(
        "checkpoints written to node-local disks",
        "save to a path every rank can read: a zero checkpoint is one directory that rank 0 commits after "
        "every rank wrote its files into it",
    ),
    "moe.enabled": _moe("switch"),
    "moe.num_experts": _moe("expert count"),
    "moe.ep_size": _moe("expert-parallel size"),
    "moe.k": _moe("top-k"),
    "moe.capacity_factor": _moe("capacity factor"),
    "moe.eval_capacity_factor": _moe("evaluation capacity factor"),
    "moe.min_capacity": _moe("minimum capacity"),
    "moe.use_residual": _moe("residual MoE switch"),
    "moe.noisy_gate_policy": _moe("noisy gate policy"),
    "moe.drop_tokens": _moe("token dropping switch"),
    "moe.use_rts": _moe("random token selection switch"),
    "moe.use_tutel": _moe("tutel switch"),
    "moe.top2_2nd_expert_sampling": _moe("second-expert sampling switch"),
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


def _report(message: str, policy: str, problems: list[str]) -> None:
    if policy != "warn":
        problems.append(message)
    else:
        warnings.warn(message + " (ignored)", UserWarning, stacklevel=4)


def check_unimplemented(raw: dict[str, Any], policy: str, problems: list[str]) -> dict[str, Any]:
    """``raw`` without the newer keys; every switched-on unimplemented section becomes a problem
    (with ``policy="warn"``, a warning). See [Note: unimplemented features]."""
    for name, entry in UNIMPLEMENTED.items():
        if entry.is_on is None or name not in raw or not entry.is_on(raw[name]):
            continue
        message = (
            f"{name}: {show(raw[name], limit=120)} switches on {entry.what}, which zero does not implement; "
            f"{entry.instead}"
        )
        _report(message, policy, problems)
    return {k: v for k, v in raw.items() if k not in NEWER_KEYS}


def check_unimplemented_keys(cfg: ZeroConfig, policy: str, problems: list[str]) -> None:
    """Every dotted key of :data:`UNIMPLEMENTED` that the validated ``cfg`` sets to a non-default
    value becomes a problem (a warning with ``policy="warn"``). See [Note: unimplemented features]."""
    for key, entry in UNIMPLEMENTED.items():
        if entry.is_on is not None:
            continue
        changed, value = is_set(cfg, key)
        if changed:
            message = (
                f"{key}: {show(value, limit=80)} asks for {entry.what}, which zero does not implement; "
                f"{entry.instead}"
            )
            _report(message, policy, problems)
