"""Swap Hugging Face BERT's ``BertLayer`` modules for the fused layer and back, same weights.

What DeepSpeed's BERT pre-training example does with its kernel, as two functions: train with
fused layers, then :func:`revert_bert_layers` so ``save_pretrained`` writes the Hugging Face
layout. ``transformers`` is imported only when these are called (zero-ops does not depend on it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from zero_ops.transformer.config import TransformerConfig
from zero_ops.transformer.layer import TransformerLayer

if TYPE_CHECKING:
    import transformers

_WHERE = "replace_bert_layers"


def _bert_layer_class() -> type:
    try:
        from transformers.models.bert.modeling_bert import BertLayer
    except ImportError as e:  # pragma: no cover - exercised only without transformers
        raise ImportError(
            "replace_bert_layers / revert_bert_layers need transformers: pip install transformers"
        ) from e
    return BertLayer


def _returns_tuple() -> bool:
    """Before transformers 5, BertLayer returned a tuple; since, a tensor."""
    import transformers

    return int(transformers.__version__.split(".")[0]) < 5


def config_from_bert(
    hf_config: transformers.PretrainedConfig, dtype: torch.dtype, **overrides: object
) -> TransformerConfig:
    """The fused layer's config for a Hugging Face ``BertConfig`` (post-LN, as BERT is)."""
    if getattr(hf_config, "hidden_act", "gelu") != "gelu":
        raise ValueError(
            f"{_WHERE}: the fused layer uses exact (erf) GELU, BERT's 'gelu'; this model's hidden_act is "
            f"{hf_config.hidden_act!r}"
        )
    if getattr(hf_config, "is_decoder", False) or getattr(hf_config, "add_cross_attention", False):
        raise ValueError(
            f"{_WHERE}: the fused layer is an encoder layer; this BERT is a decoder / has cross-attention"
        )
    values = dict(
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        heads=hf_config.num_attention_heads,
        attn_dropout_ratio=float(hf_config.attention_probs_dropout_prob),
        hidden_dropout_ratio=float(hf_config.hidden_dropout_prob),
        num_hidden_layers=hf_config.num_hidden_layers,
        initializer_range=float(hf_config.initializer_range),
        layer_norm_eps=float(hf_config.layer_norm_eps),
        pre_layer_norm=False,
        fp16=dtype == torch.float16,
        bf16=dtype == torch.bfloat16,
        return_tuple=_returns_tuple(),
    )
    values.update(overrides)
    return TransformerConfig(**values)


def _weights_of(layer: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    att, inter, out = layer.attention, layer.intermediate, layer.output
    mods = [att.self.query, att.self.key, att.self.value, att.output.dense, att.output.LayerNorm]
    mods += [inter.dense, out.dense, out.LayerNorm]
    return [m.weight for m in mods], [m.bias for m in mods]


def _children_of_type(model: nn.Module, cls: type) -> list[tuple[nn.Module, str, nn.Module]]:
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, cls):
                found.append((parent, name, child))
    return found


def replace_bert_layers(model: nn.Module, **overrides: object) -> nn.Module:
    """Replace every ``BertLayer`` in ``model`` (in place) with a :class:`TransformerLayer`
    holding the same weights; returns ``model``.

    ``overrides`` set config fields (``normalize_invertible=True``, ``stochastic_mode=True``,
    ...). The model's Hugging Face config must be reachable as ``model.config``.
    """
    bert_layer = _bert_layer_class()
    hf_config = getattr(model, "config", None)
    if hf_config is None:
        raise ValueError(f"{_WHERE}: model has no .config (expected a transformers BERT model)")
    found = _children_of_type(model, bert_layer)
    if not found:
        raise ValueError(f"{_WHERE}: no BertLayer found in {type(model).__name__}")
    for parent, name, old in found:
        weights, biases = _weights_of(old)
        dtype, device = weights[0].dtype, weights[0].device
        config = config_from_bert(hf_config, dtype, **overrides)
        with torch.device(device):
            new = TransformerLayer(config, initial_weights=weights, initial_biases=biases)
        if new.attn_qkvw.dtype != dtype:  # e.g. float64, which no config flag names: copy again, exactly
            new.to(dtype)._copy_initial(weights, biases)
        new.hf_layer_idx = getattr(old.attention.self, "layer_idx", None)
        new.train(old.training)
        setattr(parent, name, new)
    return model


def _bert_layer(bert_layer: type, hf_config: transformers.PretrainedConfig, idx: int | None) -> nn.Module:
    try:
        return bert_layer(hf_config, layer_idx=idx)
    except TypeError:  # transformers versions without layer_idx
        return bert_layer(hf_config)


def revert_bert_layers(model: nn.Module) -> nn.Module:
    """Replace every :class:`TransformerLayer` in ``model`` (in place) with a Hugging Face
    ``BertLayer`` holding the same weights, so ``save_pretrained`` writes BERT's layout;
    returns ``model``."""
    bert_layer = _bert_layer_class()
    hf_config = getattr(model, "config", None)
    if hf_config is None:
        raise ValueError("revert_bert_layers: model has no .config (expected a transformers BERT model)")
    found = _children_of_type(model, TransformerLayer)
    if not found:
        raise ValueError(f"revert_bert_layers: no TransformerLayer found in {type(model).__name__}")
    for parent, name, fused in found:
        if fused.config.pre_layer_norm:
            raise ValueError(
                "revert_bert_layers: a pre-LN layer has no BertLayer equivalent (BERT is post-LN)"
            )
        h = fused.config.hidden_size
        with torch.device(fused.attn_qkvw.device):
            old = _bert_layer(bert_layer, hf_config, getattr(fused, "hf_layer_idx", None))
        old.to(fused.attn_qkvw.dtype)
        weights, biases = _weights_of(old)
        fw = [
            *fused.attn_qkvw.split(h),
            fused.attn_ow,
            fused.attn_nw,
            fused.inter_w,
            fused.output_w,
            fused.norm_w,
        ]
        fb = [
            *fused.attn_qkvb.split(h),
            fused.attn_ob,
            fused.attn_nb,
            fused.inter_b,
            fused.output_b,
            fused.norm_b,
        ]
        with torch.no_grad():
            for dst, src in zip(weights + biases, fw + fb, strict=True):
                dst.copy_(src)
        old.train(fused.training)
        setattr(parent, name, old)
    return model
