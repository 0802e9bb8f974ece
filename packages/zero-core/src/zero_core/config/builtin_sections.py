"""Built-in models of the plugin sections (see [Note: config sections] in ``sections.py``).

Each is permissive (:class:`PermissiveSection`): the keys DeepSpeed documents are type-checked,
other keys are kept. The package owning a section (zero-pipe for ``pipeline``, zero-moe for
``moe``, zero-offload for ``aio``, zero-profiler for ``flops_profiler``) registers its own, stricter
model, which replaces the built-in one.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, Field

from zero_core.config.base import (
    ConfigModel,
    Int,
    NonNegFloat,
    NonNegInt,
    PermissiveSection,
    PosFloat,
    PosInt,
    _reject_bool,
    one_of,
    show,
)
from zero_core.config.monitoring import FlopsProfilerConfig


def _stages(value: object) -> object:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    if isinstance(value, float) and value.is_integer() and value >= 1:
        return int(value)
    raise ValueError(f'{show(value)} is not "auto" or an integer >= 1')


class PipelineConfig(PermissiveSection):
    """``pipeline``: pipeline-parallel engine settings (owned by zero-pipe)."""

    config_path: ClassVar[str] = "pipeline"

    stages: Annotated[int | str, BeforeValidator(_stages)] = "auto"
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: NonNegInt = 0
    pipe_partitioned: bool = True
    grad_partitioned: bool = True


class MoEConfig(PermissiveSection):
    """``moe``: defaults for MoE layers (owned by zero-moe).

    DeepSpeed configures MoE layers in code (``deepspeed.moe.layer.MoE``); this section is our
    extension holding the same arguments, so layers built without explicit values use them.
    """

    config_path: ClassVar[str] = "moe"

    enabled: bool = False
    num_experts: PosInt = 1
    ep_size: PosInt = 1
    k: one_of((1, 2)) = 1
    capacity_factor: PosFloat = 1.0
    eval_capacity_factor: PosFloat = 1.0
    min_capacity: NonNegInt = 4
    use_residual: bool = False
    noisy_gate_policy: one_of(("Jitter", "RSample", "None")) | None = None
    drop_tokens: bool = True
    use_rts: bool = True
    use_tutel: bool = False
    enable_expert_tensor_parallelism: bool = False
    top2_2nd_expert_sampling: bool = True


class AioConfig(PermissiveSection):
    """``aio``: asynchronous I/O for NVMe offload (owned by zero-offload)."""

    config_path: ClassVar[str] = "aio"

    block_size: PosInt = 1_048_576
    queue_depth: PosInt = 8
    thread_count: PosInt = 1
    intra_op_parallelism: PosInt = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False


class AutotuningConfig(PermissiveSection):
    """``autotuning``: the autotuner's search (read by ``zero run --autotuning tune|run``; see
    [Note: autotuning search] in zero-profiler's ``zero_profiler.autotuning.autotuner``)."""

    config_path: ClassVar[str] = "autotuning"

    enabled: bool = False
    fast: bool = True
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = False
    metric: one_of(("latency", "throughput", "flops")) = "throughput"
    start_profile_step: PosInt = 3
    end_profile_step: PosInt = 5
    metric_path: str | None = None
    tuner_type: one_of(("gridsearch", "random", "model_based")) = "gridsearch"
    tuner_early_stopping: PosInt = 5
    tuner_num_trials: PosInt = 50
    arg_mappings: dict[str, str] | None = None
    max_train_batch_size: PosInt | None = None
    min_train_batch_size: PosInt = 1
    max_train_micro_batch_size_per_gpu: PosInt = 1024
    min_train_micro_batch_size_per_gpu: PosInt = 1
    num_tuning_micro_batch_sizes: PosInt = 3
    mp_size: PosInt = 1
    model_info: dict[str, Any] | None = None
    model_info_path: str | None = None
    #: zero's extension: the memory (bytes) an experiment may use per device (per rank on the CPU);
    #: default: the device's free memory (host RAM available / ranks on the CPU accelerator)
    memory_budget: PosInt | None = None
    #: zero's extension: seconds before a hung experiment is killed (recorded as "timeout")
    experiment_timeout: PosFloat = 600.0
    #: zero's extension: the search's best candidates measured again before the pick (0 or 1: no
    #: confirm phase); see [Note: autotuning confirm phase] in ``zero_profiler.autotuning.confirm``
    confirm_top_k: NonNegInt = 3


