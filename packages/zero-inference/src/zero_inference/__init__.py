"""zero-inference: DeepSpeed-style inference engine (``init_inference``).

Tensor parallelism (automatic or by ``injection_policy``), fused kernel injection for GPT-2,
Llama and BERT, weight-only int8, checkpoint loading sharded per rank (HF safetensors, zero
training checkpoints, re-sliced TP checkpoints), expert parallelism for zero-moe layers, and
ZeRO-Inference with CPU or NVMe offload.
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
from zero_inference.fused_encoder import FusedBertEncoder
from zero_inference.moe_inference import shard_experts
from zero_inference.quantize import QuantizedLinear, dequantize_weight, quantize_weight
from zero_inference.tp_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from zero_inference.version import __version__
from zero_inference.zero_checkpoint_source import ZeroCheckpointSource


def __getattr__(name: str) -> object:
    # The NVMe store is zero-offload's (See [Note: NVMe offload backend] there): found when installed.
    if name == "NvmeOffloadBackend":
        from zero_core.plugins import require

        return require("zero_offload.backends", "zero_inference.NvmeOffloadBackend").NvmeOffloadBackend
    raise AttributeError(f"module 'zero_inference' has no attribute {name!r}")


__all__ = [
    "ColumnParallelLinear",
    "DeepSpeedInferenceConfig",
    "DeepSpeedMoEConfig",
    "DeepSpeedTPConfig",
    "FusedBertEncoder",
    "InferenceCheckpointConfig",
    "InferenceConfig",
    "InferenceEngine",
    "NvmeOffloadBackend",
    "QuantizationConfig",
    "QuantizedLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ZeroCheckpointSource",
    "__version__",
    "dequantize_weight",
    "empty_model",
    "init_inference",
    "load_inference_config",
    "quantize_weight",
    "shard_experts",
]
