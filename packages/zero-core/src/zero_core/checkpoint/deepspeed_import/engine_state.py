"""DeepSpeed's engine state (counters, loss scaler, LR scheduler, client state) as a zero record.

The model-states file holds ``global_steps``, ``global_samples``, ``skipped_steps``, the LR
scheduler's ``state_dict()`` and, at its top level, the ``client_state`` the user passed to
``save_checkpoint``. The loss scaler lives with the optimizer: an object in the ZeRO files
(read as a stand-in, see [Note: reading DeepSpeed pickles safely]), plain fields in the stage 0
fp16 optimizer, none at all for bf16/fp32. DeepSpeed does not save micro steps (they restart
from 0 on its own load) nor RNG states (zero's loader restores none for an imported checkpoint).
"""

from __future__ import annotations

import warnings
from typing import Any

from zero_core.checkpoint.deepspeed_import.safe_pickle import DeepSpeedLossScaler
from zero_core.checkpoint.format import CheckpointError, check_json_compatible

#: Keys of the model-states file that are DeepSpeed's own; every other top-level key is client state.
DEEPSPEED_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "universal_checkpoint_info",
        "ds_config",
        "ds_version",
    }
)


def _int(states: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    v = states.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise CheckpointError(f"{where}: {key} is {v!r}, expected a non-negative integer")
    return v


def _config_section(config: Any, key: str) -> dict[str, Any]:
    section = config.get(key) if isinstance(config, dict) else None
    return section if isinstance(section, dict) else {}


def loss_scaler_state(osd: Any, stage0_fields: dict[str, Any], config: Any) -> dict[str, Any]:
    """zero's loss-scaler state (``LossScalerState``) from what DeepSpeed saved."""
    hysteresis = int(_config_section(config, "fp16").get("hysteresis", 2))
    fields: dict[str, Any] = dict(stage0_fields)
    scaler = osd.get("loss_scaler") if isinstance(osd, dict) else None
    if isinstance(scaler, DeepSpeedLossScaler):
        fields = scaler.fields()
    elif scaler is not None:
        raise CheckpointError(
            f"the optimizer state's loss_scaler is a {type(scaler).__name__}, not a loss scaler"
        )
    return {
        "cur_scale": float(fields.get("cur_scale", 1.0)),
        "cur_iter": int(fields.get("cur_iter", 0)),
        "last_overflow_iter": int(fields.get("last_overflow_iter", -1)),
        "cur_hysteresis": int(fields.get("cur_hysteresis", hysteresis)),
        "overflows": 0,
    }


def _json_or_warn(value: Any, what: str) -> Any:
    try:
        check_json_compatible(value, what)
    except TypeError as e:
        warnings.warn(f"from_deepspeed: {e}; it is not imported", stacklevel=4)
        return None
    return value


def client_state(states: dict[str, Any]) -> dict[str, Any]:
    """The top-level keys DeepSpeed does not own (``save_checkpoint``'s ``client_state``), JSON ones only."""
    out = {}
    for key, value in states.items():
        if key in DEEPSPEED_KEYS:
            continue
        value = _json_or_warn(value, f"client_state[{key!r}]")
        if value is not None:
            out[str(key)] = value
    return out


def compute_dtype_name(config: Any) -> str:
    if _config_section(config, "bf16").get("enabled") or _config_section(config, "bfloat16").get("enabled"):
        return "bfloat16"
    return "float16" if _config_section(config, "fp16").get("enabled") else "float32"


def engine_record(states: dict[str, Any], where: str) -> dict[str, Any]:
    """Counters, scheduler, config and client state of the model-states dict ``states``."""
    config = states.get("ds_config")
    gas = _config_section({"x": config}, "x").get("gradient_accumulation_steps", 1)
    steps = _int(states, "global_steps", where)
    sched = states.get("lr_scheduler")
    if isinstance(sched, dict):
        sched = _json_or_warn(
            {k: list(v) if isinstance(v, tuple) else v for k, v in sched.items()}, "lr_scheduler"
        )
    return {
        "global_steps": steps,
        "global_samples": _int(states, "global_samples", where, 0),
        "skipped_steps": _int(states, "skipped_steps", where, 0),
        "micro_steps": steps * (gas if isinstance(gas, int) and gas > 0 else 1),
        "lr_scheduler": sched,
        "config": _json_or_warn(config, "ds_config") if config is not None else None,
        "client_state": client_state(states),
        "compute_dtype": compute_dtype_name(config),
    }
