"""zero-profiler: an exact flops profiler and ZeRO memory estimators for plain PyTorch.

Depends on torch only. The training engine of zero-core drives :class:`StepProfiler` when the
``flops_profiler`` config section is enabled. ``zero_profiler.autotuning`` (the autotuner of
``zero run --autotuning``) is the ``autotuning`` extra: it needs zero-core, and is not imported here.
"""

from zero_profiler.engine_hook import FlopsProfilerConfig, StepProfiler
from zero_profiler.memory_estimators import (
    MemoryEstimate,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    zero_paper_model_states_bytes,
)
from zero_profiler.profiler import FlopsProfiler, get_model_profile
from zero_profiler.transformer_estimates import (
    TransformerShape,
    estimate_transformer_activation_mem,
    shape_from_hf_config,
)
from zero_profiler.version import __version__

__all__ = [
    "FlopsProfiler",
    "FlopsProfilerConfig",
    "MemoryEstimate",
    "StepProfiler",
    "TransformerShape",
    "__version__",
    "estimate_transformer_activation_mem",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "get_model_profile",
    "shape_from_hf_config",
    "zero_paper_model_states_bytes",
]
