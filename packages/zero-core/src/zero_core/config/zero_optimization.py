"""The ``zero_optimization`` section: ZeRO stage, buckets, ZeRO-3 knobs, offload, MiCS, ZeRO++.

Keys, defaults and constraints follow DeepSpeed's ``DeepSpeedZeroConfig``,
``DeepSpeedZeroOffloadParamConfig`` and ``DeepSpeedZeroOffloadOptimizerConfig``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import Field, model_validator

from zero_core.config.base import (
    AUTO,
    ConfigModel,
    NonNegInt,
    PosInt,
    aliases,
    one_of,
    show,
)

OffloadDevice = one_of(("none", "cpu", "nvme"))


class _OffloadCommon(ConfigModel):
    device: OffloadDevice = "none"
    nvme_path: Path | None = None
    buffer_count: NonNegInt = 5
    pin_memory: bool = False

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> _OffloadCommon:
        if self.device == "nvme" and self.nvme_path is None:
            raise ValueError(f'{self.config_path}.nvme_path: required when device is "nvme"')
        return self

    @property
    def enabled(self) -> bool:
        """Whether this offload is active (device is not ``"none"``)."""
        return self.device != "none"


class OffloadParamConfig(_OffloadCommon):
    """``zero_optimization.offload_param``: offload of parameters (ZeRO stage 3 only)."""

    config_path: ClassVar[str] = "zero_optimization.offload_param"

    buffer_count: NonNegInt = 5
    buffer_size: NonNegInt = 100_000_000
    max_in_cpu: NonNegInt = 1_000_000_000


class OffloadOptimizerConfig(_OffloadCommon):
    """``zero_optimization.offload_optimizer``: offload of optimizer states and step (stages 1-3)."""

    config_path: ClassVar[str] = "zero_optimization.offload_optimizer"

    buffer_count: NonNegInt = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0

    @property
    def pipeline(self) -> bool:
        """Whether tile reads or writes are overlapped with the optimizer step."""
        return self.pipeline_read or self.pipeline_write


class ZeroOptimizationConfig(ConfigModel):
    """``zero_optimization``: see DeepSpeed's ZeRO config docs (the ZeRO config reference)."""

    config_path: ClassVar[str] = "zero_optimization"
    deprecated_keys: ClassVar[dict[str, str]] = {
        "cpu_offload": 'offload_optimizer: {"device": "cpu"}',
        "cpu_offload_param": 'offload_param: {"device": "cpu"}',
        "cpu_offload_params": 'offload_param: {"device": "cpu"}',
        "cpu_offload_use_pin_memory": "offload_param.pin_memory / offload_optimizer.pin_memory",
        "stage3_gather_fp16_weights_on_model_save": "gather_16bit_weights_on_model_save",
    }

    stage: one_of((0, 1, 2, 3)) = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: Annotated[NonNegInt, AUTO] = 500_000_000
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: Annotated[NonNegInt, AUTO] = 500_000_000
    #: ``None`` in the input means "the stage decides": True for stage 3, False otherwise.
    overlap_comm: bool | None = None
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: OffloadParamConfig | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None
    sub_group_size: Annotated[NonNegInt, AUTO] = 1_000_000_000
    prefetch_bucket_size: Annotated[NonNegInt, AUTO] = Field(
        50_000_000, validation_alias=aliases("prefetch_bucket_size", "stage3_prefetch_bucket_size")
    )
    param_persistence_threshold: Annotated[NonNegInt, AUTO] = Field(
        100_000, validation_alias=aliases("param_persistence_threshold", "stage3_param_persistence_threshold")
    )
    model_persistence_threshold: Annotated[NonNegInt, AUTO] = Field(
        sys.maxsize,
        validation_alias=aliases("model_persistence_threshold", "stage3_model_persistence_threshold"),
    )
    max_live_parameters: Annotated[NonNegInt, AUTO] = Field(
        1_000_000_000, validation_alias=aliases("max_live_parameters", "stage3_max_live_parameters")
    )
    max_reuse_distance: Annotated[NonNegInt, AUTO] = Field(
        1_000_000_000, validation_alias=aliases("max_reuse_distance", "stage3_max_reuse_distance")
    )
    gather_16bit_weights_on_model_save: Annotated[bool, AUTO] = Field(
        False,
        validation_alias=aliases(
            "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"
        ),
    )
    use_all_reduce_for_fetch_params: bool = Field(
        False,
        validation_alias=aliases("use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params"),
    )
    module_granularity_threshold: NonNegInt = Field(
        0, validation_alias=aliases("module_granularity_threshold", "stage3_module_granularity_threshold")
    )
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    # hpZ and MiCS: See [Note: MiCS and hpZ shard groups] (checked against the world at initialize)
    zero_hpz_partition_size: PosInt = 1
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    zeropp_loco_param: dict[str, Any] | None = None
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False

    @classmethod
    def _translate_deprecated(cls, data: dict[str, Any]) -> dict[str, Any]:
        pin = data.pop("cpu_offload_use_pin_memory", None)
        if pin is not None:
            _warn_deprecated("cpu_offload_use_pin_memory", cls.deprecated_keys["cpu_offload_use_pin_memory"])
        for old, new in (
            ("cpu_offload", "offload_optimizer"),
            ("cpu_offload_param", "offload_param"),
            ("cpu_offload_params", "offload_param"),
        ):
            if old not in data:
                continue
            value = data.pop(old)
            _warn_deprecated(old, cls.deprecated_keys[old])
            if not isinstance(value, bool):
                raise ValueError(
                    f"zero_optimization.{old}: {show(value)} is not a boolean (use true or false)"
                )
            if value:
                if data.get(new) not in (None, {}):
                    raise ValueError(
                        f"zero_optimization.{old} and zero_optimization.{new} are both given; keep only {new}"
                    )
                data[new] = {"device": "cpu", "pin_memory": bool(pin)}
        if pin is not None:
            # The legacy switch also applies to the new-style sections that did not set it.
            for new in ("offload_optimizer", "offload_param"):
                if isinstance(data.get(new), dict):
                    data[new] = {"pin_memory": bool(pin), **data[new]}
        if "stage3_gather_fp16_weights_on_model_save" in data:
            value = data.pop("stage3_gather_fp16_weights_on_model_save")
            _warn_deprecated("stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save")
            data.setdefault("gather_16bit_weights_on_model_save", value)
        return data

    @model_validator(mode="after")
    def _check_stage_dependent(self) -> ZeroOptimizationConfig:
        problems = []
        if self.offload_param is not None and self.offload_param.enabled and self.stage < 3:
            # DeepSpeed accepts offload_param at any stage and uses it only at stage 3, and real
            # configs carry it at stage 2 (trlx, DeepSpeed's own tests): ignore it, but say so.
            warnings.warn(
                f"zero_optimization.offload_param: parameters are offloaded only at stage 3; ignored at "
                f"stage {self.stage}, as DeepSpeed does (stages 1 and 2 offload with offload_optimizer)",
                UserWarning,
                stacklevel=2,
            )
            object.__setattr__(self, "offload_param", None)
        if self.offload_optimizer is not None and self.offload_optimizer.enabled and self.stage == 0:
            problems.append(
                "zero_optimization.offload_optimizer: offloading the optimizer needs stage 1, 2 or 3, got stage 0"
            )
        if self.mics_shard_size == 0 or self.mics_shard_size < -1:
            problems.append(
                f"zero_optimization.mics_shard_size: {self.mics_shard_size} is out of range: "
                "must be -1 (MiCS off) or >= 1"
            )
        elif self.mics_shard_size > 0 and self.stage != 3:
            problems.append(f"zero_optimization.mics_shard_size: MiCS needs stage 3, got stage {self.stage}")
        if self.mics_hierarchical_params_gather and self.mics_shard_size <= 0:
            problems.append("zero_optimization.mics_hierarchical_params_gather: needs mics_shard_size >= 1")
        if self.zero_hpz_partition_size > 1 and self.stage != 3:
            problems.append(
                f"zero_optimization.zero_hpz_partition_size: hierarchical partitioning (ZeRO++ hpZ) needs "
                f"stage 3, got stage {self.stage}"
            )
        for key in (
            "zero_quantized_weights",
            "zero_quantized_nontrainable_weights",
            "zero_quantized_gradients",
        ):
            if getattr(self, key) and self.stage != 3:  # ZeRO++ qwZ / qgZ quantize stage 3's collectives
                problems.append(
                    f"zero_optimization.{key}: ZeRO++ quantization needs stage 3, got stage {self.stage}"
                )
        for key in ("module_granularity_threshold", "use_all_reduce_for_fetch_params"):
            if getattr(self, key) and self.stage != 3:  # how stage 3 fetches its partitioned parameters
                warnings.warn(
                    f"zero_optimization.{key}: applies to stage 3's parameter fetches only; ignored at "
                    f"stage {self.stage}, as DeepSpeed does",
                    UserWarning,
                    stacklevel=2,
                )
        if problems:
            raise ValueError("\n".join(problems))
        if self.overlap_comm is None:
            # DeepSpeed's default: overlap for stage 3, not for the others.
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        return self

    @property
    def offload_optimizer_device(self) -> str:
        """``"none"``, ``"cpu"`` or ``"nvme"``."""
        return self.offload_optimizer.device if self.offload_optimizer is not None else "none"

    @property
    def offload_param_device(self) -> str:
        """``"none"``, ``"cpu"`` or ``"nvme"``."""
        return self.offload_param.device if self.offload_param is not None else "none"


def _warn_deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"zero_optimization.{old} is deprecated, use zero_optimization.{new} instead",
        FutureWarning,
        stacklevel=2,
    )
