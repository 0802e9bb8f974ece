"""Kernel injection: fused decoder paths for recognized causal LMs (GPT-2, Llama); BERT in fused_encoder.py.

[Note: kernel injection]
``replace_with_kernel_inject`` swaps the attention of recognized models for one fused path:
``torch.nn.functional.scaled_dot_product_attention`` over a KV cache preallocated for the
whole generation (``[batch, kv_heads, max_len, head_dim]`` per layer, written in place, no
per-token concatenation and no cache objects), and the MLP for bias+activation fused in one
pass (GPT-2: ``addmm`` then in-place tanh-GELU; Llama: in-place SiLU times up-projection).
The decoder reads the model's own modules (embeddings, norms, linears), so it shares their
weights and composes with tensor parallelism (the linears may be column/row-parallel, head
counts are taken from the local projection sizes) and with int8 (the linears may be
quantized). It runs on CPU and GPU alike. Outputs equal the original model's (tests compare
logits and generated tokens). Unrecognized architectures raise a clear error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zero_inference.fused_encoder import inject_encoder


class InjectedOutput(tuple):
    """Output of the fused path: the tuple ``(logits,)`` (``return_tuple``, DeepSpeed's default),
    with ``.logits`` as in transformers' outputs. ``logits`` is ``[batch, seq, vocab]``."""

    def __new__(cls, logits: torch.Tensor) -> InjectedOutput:
        return super().__new__(cls, (logits,))

    @property
    def logits(self) -> torch.Tensor:
        return self[0]


def _out_features(linear: nn.Module) -> int:
    w = linear.weight
    # HF Conv1D stores [in, out]; nn.Linear and our TP/int8 linears store [out, in].
    return w.shape[1] if type(linear).__name__ == "Conv1D" else w.shape[0]


class _KVCache:
    def __init__(self, layers: int, batch: int, heads: int, max_len: int, head_dim: int, like: torch.Tensor):
        shape = (batch, heads, max_len, head_dim)
        self.k = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(layers)]
        self.v = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(layers)]
        self.length = 0
        self.max_len = max_len


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, past: int, gqa: bool
) -> torch.Tensor:
    """SDPA of ``q [B,H,T,D]`` over ``k/v [B,Hkv,S,D]`` (S = past + T), causal, with optional key padding."""
    t, s = q.shape[2], k.shape[2]
    if key_mask is None or bool(key_mask.all()):
        if past == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=gqa)
        if t == 1:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    qpos = torch.arange(past, past + t, device=q.device)
    allowed = qpos[:, None] >= torch.arange(s, device=q.device)[None, :]
    allowed = allowed[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :s].bool()
    # A fully padded query row (left padding) would give NaN; let it see itself-free zeros instead.
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)


class _FusedCausalLM(nn.Module):
    """Shared driver: full-sequence forward and a cached step function for generation."""

    n_layers: int
    kv_heads: int
    head_dim: int

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> InjectedOutput:
        """Logits of the whole sequence; positions default to ``0..T-1`` as in the HF models' forward."""
        unsupported = {
            k for k, v in kwargs.items() if v is not None and k not in ("use_cache", "return_dict")
        }
        if unsupported:
            raise TypeError(f"kernel-injected forward does not take {sorted(unsupported)}")
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return InjectedOutput(self._run(input_ids, mask, position_ids, None))

    def step_fn(self, batch: int, max_len: int):  # noqa: ANN201 (generation.StepFn)
        def step(
            ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any
        ) -> tuple[torch.Tensor, Any]:
            if cache is None:
                cache = _KVCache(self.n_layers, batch, self.kv_heads, max_len, self.head_dim, self._like())
            logits = self._run(ids, mask, pos, cache, last_only=True)
            return logits[:, -1, :], cache

        return step

    step = step_fn

    def _like(self) -> torch.Tensor:
        for p in self.parameters():
            if p.is_floating_point():
                return p
        raise RuntimeError("model has no floating parameters")

    def _cache_kv(self, cache: _KVCache | None, layer: int, k: torch.Tensor, v: torch.Tensor):  # noqa: ANN202
        if cache is None:
            return k, v, 0
        past, t = cache.length, k.shape[2]
        if past + t > cache.max_len:
            raise ValueError(
                f"KV cache holds {cache.max_len} tokens; {past + t} needed (raise max_out_tokens)"
            )
        cache.k[layer][:, :, past : past + t] = k
        cache.v[layer][:, :, past : past + t] = v
        return cache.k[layer][:, :, : past + t], cache.v[layer][:, :, : past + t], past

    def _run(self, ids, mask, pos, cache, last_only=False):  # noqa: ANN001, ANN202
        raise NotImplementedError  # implemented by each architecture below


