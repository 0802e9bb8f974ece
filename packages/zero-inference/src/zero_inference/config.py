"""``DeepSpeedInferenceConfig``: the inference config as a strict pydantic model.

[Note: inference config]
Field names, defaults and aliases are DeepSpeed's (``kernel_inject``, ``tp``, ``mp_size``,
``max_tokens``, ``ckpt_config`` ...). Like the training config (see [Note: unknown config keys]
in zero_core), unknown keys are errors naming the closest known key, and two spellings of one
setting with different values (``mp_size: 2`` with ``tensor_parallel: {tp_size: 4}``) are a
conflict, not a silent pick. ``mp_size`` is the deprecated spelling of ``tensor_parallel.tp_size``.

Settings that cannot work on the machine (CUDA graphs or triton kernels without CUDA) are an
error rather than a silent ignore: :func:`check_machine` is called by ``init_inference``.

``dtype`` accepts torch dtypes and the strings ``fp32/float32/float``, ``fp16/float16/half``,
``bf16/bfloat16``, ``int8``; the default is DeepSpeed's ``torch.float16``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

import torch
from pydantic import BeforeValidator, Field, PlainSerializer, ValidationError, model_validator
from pydantic_core import PydanticCustomError
from zero_core.config import ConfigError, ConfigModel, ZeroOptimizationConfig
from zero_core.config.base import PosInt, aliases, one_of, show
from zero_core.config.errors import format_validation_error
from zero_core.config.unknown_keys import strip_unknown_keys, unknown_key_policy

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}
_ALLOWED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)


def _parse_dtype(value: object) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value in _ALLOWED_DTYPES:
            return value
    elif isinstance(value, str):
        key = value.lower().removeprefix("torch.")
        if key in _DTYPES:
            return _DTYPES[key]
    raise PydanticCustomError(
        "dtype",
        "{value} is not a supported dtype; use torch.float32/float16/bfloat16/int8 or one of {names}",
        {"value": show(value), "names": ", ".join(sorted(_DTYPES))},
    )


Dtype = Annotated[
    torch.dtype,
    BeforeValidator(_parse_dtype),
    PlainSerializer(lambda d: str(d).removeprefix("torch."), return_type=str),
]


class DeepSpeedTPConfig(ConfigModel):
    """``tensor_parallel``: split the model over ``tp_size`` ranks."""

    config_path: ClassVar[str] = "tensor_parallel"
    model_config = {**ConfigModel.model_config, "arbitrary_types_allowed": True}

    enabled: bool = True
    tp_size: PosInt = 1
    mpu: Any = None
    tp_group: Any = None


class DeepSpeedMoEConfig(ConfigModel):
    """``moe``: expert-parallel settings (run by zero-moe when installed)."""

    config_path: ClassVar[str] = "moe"
    model_config = {**ConfigModel.model_config, "arbitrary_types_allowed": True}

    enabled: bool = True
    ep_size: PosInt = 1
    moe_experts: list[int] = Field(
        default_factory=lambda: [1], validation_alias=aliases("moe_experts", "num_experts")
    )
    type: one_of(("standard", "residual")) = "standard"
    ep_mp_group: Any = None
    ep_group: Any = Field(None, validation_alias=aliases("ep_group", "expert_group"))


class _QuantBase(ConfigModel):
    enabled: bool = True
    num_bits: one_of((8,)) = 8
    q_type: one_of(("symmetric",)) = "symmetric"
    q_groups: PosInt = 1


class WeightQuantConfig(_QuantBase):
    """``quant.weight``: int8 weights, ``q_groups`` scale groups per output row (see quantize.py)."""

    config_path: ClassVar[str] = "quant.weight"
    quantized_initialization: dict[str, Any] = Field(default_factory=dict)
    post_init_quant: dict[str, Any] = Field(default_factory=dict)


class ActivationQuantConfig(_QuantBase):
    """``quant.activation``: activation quantization, not provided (int8 is weight-only); setting it
    explicitly is an error (see [Note: settings that only some models use])."""

    config_path: ClassVar[str] = "quant.activation"


class QKVQuantConfig(ConfigModel):
    config_path: ClassVar[str] = "quant.qkv"
    enabled: bool = True


class QuantizationConfig(ConfigModel):
    """``quant``: weight-only int8 settings; used when ``dtype`` is int8."""

    config_path: ClassVar[str] = "quant"
    enabled: bool = True
    activation: ActivationQuantConfig = Field(default_factory=ActivationQuantConfig)
    weight: WeightQuantConfig = Field(default_factory=WeightQuantConfig)
    qkv: QKVQuantConfig = Field(default_factory=QKVQuantConfig)


class InferenceCheckpointConfig(ConfigModel):
    config_path: ClassVar[str] = "checkpoint_config"
    checkpoint_dir: str | None = None
    save_mp_checkpoint_path: str | None = None
    base_dir: str | None = None


class DeepSpeedInferenceConfig(ConfigModel):
    """Every setting of :func:`zero_inference.init_inference`. See [Note: inference config]."""

    model_config = {**ConfigModel.model_config, "arbitrary_types_allowed": True}
    deprecated_keys: ClassVar[dict[str, str]] = {"mp_size": "tensor_parallel.tp_size"}

    replace_with_kernel_inject: bool = Field(
        False, validation_alias=aliases("replace_with_kernel_inject", "kernel_inject")
    )
    dtype: Dtype = torch.float16
    tensor_parallel: DeepSpeedTPConfig = Field(
        default_factory=DeepSpeedTPConfig, validation_alias=aliases("tensor_parallel", "tp")
    )
    enable_cuda_graph: bool = False
    use_triton: bool = False
    triton_autotune: bool = False
    zero: ZeroOptimizationConfig = Field(default_factory=ZeroOptimizationConfig)
    triangular_masking: bool = Field(True, validation_alias=aliases("triangular_masking", "tm"))
    moe: bool | DeepSpeedMoEConfig = Field(default_factory=DeepSpeedMoEConfig)
    quant: QuantizationConfig = Field(default_factory=QuantizationConfig)
    checkpoint: str | dict[str, Any] | None = None
    base_dir: str = ""
    set_empty_params: bool = False
    save_mp_checkpoint_path: str | None = None
    checkpoint_config: InferenceCheckpointConfig = Field(
        default_factory=InferenceCheckpointConfig,
        validation_alias=aliases("checkpoint_config", "ckpt_config"),
    )
    return_tuple: bool = True
    training_mp_size: PosInt = 1
    replace_method: one_of(("auto",)) = "auto"
    injection_policy: dict[Any, Any] | None = Field(
        None, validation_alias=aliases("injection_policy", "injection_dict")
    )
    injection_policy_tuple: tuple[Any, ...] | None = None
    config: dict[str, Any] | None = Field(None, validation_alias=aliases("config", "args"))
    max_out_tokens: PosInt = Field(1024, validation_alias=aliases("max_out_tokens", "max_tokens"))
    min_out_tokens: PosInt = Field(1, validation_alias=aliases("min_out_tokens", "min_tokens"))
    transposed_mode: bool = False
    mpu: Any = None
    ep_size: PosInt = 1
    ep_group: Any = Field(None, validation_alias=aliases("ep_group", "expert_group"))
    ep_mp_group: Any = Field(None, validation_alias=aliases("ep_mp_group", "expert_mp_group"))
    moe_experts: list[int] = Field(default_factory=lambda: [1])
    moe_type: one_of(("standard", "residual")) = "standard"

    @classmethod
    def _translate_deprecated(cls, data: dict[str, Any]) -> dict[str, Any]:
        # mp_size is the old spelling of tensor_parallel.tp_size; both given and different is a conflict.
        mp = data.pop("mp_size")
        tp_key = "tensor_parallel" if "tensor_parallel" in data else "tp" if "tp" in data else None
        tp = dict(data.get(tp_key) or {}) if tp_key else {}
        if not isinstance(tp, dict):
            return data
        if "tp_size" in tp and tp["tp_size"] != mp:
            raise PydanticCustomError(
                "alias_conflict",
                "mp_size ({mp}) and tensor_parallel.tp_size ({tp}) conflict; mp_size is deprecated, "
                "set only tensor_parallel.tp_size",
                {"mp": show(mp), "tp": show(tp["tp_size"])},
            )
        tp["tp_size"] = mp
        data[tp_key or "tensor_parallel"] = tp
        return data

    @model_validator(mode="after")
    def _check_consistency(self) -> DeepSpeedInferenceConfig:
        problems = []
        if self.min_out_tokens > self.max_out_tokens:
            problems.append(
                f"min_out_tokens ({self.min_out_tokens}) is larger than max_out_tokens ({self.max_out_tokens})"
            )
        if self.triton_autotune and not self.use_triton:
            problems.append("triton_autotune: true needs use_triton: true")
        if self.zero.stage == 3 and self.tp_size > 1:
            problems.append(
                "zero.stage 3 (ZeRO-Inference) cannot be combined with tensor_parallel.tp_size > 1"
            )
        if self.zero.stage in (1, 2):
            problems.append(
                f"zero.stage {self.zero.stage} partitions optimizer state, which inference does not have; "
                "use stage 3 (ZeRO-Inference) or 0"
            )
        if self.injection_policy is not None and self.replace_with_kernel_inject:
            problems.append(
                "injection_policy and replace_with_kernel_inject: true conflict; an injection_policy is for "
                "models without kernel injection (it names the output-projection linears for tensor parallelism)"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def tp_size(self) -> int:
        return self.tensor_parallel.tp_size if self.tensor_parallel.enabled else 1

    @property
    def moe_enabled(self) -> bool:
        return self.moe.enabled if isinstance(self.moe, DeepSpeedMoEConfig) else bool(self.moe)

    @property
    def checkpoint_save_path(self) -> str | None:
        return self.save_mp_checkpoint_path or self.checkpoint_config.save_mp_checkpoint_path


InferenceConfig = DeepSpeedInferenceConfig


def _read_config(config: InferenceConfigSource | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, DeepSpeedInferenceConfig):
        return dict(config.model_dump(exclude_unset=True))
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise ConfigError([f"config: {path!r} is not a file (expected a dict or a path to a JSON file)"])
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ConfigError([f"{path}: not valid JSON: {exc}"]) from exc
        if not isinstance(data, dict):
            raise ConfigError([f"{path}: the top level must be a JSON object"])
        return data
    if isinstance(config, dict):
        return dict(config)
    raise ConfigError(
        [
            f"config: expected a dict, a path to a JSON file or a DeepSpeedInferenceConfig, got {type(config).__name__}"
        ]
    )


def load_inference_config(
    config: InferenceConfigSource | None = None, **kwargs: object
) -> DeepSpeedInferenceConfig:
    """Merge ``config`` (dict / JSON path / model) and ``kwargs`` (kwargs win) into a validated config.

    Raises :class:`zero_core.config.ConfigError` listing every problem with its key path.
    """
    data = _read_config(config)
    for key, value in kwargs.items():
        # A kwarg replaces every spelling of the same field in the config (kwargs take precedence).
        field = _field_of(key)
        if field is not None:
            for spelling in _spellings(field):
                data.pop(spelling, None)
        data[key] = value
    problems: list[str] = []
    data = strip_unknown_keys(data, DeepSpeedInferenceConfig, "", unknown_key_policy(data), problems)
    try:
        cfg = DeepSpeedInferenceConfig.model_validate(data)
    except ValidationError as exc:
        problems.extend(format_validation_error(exc))
        cfg = None
    if problems:
        raise ConfigError(problems, source="inference config")
    return cfg


def _spellings(field: str) -> list[str]:
    info = DeepSpeedInferenceConfig.model_fields[field]
    alias = info.validation_alias
    names = [c for c in getattr(alias, "choices", []) if isinstance(c, str)] or [field]
    if field == "tensor_parallel":
        names.append("mp_size")
    return names


def _field_of(key: str) -> str | None:
    if key == "mp_size":
        return "tensor_parallel"
    for name in DeepSpeedInferenceConfig.model_fields:
        if key in _spellings(name):
            return name
    return None


def check_machine(cfg: DeepSpeedInferenceConfig, device: torch.device) -> None:
    """Reject settings the machine cannot honour (see [Note: inference config])."""
    problems = []
    on_cuda = device.type == "cuda" and torch.cuda.is_available()
    if cfg.enable_cuda_graph:
        if not on_cuda:
            problems.append(
                f"enable_cuda_graph: CUDA graphs need a CUDA device, but the model runs on {device.type}; "
                "remove enable_cuda_graph or set it to false"
            )
        else:
            problems.append("enable_cuda_graph: CUDA graph capture is not implemented by zero-inference yet")
    if cfg.use_triton:
        if not on_cuda:
            problems.append(
                f"use_triton: triton kernels need a CUDA device, but the model runs on {device.type}; "
                "remove use_triton or set it to false"
            )
        else:
            problems.append("use_triton: triton inference kernels are not implemented by zero-inference yet")
    if problems:
        raise ConfigError(problems, source="inference config")


_ENCODER_TYPES = ("bert", "roberta")


#: what ``init_inference(config=...)`` takes: a dict, a JSON file path or a parsed config.
InferenceConfigSource = Mapping[str, Any] | str | os.PathLike[str] | DeepSpeedInferenceConfig


def check_model_settings(cfg: DeepSpeedInferenceConfig, model: torch.nn.Module) -> None:
    """Reject settings that do not apply to this model or engine, naming the field and why.

    [Note: settings that only some models use]
    DeepSpeed accepts a few settings that steer its CUDA kernels. Here each either does what it
    says or is an error when set explicitly (defaults are never an error):

    * ``return_tuple`` (default true): the kernel-injected forward returns a tuple ``(logits,)``
      (with ``.logits``); false returns the logits tensor itself. Without kernel injection the
      model's own output is returned unchanged, so setting it is an error.
    * ``triangular_masking`` (``tm``): the mask kind of the injected attention. Fused decoders
      (GPT-2, Llama) are causal and need true; fused encoders (BERT) attend bidirectionally and
      need false; without kernel injection the model's own masking applies.
    * ``set_empty_params``: build with empty parameters (see ``engine._empty_params_``).
    * ``quant.activation``: activations are not quantized (int8 is weight-only).
    * ``transposed_mode``: the kernels use PyTorch's ``[out, in]`` weight layout; true is rejected.
    """
    problems = []
    given = cfg.model_fields_set
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    inject = cfg.replace_with_kernel_inject
    if "return_tuple" in given and not inject:
        problems.append(
            "return_tuple: only the kernel-injected forward is shaped by it; without replace_with_kernel_inject "
            "the model's own output is returned unchanged, remove return_tuple"
        )
    if "triangular_masking" in given:
        if not inject:
            problems.append(
                "triangular_masking: only the kernel-injected attention uses it; without replace_with_kernel_inject "
                "the model's own masking applies, remove triangular_masking"
            )
        elif model_type in _ENCODER_TYPES and cfg.triangular_masking:
            problems.append(
                f"triangular_masking: true does not apply to {model_type} encoders, which attend bidirectionally; "
                "set it to false or remove it"
            )
        elif model_type not in _ENCODER_TYPES and not cfg.triangular_masking:
            problems.append(
                f"triangular_masking: false does not apply to the causal {model_type} decoder (its attention "
                "must be triangular to match the model); set it to true or remove it"
            )
    if "activation" in cfg.quant.model_fields_set and cfg.quant.activation.enabled:
        problems.append(
            "quant.activation: activation quantization is not provided; int8 in zero-inference is weight-only "
            "(quant.weight), activations stay in the compute dtype. Remove quant.activation or set enabled: false"
        )
    if cfg.transposed_mode:
        problems.append(
            "transposed_mode: true is not supported; zero-inference's kernels read weights in PyTorch's "
            "[out, in] layout. Remove transposed_mode"
        )
    if problems:
        raise ConfigError(problems, source="inference config")
