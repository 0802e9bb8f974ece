"""Kernel injection for BERT-style encoders: fused SDPA attention and fused bias+activation.

[Note: fused encoder injection]
For BERT-family models (``model_type`` bert, roberta) ``replace_with_kernel_inject`` swaps the
model's encoder (``model.<base>.encoder``) for :class:`FusedBertEncoder`, which runs every
``BertLayer`` as

* q, k, v projections, then one ``torch.nn.functional.scaled_dot_product_attention`` call with
  the model's own (already expanded) attention mask: a boolean mask, an additive float mask or
  none, as transformers built it, so padding behaves exactly as in the original;
* output projection, residual add and LayerNorm;
* the intermediate projection with bias and activation fused: ``torch.addmm(bias, x, W^T)``
  followed by the activation (in place for relu/silu; GELU has no in-place form). Linears
  that are not plain ``nn.Linear`` (tensor-parallel or int8) run their own forward and the
  activation is still applied in place;
* output projection, residual add and LayerNorm.

Only the encoder is replaced: embeddings, pooler and task heads of any ``Bert*`` model run
unchanged, and the fused layers read the original modules, so tensor parallelism (head counts
come from the local projection sizes) and int8 compose with it. Decoder configurations
(``is_decoder``, cross-attention) keep the original path and raise a clear error instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    import transformers

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda t: F.gelu(t, approximate="tanh"),
    "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": lambda t: t.relu_(),
    "silu": lambda t: F.silu(t, inplace=True),
}


def _bias_act(
    linear: nn.Module, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``act(linear(x))`` with the bias folded into the matmul (``addmm``)."""
    if type(linear) is nn.Linear and linear.bias is not None:
        flat = x.reshape(-1, x.shape[-1])
        y = torch.addmm(linear.bias, flat, linear.weight.t()).view(*x.shape[:-1], -1)
    else:
        y = linear(x)
    return act(y)


class FusedBertEncoder(nn.Module):
    """Drop-in for ``BertEncoder`` (same call and output). See [Note: fused encoder injection]."""

    def __init__(self, encoder: nn.Module, config: transformers.PretrainedConfig) -> None:
        super().__init__()
        if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
            raise ValueError(
                "kernel injection: BERT configured as a decoder (is_decoder / add_cross_attention) is not "
                "supported by the fused encoder; use replace_with_kernel_inject=False"
            )
        act_name = getattr(config, "hidden_act", "gelu")
        if not isinstance(act_name, str) or act_name not in _ACTIVATIONS:
            raise ValueError(
                f"kernel injection: BERT activation {act_name!r} is not supported; "
                f"supported: {sorted(_ACTIVATIONS)}"
            )
        self.act = _ACTIVATIONS[act_name]
        self.layer = encoder.layer  # the original layers: weights are shared, not copied
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.eps = config.layer_norm_eps

    def _layer(self, layer: nn.Module, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        sa = layer.attention.self
        b, t = h.shape[:2]
        q = sa.query(h).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = sa.key(h).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = sa.value(h).view(b, t, -1, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sa.scaling)
        o = o.transpose(1, 2).reshape(b, t, -1)
        so = layer.attention.output
        h = so.LayerNorm(so.dense(o) + h)
        m = _bias_act(layer.intermediate.dense, h, self.act)
        out = layer.output
        return out.LayerNorm(out.dense(m) + h)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

        if encoder_hidden_states is not None or past_key_values is not None:
            raise TypeError(
                "kernel-injected BERT encoder does not take encoder_hidden_states or past_key_values"
            )
        mask = attention_mask
        if mask is not None and mask.dtype != torch.bool and mask.dtype != hidden_states.dtype:
            mask = mask.to(hidden_states.dtype)
        h = hidden_states
        for layer in self.layer:
            h = self._layer(layer, h, mask)
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=h)


_BASES = ("bert", "roberta")


def inject_encoder(model: nn.Module) -> nn.Module:
    """Swap ``model``'s encoder for :class:`FusedBertEncoder` in place; returns ``model``."""
    base = model
    for attr in _BASES:
        if hasattr(model, attr) and hasattr(getattr(model, attr), "encoder"):
            base = getattr(model, attr)
            break
    encoder = getattr(base, "encoder", None)
    if encoder is None or not hasattr(encoder, "layer"):
        raise ValueError(
            f"kernel injection: {type(model).__name__} has no BERT encoder (.encoder.layer) to replace"
        )
    if not isinstance(encoder, FusedBertEncoder):
        base.encoder = FusedBertEncoder(encoder, model.config)
    return model