class FusedGPT2(_FusedCausalLM):
    """GPT-2 (``GPT2LMHeadModel``) decoder. See [Note: kernel injection]."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        cfg = model.config
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False) or getattr(
            cfg, "reorder_and_upcast_attn", False
        ):
            raise ValueError(
                "kernel injection: GPT-2 with scale_attn_by_inverse_layer_idx/reorder_and_upcast_attn is not supported"
            )
        if cfg.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(
                f"kernel injection: GPT-2 activation {cfg.activation_function!r} is not supported"
            )
        self.body = model.transformer
        self.lm_head = model.lm_head
        self.n_layers = len(self.body.h)
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.kv_heads = _out_features(self.body.h[0].attn.c_attn) // 3 // self.head_dim

    def _run(self, ids, mask, pos, cache, last_only=False):  # noqa: ANN001, ANN202
        h = self.body.wte(ids) + self.body.wpe(pos)
        past = 0
        for i, block in enumerate(self.body.h):
            a = block.ln_1(h)
            q, k, v = block.attn.c_attn(a).chunk(3, dim=-1)
            b, t = q.shape[:2]
            q, k, v = (x.view(b, t, -1, self.head_dim).transpose(1, 2) for x in (q, k, v))
            k, v, past = self._cache_kv(cache, i, k, v)
            o = _attention(q, k, v, mask, past, gqa=False)
            h = h + block.attn.c_proj(o.transpose(1, 2).reshape(b, t, -1))
            m = block.mlp.c_fc(block.ln_2(h))
            h = h + block.mlp.c_proj(F.gelu(m, approximate="tanh"))
        if cache is not None:
            cache.length += ids.shape[1]
        if last_only:
            h = h[:, -1:]
        return self.lm_head(self.body.ln_f(h))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class FusedLlama(_FusedCausalLM):
    """Llama (``LlamaForCausalLM``) decoder with RoPE and grouped-query attention. See [Note: kernel injection]."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        cfg = model.config
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"kernel injection: Llama activation {cfg.hidden_act!r} is not supported")
        self.body = model.model
        self.lm_head = model.lm_head
        self.n_layers = len(self.body.layers)
        attn = self.body.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.kv_heads = _out_features(attn.k_proj) // self.head_dim
        self.q_heads = _out_features(attn.q_proj) // self.head_dim
        self.scaling = attn.scaling

    def _run(self, ids, mask, pos, cache, last_only=False):  # noqa: ANN001, ANN202
        h = self.body.embed_tokens(ids)
        cos, sin = self.body.rotary_emb(h, pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        gqa = self.q_heads != self.kv_heads
        past = 0
        for i, layer in enumerate(self.body.layers):
            attn = layer.self_attn
            a = layer.input_layernorm(h)
            b, t = a.shape[:2]
            q = attn.q_proj(a).view(b, t, -1, self.head_dim).transpose(1, 2)
            k = attn.k_proj(a).view(b, t, -1, self.head_dim).transpose(1, 2)
            v = attn.v_proj(a).view(b, t, -1, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k, v, past = self._cache_kv(cache, i, k, v)
            o = _attention(q, k, v, mask, past, gqa=gqa)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            m = layer.post_attention_layernorm(h)
            mlp = layer.mlp
            g = F.silu(mlp.gate_proj(m), inplace=True)
            h = h + mlp.down_proj(g.mul_(mlp.up_proj(m)))
        if cache is not None:
            cache.length += ids.shape[1]
        if last_only:
            h = h[:, -1:]
        return self.lm_head(self.body.norm(h))


_ARCHITECTURES = {"gpt2": FusedGPT2, "llama": FusedLlama}
_ENCODERS = ("bert", "roberta")


def inject(model: nn.Module) -> nn.Module:
    """The fused path for ``model``: a fused decoder for GPT-2 / Llama causal LMs, or ``model``
    itself with its encoder swapped in place for BERT-style models (see [Note: fused encoder injection])."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in _ENCODERS:
        return inject_encoder(model)
    if model_type not in _ARCHITECTURES or not hasattr(model, "lm_head"):
        raise ValueError(
            f"replace_with_kernel_inject: no fused kernels for {type(model).__name__} (model_type={model_type!r}); "
            f"supported: causal LMs of type {sorted(_ARCHITECTURES)} and encoders of type {list(_ENCODERS)}. "
            "Use replace_with_kernel_inject=False (automatic tensor parallelism and int8 still apply)"
        )
    return _ARCHITECTURES[model_type](model)