class ElasticityConfig(PermissiveSection):
    """``elasticity``: batch sizes valid across a range of GPU counts."""

    config_path: ClassVar[str] = "elasticity"

    enabled: bool = False
    max_train_batch_size: PosInt = 2000
    micro_batch_sizes: list[PosInt] = Field(default_factory=lambda: [2, 4, 6])
    min_gpus: PosInt = 1
    max_gpus: PosInt = 10000
    min_time: NonNegInt = 20
    version: NonNegFloat = 0.2
    ignore_non_elastic_batch_info: bool = False
    prefer_larger_batch: bool = True
    num_gpus_per_node: PosInt = 1
    model_parallel_size: PosInt = 1


class EnabledSection(PermissiveSection):
    """A feature section of which only ``enabled`` is checked here."""

    enabled: bool = False


class ProgressiveLayerDropConfig(ConfigModel):
    """``progressive_layer_drop``: the keep-probability schedule ``theta``/``gamma`` the engine
    passes to the model's forward (zero-core's own: See [Note: progressive layer drop]).

    The defaults are DeepSpeed's config defaults (theta 1.0: no layer is ever dropped; gamma 0.001).
    """

    config_path: ClassVar[str] = "progressive_layer_drop"

    enabled: bool = False
    theta: Annotated[float, BeforeValidator(_reject_bool), Field(ge=0, le=1)] = 1.0
    gamma: NonNegFloat = 0.001


class EigenvalueConfig(PermissiveSection):
    """``eigenvalue``: power-iteration estimate of the Hessian's top eigenvalue."""

    config_path: ClassVar[str] = "eigenvalue"

    enabled: bool = False
    verbose: bool = False
    max_iter: PosInt = 100
    tol: PosFloat = 1e-2
    stability: NonNegFloat = 1e-6
    gas_boundary_resolution: PosInt = 1
    layer_name: str = "bert.encoder.layer"
    layer_num: NonNegInt = 0


class CompileConfig(PermissiveSection):
    """``compile``: ``torch.compile`` of the wrapped module."""

    config_path: ClassVar[str] = "compile"

    enabled: bool = False
    backend: str = "inductor"
    kwargs: dict[str, Any] = Field(default_factory=dict)


class ThroughputTimerConfig(PermissiveSection):
    """``timers.throughput``: samples/s reporting."""

    config_path: ClassVar[str] = "timers.throughput"

    enabled: bool = True
    synchronized: bool = True


class TimersConfig(PermissiveSection):
    """``timers``."""

    config_path: ClassVar[str] = "timers"

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)


class HybridEngineConfig(PermissiveSection):
    """``hybrid_engine``: switch between training and generation (RLHF)."""

    config_path: ClassVar[str] = "hybrid_engine"

    enabled: bool = False
    max_out_tokens: PosInt = 512
    inference_tp_size: PosInt = 1
    release_inference_cache: bool = False
    pin_parameters: bool = True
    tp_gather_partition_size: PosInt = 8


class CurriculumLearningConfig(PermissiveSection):
    """``curriculum_learning`` (legacy curriculum; ``data_efficiency`` is the newer form)."""

    config_path: ClassVar[str] = "curriculum_learning"

    enabled: bool = False
    curriculum_type: str | None = None
    min_difficulty: Int | None = None
    max_difficulty: Int | None = None
    schedule_type: str | None = None
    schedule_config: dict[str, Any] = Field(default_factory=dict)


def _enabled_section(name: str) -> type[BaseModel]:
    return type(
        f"{name.title().replace('_', '')}Config",
        (EnabledSection,),
        {"config_path": name, "__module__": __name__},
    )


#: section name -> built-in model. The registry (``sections.py``) starts from this table.
BUILTIN_SECTIONS: dict[str, type[BaseModel]] = {
    "pipeline": PipelineConfig,
    "moe": MoEConfig,
    "aio": AioConfig,
    "flops_profiler": FlopsProfilerConfig,
    "autotuning": AutotuningConfig,
    "elasticity": ElasticityConfig,
    "progressive_layer_drop": ProgressiveLayerDropConfig,
    "eigenvalue": EigenvalueConfig,
    "compile": CompileConfig,
    "timers": TimersConfig,
    "hybrid_engine": HybridEngineConfig,
    "curriculum_learning": CurriculumLearningConfig,
    "data_efficiency": _enabled_section("data_efficiency"),
    "compression_training": _enabled_section("compression_training"),
    "sparse_attention": _enabled_section("sparse_attention"),
    "nebula": _enabled_section("nebula"),
}
