"""``ZeroConfig``: the root of the DeepSpeed JSON config.

Attribute names are DeepSpeed's key names (``cfg.zero_optimization.stage``, ``cfg.fp16.enabled``,
``cfg.train_micro_batch_size_per_gpu``). Build it with :func:`zero_core.config.load_config`,
which also reports unknown keys with suggestions and resolves the batch-size triple; plain
``ZeroConfig.model_validate(dict)`` validates without those two steps.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from zero_core.config import sections
from zero_core.config.activation_checkpointing import ActivationCheckpointingConfig
from zero_core.config.base import AUTO, ConfigModel, NonNegFloat, PosFloat, PosInt, aliases, show
from zero_core.config.batch import BatchSizes, resolve_batch_size
from zero_core.config.builtin_sections import BUILTIN_SECTIONS
from zero_core.config.checkpoint import CheckpointConfig
from zero_core.config.errors import format_validation_error
from zero_core.config.monitoring import CommsLoggerConfig, CSVConfig, TensorBoardConfig, WandbConfig
from zero_core.config.optimizer import OptimizerConfig, SchedulerConfig
from zero_core.config.precision import (
    AmpConfig,
    BF16Config,
    DataType,
    DataTypesConfig,
    FP16Config,
    bf16_master_problems,
)
from zero_core.config.zero_optimization import ZeroOptimizationConfig

Section = SerializeAsAny[BaseModel]


def _section_default(name: str) -> Any:
    return Field(default_factory=lambda: sections.section_model(name)())


def validate_section(name: str, value: object, context: dict[str, Any] | None) -> BaseModel:
    """Validate plugin section ``name`` with the model registered for it now."""
    model = sections.section_model(name)
    if model is None:
        raise ValueError(f"{name}: no config section of that name is registered")
    if isinstance(value, model):
        return value
    if isinstance(value, BaseModel):
        value = value.model_dump()
    try:
        return model.model_validate(value, context=context)
    except ValidationError as exc:
        raise ValueError("\n".join(format_validation_error(exc, prefix=name))) from None


class ZeroConfig(ConfigModel):
    """The whole config. See the module docstring; plugin sections: [Note: config sections]."""

    # --- batch (None until resolved by load_config; "auto" means "derive") ---
    train_batch_size: Annotated[PosInt | None, AUTO] = None
    train_micro_batch_size_per_gpu: Annotated[PosInt | None, AUTO] = None
    gradient_accumulation_steps: Annotated[PosInt | None, AUTO] = None

    # --- training scalars ---
    steps_per_print: PosInt | None = 10
    wall_clock_breakdown: bool = False
    dump_state: bool = False
    memory_breakdown: bool = False
    #: DeepSpeed clips at 1.0 by default; 0 disables clipping.
    gradient_clipping: Annotated[NonNegFloat, AUTO] = 1.0
    prescale_gradients: bool = False
    gradient_predivide_factor: PosFloat = 1.0
    sparse_gradients: bool = False
    communication_data_type: DataType | None = None
    #: zero's own key: seconds any collective may wait before the collective watchdog names the
    #: missing ranks and ends the job (None: ZERO_COLLECTIVE_TIMEOUT, else 300). See [Note: collective watchdog].
    comms_timeout: PosFloat | None = None
    seq_parallel_communication_data_type: DataType = "fp32"
    sequence_parallel_size: PosInt = 1
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    #: our switch: unknown keys warn instead of failing (also ZERO_CONFIG_UNKNOWN_KEYS=warn).
    zero_allow_unknown_keys: bool = False
    dataloader_drop_last: bool = False
    disable_allgather: bool = False
    graph_harvesting: bool = False

    # --- core sections ---
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config, validation_alias=aliases("bf16", "bfloat16"))
    amp: AmpConfig = Field(default_factory=AmpConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroOptimizationConfig = Field(default_factory=ZeroOptimizationConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    # --- plugin sections (models from the registry; see [Note: config sections]) ---
    pipeline: Section = _section_default("pipeline")
    moe: Section = _section_default("moe")
    aio: Section = _section_default("aio")
    flops_profiler: Section = _section_default("flops_profiler")
    autotuning: Section = _section_default("autotuning")
    elasticity: Section = _section_default("elasticity")
    progressive_layer_drop: Section = _section_default("progressive_layer_drop")
    eigenvalue: Section = _section_default("eigenvalue")
    compile: Section = _section_default("compile")
    timers: Section = _section_default("timers")
    hybrid_engine: Section = _section_default("hybrid_engine")
    curriculum_learning: Section = _section_default("curriculum_learning")
    data_efficiency: Section = _section_default("data_efficiency")
    compression_training: Section = _section_default("compression_training")
    sparse_attention: Section = _section_default("sparse_attention")
    nebula: Section = _section_default("nebula")
    #: registered sections that are not built in, by name (flattened to top-level keys by to_dict).
    extra_sections: dict[str, Section] = Field(default_factory=dict)

    _batch: BatchSizes | None = PrivateAttr(default=None)
    #: batch sizes the user wrote as "auto" (validated to None): named when they cannot be derived
    _auto_batch: tuple[str, ...] = PrivateAttr(default=())

    plugin_section_names: ClassVar[tuple[str, ...]] = tuple(BUILTIN_SECTIONS)

    @model_validator(mode="before")
    @classmethod
    def _collect_extra_sections(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        registered = sections.config_sections()
        moved = {k: data[k] for k in data if k in registered and k not in cls.model_fields}
        if moved:
            data = {k: v for k, v in data.items() if k not in moved}
            data["extra_sections"] = {**data.get("extra_sections", {}), **moved}
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _remember_auto_batch(cls, data: object, handler: ModelWrapValidatorHandler[ZeroConfig]) -> ZeroConfig:
        cfg = handler(data)
        if isinstance(data, dict):
            cfg._auto_batch = tuple(
                k for k in ("train_batch_size", "train_micro_batch_size_per_gpu") if data.get(k) == "auto"
            )
        return cfg

    @field_validator("zero_optimization", mode="before")
    @classmethod
    def _legacy_bool_zero(cls, value: object) -> object:
        if isinstance(value, bool):
            warnings.warn(
                f"zero_optimization: {show(value)} is deprecated, use zero_optimization: "
                f'{{"stage": {int(value)}}} instead',
                FutureWarning,
                stacklevel=2,
            )
            return {"stage": int(value)}
        return value

    @field_validator(*BUILTIN_SECTIONS, mode="before")
    @classmethod
    def _validate_plugin_section(cls, value: object, info: ValidationInfo) -> BaseModel:
        return validate_section(info.field_name, value, info.context)

    @field_validator("extra_sections", mode="before")
    @classmethod
    def _validate_extra_sections(cls, value: object, info: ValidationInfo) -> object:
        if not isinstance(value, dict):
            return value
        return {name: validate_section(name, v, info.context) for name, v in value.items()}

    @model_validator(mode="after")
    def _check_exclusive(self) -> ZeroConfig:
        problems = []
        if self.fp16.enabled and self.bf16.enabled:
            problems.append(
                "fp16.enabled and bf16.enabled are both true: enable at most one of fp16 and bf16"
            )
        if self.amp.enabled and (self.fp16.enabled or self.bf16.enabled):
            which = "fp16" if self.fp16.enabled else "bf16"
            problems.append(
                f"amp.enabled and {which}.enabled are both true: Apex AMP replaces fp16/bf16, use one"
            )
        if self.amp.enabled and self.zero_optimization.stage > 0:
            problems.append(
                f"amp.enabled: Apex AMP cannot be combined with ZeRO (zero_optimization.stage is "
                f"{self.zero_optimization.stage}); use fp16 or bf16 with ZeRO"
            )
        problems += self._stage_dependent_problems()
        zc = self.zero_optimization  # See [Note: bf16 master weights]
        offloaded = zc.offload_optimizer is not None and zc.offload_optimizer.enabled
        problems += bf16_master_problems(self.bf16, int(zc.stage), offloaded)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _stage_dependent_problems(self) -> list[str]:
        """Keys whose meaning depends on the precision or the ZeRO stage (checked with all sections)."""
        problems = []
        stage, precision = self.zero_optimization.stage, self.precision
        accum = self.data_types.grad_accum_dtype
        if accum is not None and accum != precision and not (accum == "fp32" and precision != "fp32"):
            problems.append(
                f"data_types.grad_accum_dtype: {show(accum)} with {precision} training: gradients accumulate "
                f'in the training dtype ({show(precision)}) or, with fp16/bf16 training, in "fp32"'
            )
        if stage > 0 and self.gradient_predivide_factor != 1.0:
            problems.append(
                f"gradient_predivide_factor: {self.gradient_predivide_factor:g} applies at ZeRO stage 0; stages 1-3 "
                f"divide by the world size before the reduction (DeepSpeed's ZeRO-2/3 refuse the factor too); "
                f"zero_optimization.stage is {stage}: remove the key"
            )
        if stage > 0 and self.sparse_gradients:
            problems.append(
                f"sparse_gradients: true reduces embedding gradients sparsely at ZeRO stage 0 only (as DeepSpeed); "
                f"zero_optimization.stage is {stage}: remove the key or use stage 0"
            )
        return problems

    # --- accessors ---

    def section(self, name: str) -> BaseModel:
        """The plugin section ``name`` (built in or registered)."""
        if name in self.plugin_section_names:
            return getattr(self, name)
        if name in self.extra_sections:
            return self.extra_sections[name]
        model = sections.section_model(name)
        if model is None:
            known = sorted([*self.plugin_section_names, *self.extra_sections])
            raise KeyError(f"no config section {name!r}; sections are {', '.join(known)}")
        return model()

    @property
    def precision(self) -> str:
        """``"fp16"``, ``"bf16"`` or ``"fp32"`` (amp counts as fp16)."""
        if self.fp16.enabled or self.amp.enabled:
            return "fp16"
        return "bf16" if self.bf16.enabled else "fp32"

    @property
    def batch_sizes(self) -> BatchSizes | None:
        """The resolved batch triple with its world size (None before :meth:`with_batch_sizes`)."""
        return self._batch

    def with_batch_sizes(
        self, world_size: int | None = None, world_size_source: str | None = None
    ) -> ZeroConfig:
        """A copy with the batch triple resolved for ``world_size`` data-parallel ranks."""
        sizes = resolve_batch_size(
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
            world_size=world_size,
            world_size_source=world_size_source,
            auto_names=self._auto_batch,
        )
        out = self.model_copy(
            update={
                "train_batch_size": sizes.train_batch_size,
                "train_micro_batch_size_per_gpu": sizes.train_micro_batch_size_per_gpu,
                "gradient_accumulation_steps": sizes.gradient_accumulation_steps,
            }
        )
        out._batch = sizes
        return out

    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON-compatible dict of DeepSpeed keys; ``load_config`` of it gives an equal config."""
        out = self.model_dump(mode="json", exclude={"extra_sections"})
        for name, model in self.extra_sections.items():
            out[name] = model.model_dump(mode="json")
        return out


sections.CORE_KEYS.update(k for k in ZeroConfig.model_fields if k not in BUILTIN_SECTIONS)
sections.CORE_KEYS.add("bfloat16")
