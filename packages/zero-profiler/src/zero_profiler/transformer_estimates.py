"""Transformer shapes -> parameter counts and activation memory, without building the model.

[Note: activation memory of a transformer layer]
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022),
count the bytes a standard pre-LN transformer layer keeps for backward, with 16-bit activations,
sequence length ``s``, micro-batch ``b``, hidden size ``h`` and ``a`` heads:

* attention block: ``11sbh + 5as^2b`` (QKV input 2sbh, Q and K 4sbh, softmax output 2as^2b,
  its dropout mask as^2b, dropout output 2as^2b, V 2sbh, output-projection input 2sbh, its
  dropout mask sbh);
* MLP block: ``19sbh`` (input 2sbh, 4h intermediate 8sbh, GeLU output 8sbh, dropout mask sbh);
* two layer norms: ``4sbh``.

Total ``sbh(34 + 5as/h)`` per layer. With tensor parallelism of degree ``t`` (no sequence
parallelism) it is ``sbh(10 + 24/t + 5as/(ht))``: layer-norm inputs, the QKV and MLP inputs and
the two output dropout masks (10sbh) are replicated, the rest is split. Without dropout the two
sbh masks, the softmax dropout mask (as^2b) and the dropout output (2as^2b) go: ``8sbh`` replicated,
``24sbh + 2as^2b`` split. A fused attention kernel (flash) keeps no ``s^2`` term. Full activation
checkpointing keeps only each layer's 16-bit input (``2sbh``) plus one layer's activations
while that layer is recomputed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TransformerShape:
    """The sizes the estimates need; built directly or from a Hugging Face ``config.json``."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    intermediate_size: int
    num_key_value_heads: int
    max_position_embeddings: int = 0  # > 0 only for learned absolute position embeddings
    gated_mlp: bool = False  # SwiGLU-style (three matrices) as in LLaMA
    tie_word_embeddings: bool = True
    bias: bool = True  # linear layers carry biases (GPT-2) or not (LLaMA)
    norm_has_bias: bool = True  # LayerNorm (weight + bias) or RMSNorm (weight only)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TransformerShape: {name} must be an int >= 1, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"TransformerShape: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"TransformerShape: num_key_value_heads must divide num_attention_heads, got {self.num_key_value_heads}"
            )

    def layer_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        kv = self.num_key_value_heads * (h // self.num_attention_heads)
        attn = h * h + 2 * h * kv + h * h
        mlp = (3 if self.gated_mlp else 2) * h * i
        biases = (h + 2 * kv + h + i + h) if self.bias else 0
        if self.bias and self.gated_mlp:
            biases += i
        norms = 2 * (2 * h if self.norm_has_bias else h)
        return attn + mlp + biases + norms

    def total_params(self) -> int:
        h = self.hidden_size
        embed = self.vocab_size * h + self.max_position_embeddings * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        final_norm = 2 * h if self.norm_has_bias else h
        return embed + head + final_norm + self.num_layers * self.layer_params()

    def largest_layer_params(self) -> int:
        """Largest single module's own parameters: the embedding table or the widest matrix."""
        h, i = self.hidden_size, self.intermediate_size
        return max(self.vocab_size * h, h * i + (i if self.bias else 0), h * h)


def shape_from_hf_config(config: dict[str, Any] | str | os.PathLike) -> TransformerShape:
    """A :class:`TransformerShape` from a Hugging Face config dict or ``config.json`` path.

    Understands GPT-2 style (``n_embd``, ``n_layer``, ``n_head``, ``n_inner``, ``n_positions``)
    and LLaMA/Mistral/Qwen style (``hidden_size``, ``num_hidden_layers``, ``intermediate_size``,
    ``num_key_value_heads``, RMSNorm, SwiGLU, no biases) keys.
    """
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"shape_from_hf_config: expected a dict or a path, got {type(config).__name__}")

    def pick(*keys: str, default: Any = None) -> Any:
        for key in keys:
            if config.get(key) is not None:
                return config[key]
        if default is None:
            raise ValueError(f"shape_from_hf_config: config has none of the keys {keys}")
        return default

    model_type = str(config.get("model_type", ""))
    hidden = pick("hidden_size", "n_embd", "d_model")
    heads = pick("num_attention_heads", "n_head")
    llama_like = (
        model_type in {"llama", "mistral", "qwen2", "qwen3", "gemma", "mixtral"}
        or "num_key_value_heads" in config
    )
    learned_positions = model_type in {"gpt2", "gpt_neo", "opt", "bert"} or "n_positions" in config
    return TransformerShape(
        vocab_size=pick("vocab_size"),
        hidden_size=hidden,
        num_layers=pick("num_hidden_layers", "n_layer", "num_layers"),
        num_attention_heads=heads,
        intermediate_size=pick("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden),
        num_key_value_heads=pick("num_key_value_heads", default=heads),
        max_position_embeddings=pick("n_positions", "max_position_embeddings") if learned_positions else 0,
        gated_mlp=llama_like,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", not llama_like)),
        bias=bool(config.get("attention_bias", config.get("bias", not llama_like))),
        norm_has_bias=not llama_like,
    )


def estimate_transformer_activation_mem(
    hidden_size: int,
    num_layers: int,
    num_attention_heads: int,
    seq_length: int,
    micro_batch_size: int,
    tensor_parallel_size: int = 1,
    dropout: bool = True,
    flash_attention: bool = False,
    activation_checkpointing: bool = False,
) -> int:
    """Activation bytes per GPU kept for backward by ``num_layers`` transformer layers (16-bit).

    See [Note: activation memory of a transformer layer]. ``flash_attention`` drops the
    ``s^2`` terms (the fused kernel keeps no score matrix); ``activation_checkpointing`` keeps
    each layer's input and one layer's activations during its recomputation.
    """
    where = "estimate_transformer_activation_mem"
    for name, value in (
        ("hidden_size", hidden_size),
        ("num_layers", num_layers),
        ("num_attention_heads", num_attention_heads),
        ("seq_length", seq_length),
        ("micro_batch_size", micro_batch_size),
        ("tensor_parallel_size", tensor_parallel_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {name} must be an int >= 1, got {value!r}")
    s, b, h, a, t = seq_length, micro_batch_size, hidden_size, num_attention_heads, tensor_parallel_size
    sbh = s * b * h
    if dropout:
        replicated, split, scores = 10 * sbh, 24 * sbh, 5 * a * s * s * b
    else:
        replicated, split, scores = 8 * sbh, 24 * sbh, 2 * a * s * s * b
    if flash_attention:
        scores = 0
    per_layer = replicated + (split + scores) // t
    if activation_checkpointing:
        return num_layers * 2 * sbh + per_layer
    return num_layers * per_layer
