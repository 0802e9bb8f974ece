"""The settings of the ZeRO stage strategies, built once from the typed config.

Each strategy takes one frozen options object, whole (See [Note: strategy options] in
``engine/strategy_factory.py``): :class:`PartitionedOptions` (stages 1 and 2) and
:class:`Stage3Options` here, below the strategies that read them; stage 0's
``DataParallelOptions`` sits with the engine's factory. The dtype helpers turn the config's
precision sections into the dtypes every strategy (and zero-pipe) trains with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_core.config.root import ZeroConfig

# ``communication_data_type`` names -> dtypes
COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def compute_dtype(cfg: ZeroConfig) -> torch.dtype:
    """The training dtype the config asks for: fp16, bf16 or fp32."""
    if cfg.fp16.enabled:
        return torch.float16
    if cfg.bf16.enabled:
        return torch.bfloat16
    return torch.float32


def accum_dtype(cfg: ZeroConfig) -> torch.dtype | None:
    """``data_types.grad_accum_dtype`` when it is wider than the training dtype, else None (autograd
    accumulates in the training dtype). See [Note: gradient accumulation dtype] in grad_buckets.py."""
    wanted = COMM_DTYPES.get(str(cfg.data_types.grad_accum_dtype or "").lower())
    return wanted if wanted is not None and wanted != compute_dtype(cfg) else None


def master_dtype(cfg: ZeroConfig) -> torch.dtype:
    """The optimizer's master weights' dtype: bf16 with ``bf16.bf16_master_weights_and_grads``
    (See [Note: bf16 master weights]), else fp32."""
    return torch.bfloat16 if cfg.bf16.bf16_master_weights_and_grads else torch.float32


def comm_dtype(cfg: ZeroConfig) -> torch.dtype | None:
    """``communication_data_type`` as a dtype (None: the dtype of what is reduced)."""
    return COMM_DTYPES.get(str(cfg.communication_data_type or "").lower())


@dataclass(frozen=True)
class PartitionedOptions:
    """Settings of :class:`~zero_core.zero.stage_1_and_2.PartitionedOptimizerStrategy` (stages 1, 2)."""

    stage: int
    dtype: torch.dtype
    reduce_bucket_size: int
    allgather_bucket_size: int
    allgather_partitions: bool
    overlap_comm: bool
    contiguous_gradients: bool
    reduce_scatter: bool
    use_multi_rank_bucket_allreduce: bool
    round_robin_gradients: bool
    ignore_unused_parameters: bool
    comm_dtype: torch.dtype | None
    accum_dtype: torch.dtype | None
    master_dtype: torch.dtype  # See [Note: bf16 master weights]

    @classmethod
    def from_config(cls, cfg: ZeroConfig, *, pipeline: bool = False) -> PartitionedOptions:
        zc = cfg.zero_optimization
        return cls(
            stage=int(zc.stage),
            dtype=compute_dtype(cfg),
            reduce_bucket_size=int(zc.reduce_bucket_size),
            allgather_bucket_size=int(zc.allgather_bucket_size),
            allgather_partitions=bool(zc.allgather_partitions),
            overlap_comm=False if pipeline else bool(zc.overlap_comm),
            contiguous_gradients=bool(zc.contiguous_gradients),
            reduce_scatter=bool(zc.reduce_scatter),
            use_multi_rank_bucket_allreduce=bool(zc.use_multi_rank_bucket_allreduce),
            round_robin_gradients=bool(zc.round_robin_gradients),
            ignore_unused_parameters=bool(zc.ignore_unused_parameters),
            comm_dtype=comm_dtype(cfg),
            accum_dtype=accum_dtype(cfg),
            master_dtype=master_dtype(cfg),
        )


@dataclass(frozen=True)
class Stage3Options:
    """Settings of :class:`~zero_core.zero.stage3.strategy.Stage3Strategy`."""

    dtype: torch.dtype
    prefetch_bucket_size: int
    param_persistence_threshold: int
    model_persistence_threshold: int
    max_live_parameters: int
    max_reuse_distance: int
    gather_16bit_weights_on_model_save: bool
    reduce_bucket_size: int
    overlap_comm: bool
    offload_ratio: float
    comm_dtype: torch.dtype | None
    masters: bool
    quantized_weights: bool  # ZeRO++ qwZ
    quantized_nontrainable_weights: bool
    quantized_gradients: bool  # ZeRO++ qgZ
    accum_dtype: torch.dtype | None
    module_granularity_threshold: int  # See [Note: module granularity threshold]
    use_all_reduce_for_fetch_params: bool  # See [Note: all-reduce fetch]
    master_dtype: torch.dtype  # See [Note: bf16 master weights]

    @classmethod
    def from_config(cls, cfg: ZeroConfig, *, eval_only: bool = False) -> Stage3Options:
        zc = cfg.zero_optimization
        return cls(
            dtype=compute_dtype(cfg),
            prefetch_bucket_size=int(zc.prefetch_bucket_size),
            param_persistence_threshold=int(zc.param_persistence_threshold),
            model_persistence_threshold=int(zc.model_persistence_threshold),
            max_live_parameters=int(zc.max_live_parameters),
            max_reuse_distance=int(zc.max_reuse_distance),
            gather_16bit_weights_on_model_save=bool(zc.gather_16bit_weights_on_model_save),
            reduce_bucket_size=int(zc.reduce_bucket_size),
            overlap_comm=bool(zc.overlap_comm),
            offload_ratio=float(zc.offload_optimizer.ratio) if zc.offload_optimizer is not None else 1.0,
            comm_dtype=comm_dtype(cfg),
            masters=not eval_only,
            quantized_weights=bool(zc.zero_quantized_weights),
            quantized_nontrainable_weights=bool(zc.zero_quantized_nontrainable_weights),
            quantized_gradients=bool(zc.zero_quantized_gradients),
            accum_dtype=accum_dtype(cfg),
            module_granularity_threshold=int(zc.module_granularity_threshold),
            use_all_reduce_for_fetch_params=bool(zc.use_all_reduce_for_fetch_params),
            master_dtype=master_dtype(cfg),
        )
