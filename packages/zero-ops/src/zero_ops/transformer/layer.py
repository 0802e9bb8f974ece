"""TransformerLayer: a fused BERT encoder layer (DeepSpeed's DeepSpeedTransformerLayer) in torch.

[Note: fused transformer layer]
DeepSpeed's layer is a set of CUDA kernels; this one is torch ops arranged to do less work than
Hugging Face's ``BertLayer`` wherever torch runs:

- one GEMM for Q, K and V (``attn_qkvw`` is the three weights stacked), and every projection is
  an ``addmm`` on the (batch*seq, hidden) matrix, so bias adds are fused into the GEMM and no
  3-D reshapes are copied;
- attention runs in ``scaled_dot_product_attention`` (no materialised probabilities) whenever
  no attention dropout output has to be kept: eval, ``attn_dropout_ratio=0``, or
  ``stochastic_mode`` (dropout inside the fused kernel, from its own random stream);
- otherwise (training with attention dropout, the deterministic mode) the probabilities are
  materialised and dropout masks are drawn as ``torch.nn.functional.dropout`` draws them, in
  ``BertLayer``'s order, so a model trains on the same masks as Hugging Face's eager BERT;
- dropout masks are kept as 1-byte bools; the memory switches swap pieces for the Functions of
  [Note: transformer memory switches].

Parameters keep DeepSpeed's names. ``attn_n*`` is the LayerNorm at the attention's residual
(after it in post-LN, before the FFN in pre-LN); ``norm_*`` is the other one (the layer's
output LayerNorm in post-LN, the one before attention in pre-LN).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from zero_ops.transformer.config import TransformerConfig
from zero_ops.transformer.functions import (
    DropoutMatmul,
    GeluLinear,
    InvertibleLayerNorm,
    apply_mask,
    keep_mask,
)
from zero_ops.transformer.masks import attention_bias

_WHERE = "TransformerLayer"
# parameter names in DeepSpeed's initial_weights / initial_biases order (Q, K, V stacked in the first)
_WEIGHTS = ("attn_qkvw", "attn_ow", "attn_nw", "inter_w", "output_w", "norm_w")
_BIASES = ("attn_qkvb", "attn_ob", "attn_nb", "inter_b", "output_b", "norm_b")


def _shapes(h: int, i: int) -> dict[str, tuple[int, ...]]:
    return {
        "attn_qkvw": (3 * h, h),
        "attn_qkvb": (3 * h,),
        "attn_ow": (h, h),
        "attn_ob": (h,),
        "attn_nw": (h,),
        "attn_nb": (h,),
        "inter_w": (i, h),
        "inter_b": (i,),
        "output_w": (h, i),
        "output_b": (h,),
        "norm_w": (h,),
        "norm_b": (h,),
    }


class TransformerLayer(nn.Module):
    """A BERT encoder layer, pre-LN or post-LN (DeepSpeed's ``DeepSpeedTransformerLayer``).

    ``initial_weights`` / ``initial_biases`` (DeepSpeed's order: query, key, value, attention
    output, attention LayerNorm, intermediate, output, output LayerNorm; eight tensors each)
    copy given values instead of the initialisation. The class attribute ``layer_id`` counts the
    layers built; each layer's own ``layer_id`` is its index. See [Note: fused transformer layer].
    """

    layer_id = 0

    def __init__(
        self,
        config: TransformerConfig,
        initial_weights: Sequence[torch.Tensor] | None = None,
        initial_biases: Sequence[torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"{_WHERE}: config must be a TransformerConfig, got {type(config).__name__}")
        config.require(
            "hidden_size", "heads", "attn_dropout_ratio", "hidden_dropout_ratio", why="to build a layer"
        )
        self.config = config
        self.layer_id = TransformerLayer.layer_id
        TransformerLayer.layer_id += 1
        device = self._device(config)
        h, i = config.hidden_size, config.intermediate_size
        for name, shape in _shapes(h, i).items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=config.dtype, device=device)))
        if (initial_weights is None) != (initial_biases is None):
            raise ValueError(f"{_WHERE}: give both initial_weights and initial_biases, or neither")
        if initial_weights is None:
            self.init_transformer_weights(config.adjust_init_range)
        else:
            self._copy_initial(initial_weights, initial_biases)
        self.generator = None
        if config.seed >= 0:  # DeepSpeed seeds each layer's dropout stream with the config's seed
            self.generator = torch.Generator(device=device).manual_seed(config.seed)
        self.train(config.training)

    @staticmethod
    def _device(config: TransformerConfig) -> torch.device | None:
        if config.local_rank >= 0 and torch.cuda.is_available():
            return torch.device("cuda", config.local_rank)
        return None  # torch's default device

    def init_transformer_weights(self, adjust_init_range: bool = False) -> None:
        """BERT's initialisation: normal(0, initializer_range) weights, zero biases, unit
        LayerNorm; with ``adjust_init_range`` the two projections that feed the residual
        stream use ``initializer_range / sqrt(2 * num_hidden_layers)``."""
        cfg = self.config
        cfg.require("initializer_range", why="to initialise the weights (or pass initial_weights)")
        std = out_std = cfg.initializer_range
        if adjust_init_range:
            cfg.require("num_hidden_layers", why="for adjust_init_range=True")
            out_std = cfg.initializer_range / math.sqrt(2.0 * cfg.num_hidden_layers)
        with torch.no_grad():
            for name in ("attn_qkvw", "inter_w"):
                getattr(self, name).normal_(0.0, std)
            for name in ("attn_ow", "output_w"):
                getattr(self, name).normal_(0.0, out_std)
            for name in ("attn_nw", "norm_w"):
                getattr(self, name).fill_(1.0)
            for name in _BIASES:
                getattr(self, name).zero_()

    def _copy_initial(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor]) -> None:
        for what, given in (("initial_weights", weights), ("initial_biases", biases)):
            if len(given) != 8 or not all(isinstance(t, torch.Tensor) for t in given):
                raise ValueError(
                    f"{_WHERE}: {what} must be 8 tensors (query, key, value, attention output, attention "
                    f"LayerNorm, intermediate, output, output LayerNorm), got {len(given)} items"
                )
        shapes = _shapes(self.config.hidden_size, self.config.intermediate_size)
        with torch.no_grad():
            for names, given in ((_WEIGHTS, weights), (_BIASES, biases)):
                values = [torch.cat([t.detach() for t in given[:3]]), *given[3:]]
                for name, value in zip(names, values, strict=True):
                    if tuple(value.shape) != shapes[name]:
                        raise ValueError(
                            f"{_WHERE}: initial value for {name} has shape {tuple(value.shape)}, "
                            f"expected {shapes[name]} (hidden_size={self.config.hidden_size}, "
                            f"intermediate_size={self.config.intermediate_size})"
                        )
                    getattr(self, name).copy_(value)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *args: object,
        **kwargs: object,
    ) -> torch.Tensor | tuple[torch.Tensor]:
        """``hidden_states`` (batch, seq, hidden); ``attention_mask`` as BERT passes it: an
        additive mask broadcastable to (batch, heads, seq, seq) (``get_extended_attention_mask``),
        a bool mask of the same shapes (True = attend), or a (batch, seq) 0/1 padding mask.
        Further arguments Hugging Face's encoders pass (encoder states, caches, head masks,
        ``output_attentions``) must be unset (None/False): the layer is a self-attention
        encoder layer. Returns the output, or ``(output,)`` with ``return_tuple``."""
        self._check_unused(args, kwargs)
        self._check_input(hidden_states)
        self._check_replay()
        b, s, h = hidden_states.shape
        bias = attention_bias(attention_mask, b, s, hidden_states.dtype, _WHERE)
        out = self._layer(hidden_states.reshape(b * s, h), bias, b, s).view(b, s, h)
        return (out,) if self.config.return_tuple else out

    def _layer(self, x: torch.Tensor, bias: torch.Tensor | None, b: int, s: int) -> torch.Tensor:
        cfg = self.config
        if cfg.pre_layer_norm:
            a = x + self._hidden_dropout(self._attention(self._norm(x, "norm_"), bias, b, s))
            return a + self._hidden_dropout(self._ffn(self._norm(a, "attn_n")))
        a = self._norm(x + self._hidden_dropout(self._attention(x, bias, b, s)), "attn_n")
        return self._norm(a + self._hidden_dropout(self._ffn(a)), "norm_")

    def _norm(self, x: torch.Tensor, which: str) -> torch.Tensor:
        w, bb = getattr(self, which + "w"), getattr(self, which + "b")
        if self.config.normalize_invertible:
            return InvertibleLayerNorm.apply(x, w, bb, self.config.layer_norm_eps)
        return F.layer_norm(x, (x.shape[-1],), w, bb, self.config.layer_norm_eps)

    def _check_replay(self) -> None:
        """A forward run inside backward is an activation-checkpointing recompute: with a seed
        the layer's own generator has moved on, so the masks would differ from the forward's
        and the gradients would be wrong. Say so instead."""
        cfg = self.config
        dropout = cfg.attn_dropout_ratio > 0 or cfg.hidden_dropout_ratio > 0
        if (
            self.generator is not None
            and self.training
            and dropout
            and torch._C._current_graph_task_id() != -1
        ):
            raise RuntimeError(
                f"{_WHERE}: recomputed inside backward (activation checkpointing) with seed={cfg.seed}: the "
                "layer's own dropout generator cannot be replayed. Use seed=-1 (the global generator, "
                "which checkpointing restores) with activation checkpointing."
            )

    def _hidden_dropout(self, x: torch.Tensor) -> torch.Tensor:
        p = self.config.hidden_dropout_ratio
        if not self.training or p == 0:
            return x
        return apply_mask(x, keep_mask(x, p, self.generator), p)

    def _attention(self, x: torch.Tensor, bias: torch.Tensor | None, b: int, s: int) -> torch.Tensor:
        cfg = self.config
        n, h = cfg.heads, cfg.hidden_size
        qkv = torch.addmm(self.attn_qkvb, x, self.attn_qkvw.t())
        q, k, v = qkv.view(b, s, 3, n, h // n).permute(2, 0, 3, 1, 4).unbind(0)
        p = cfg.attn_dropout_ratio if self.training else 0.0
        if p == 0 or cfg.stochastic_mode:
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)).mul_(1.0 / math.sqrt(h // n))
            if bias is not None:
                scores.add_(bias)
            probs = torch.softmax(scores, dim=-1)
            keep = keep_mask(probs, p, self.generator)
            if cfg.attn_dropout_checkpoint:
                # v is a strided view of the QKV buffer: a compact copy is what matmul would save
                ctx = DropoutMatmul.apply(probs, v.contiguous(), keep, p)
            else:
                ctx = torch.matmul(apply_mask(probs, keep, p), v)
        ctx = ctx.transpose(1, 2).reshape(b * s, h)
        return torch.addmm(self.attn_ob, ctx, self.attn_ow.t())

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        u = torch.addmm(self.inter_b, x, self.inter_w.t())
        if self.config.gelu_checkpoint:
            return GeluLinear.apply(u, self.output_w, self.output_b)
        return torch.addmm(self.output_b, F.gelu(u), self.output_w.t())

    # ------------------------------------------------------------------ checks
    def _check_unused(self, args: tuple, kwargs: dict[str, Any]) -> None:
        named = [(f"positional argument {i + 3}", v) for i, v in enumerate(args)] + list(kwargs.items())
        for name, value in named:
            if value is not None and value is not False:
                raise ValueError(
                    f"{_WHERE}.forward: {name} is not supported by the fused layer (a BERT encoder "
                    f"layer: self-attention only, no head mask, cross-attention, cache or attention "
                    f"output); got {name}={value!r}"
                )

    def _check_input(self, x: torch.Tensor) -> None:
        cfg = self.config
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != cfg.hidden_size:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{_WHERE}.forward: hidden_states must be a (batch, seq, {cfg.hidden_size}) tensor, got {shape}"
            )
        if x.dtype != self.attn_qkvw.dtype:
            raise TypeError(
                f"{_WHERE}.forward: hidden_states are {x.dtype} but the layer's parameters are "
                f"{self.attn_qkvw.dtype}; cast one to the other (config fp16/bf16 choose the layer's dtype)"
            )
        if cfg.batch_size > 0 and x.shape[0] > cfg.batch_size:
            raise ValueError(
                f"{_WHERE}.forward: batch of {x.shape[0]} exceeds the config's batch_size {cfg.batch_size} "
                f"(the largest batch the layer is configured for)"
            )

    def extra_repr(self) -> str:
        cfg = self.config
        ln = "pre-LN" if cfg.pre_layer_norm else "post-LN"
        return (
            f"layer_id={self.layer_id}, hidden={cfg.hidden_size}, heads={cfg.heads}, {ln}, dtype={cfg.dtype}"
        )


DeepSpeedTransformerLayer = TransformerLayer
