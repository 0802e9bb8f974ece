"""zero-inference: DeepSpeed-style inference engine (``init_inference``).

Tensor parallelism (automatic or by ``injection_policy``), fused kernel injection for GPT-2 and
Llama, weight-only int8, checkpoint loading sharded per rank, and ZeRO-Inference.
"""

from zero_inference.checkpoint_loading import empty_model
from zero_inference.config import (
    DeepSpeedInferenceConfig,
    DeepSpeedMoEConfig,
    DeepSpeedTPConfig,
    InferenceCheckpointConfig,
    InferenceConfig,
    QuantizationConfig,
    load_inference_config,
)
from zero_inference.engine import InferenceEngine, init_inference
from zero_inference.quantize import QuantizedLinear, dequantize_weight, quantize_weight
from zero_inference.tp_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from zero_inference.version import __version__

__all__ = [
    "ColumnParallelLinear",
    "DeepSpeedInferenceConfig",
    "DeepSpeedMoEConfig",
    "DeepSpeedTPConfig",
    "InferenceCheckpointConfig",
    "InferenceConfig",
    "InferenceEngine",
    "QuantizationConfig",
    "QuantizedLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "__version__",
    "dequantize_weight",
    "empty_model",
    "init_inference",
    "load_inference_config",
    "quantize_weight",
]
