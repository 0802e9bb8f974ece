"""Fused BERT transformer layer (``zero.ops.transformer``; DeepSpeed's ``deepspeed.ops.transformer``).

- :class:`TransformerConfig` (alias ``DeepSpeedTransformerConfig``) and
  :class:`TransformerLayer` (alias ``DeepSpeedTransformerLayer``): DeepSpeed's transformer
  kernel API, in torch ops that run on any device (see [Note: fused transformer layer]).
- :func:`replace_bert_layers` / :func:`revert_bert_layers`: swap the ``BertLayer`` modules of a
  Hugging Face BERT model for fused layers carrying the same weights, and back.
- :func:`stated_savings`, :func:`saved_bytes`, :func:`layer_saved_bytes`: the activation bytes
  each memory switch saves, stated and measured.
"""

from zero_ops.transformer.config import DeepSpeedTransformerConfig, TransformerConfig
from zero_ops.transformer.hf_bert import replace_bert_layers, revert_bert_layers
from zero_ops.transformer.layer import DeepSpeedTransformerLayer, TransformerLayer
from zero_ops.transformer.memory import SWITCHES, layer_saved_bytes, saved_bytes, stated_savings

__all__ = [
    "SWITCHES",
    "DeepSpeedTransformerConfig",
    "DeepSpeedTransformerLayer",
    "TransformerConfig",
    "TransformerLayer",
    "layer_saved_bytes",
    "replace_bert_layers",
    "revert_bert_layers",
    "saved_bytes",
    "stated_savings",
]
