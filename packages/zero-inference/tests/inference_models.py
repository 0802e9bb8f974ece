"""Tiny random HF models (no download) shared by the zero-inference tests."""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=95, eos_token_id=95
    )
    return GPT2LMHeadModel(cfg).eval()


def llama(seed: int = 0, vocab: int = 96) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def bert(seed: int = 0) -> BertForMaskedLM:
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return BertForMaskedLM(cfg).eval()


def hf_causal_lm(kind: str, seed: int = 0, vocab: int = 61) -> torch.nn.Module:
    """Small causal LMs whose attention layouts auto TP must handle (hidden 32, 4 heads, 2 layers).

    ``falcon_mqa``: fused [q heads | k | v] with one key/value head; ``falcon_gqa``: the new
    decoder architecture (q/k/v grouped per key/value head); ``bloom`` and ``falcon_alibi``:
    ALiBi biases built outside the attention; ``phi``: ``self_attn.dense`` output projection;
    ``gptj``: ``fc_out``; ``gemma``: an embedding subclass that scales its output; ``phi3``: a
    fused q/k/v of unequal blocks (grouped-query) sliced with ``config.num_attention_heads``;
    ``qwen2_moe``: a one-output ``shared_expert_gate``; ``bigcode_mqa``/``bigcode_mha``: GPT-BigCode
    with one key/value head ([q heads | k | v]) or a head-major fused q/k/v; ``codegen``: q/v/k fused in 4 head groups
    (8 heads, so that tp_size 2 divides a group).
    """
    import transformers as t

    torch.manual_seed(seed)
    common = {"vocab_size": vocab, "attn_implementation": "eager"}
    falcon = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "bias": False}
    decoder = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4}
    gqa = {**decoder, "num_key_value_heads": 2}
    if kind == "falcon_mqa":
        return t.FalconForCausalLM(t.FalconConfig(**common, **falcon, multi_query=True, alibi=False)).eval()
    if kind == "falcon_gqa":
        cfg = t.FalconConfig(**common, **falcon, new_decoder_architecture=True, num_kv_heads=2, alibi=False)
        return t.FalconForCausalLM(cfg).eval()
    if kind == "falcon_alibi":
        cfg = t.FalconConfig(**common, **falcon, multi_query=False, alibi=True)
        return t.FalconForCausalLM(cfg).eval()
    if kind == "bloom":
        return t.BloomForCausalLM(t.BloomConfig(**common, hidden_size=32, n_layer=2, n_head=4)).eval()
    if kind == "phi":
        cfg = t.PhiConfig(**common, **decoder)
        return t.PhiForCausalLM(cfg).eval()
    if kind == "gptj":
        cfg = t.GPTJConfig(**common, n_positions=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4)
        return t.GPTJForCausalLM(cfg).eval()
    if kind == "gemma":
        cfg = t.GemmaConfig(**common, **gqa, head_dim=8)
        return t.GemmaForCausalLM(cfg).eval()
    if kind == "phi3":
        cfg = t.Phi3Config(**common, **gqa, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return t.Phi3ForCausalLM(cfg).eval()
    if kind == "qwen2_moe":
        cfg = t.Qwen2MoeConfig(
            **common,
            **gqa,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=2,
        )
        return t.Qwen2MoeForCausalLM(cfg).eval()
    if kind in ("bigcode_mqa", "bigcode_mha"):
        cfg = t.GPTBigCodeConfig(
            **common, n_positions=64, n_embd=32, n_layer=2, n_head=4, multi_query=kind == "bigcode_mqa"
        )
        return t.GPTBigCodeForCausalLM(cfg).eval()
    if kind == "codegen":
        cfg = t.CodeGenConfig(
            **common, n_positions=64, n_ctx=64, n_embd=32, n_layer=2, n_head=8, rotary_dim=2
        )
        return t.CodeGenForCausalLM(cfg).eval()
    raise ValueError(f"unknown model kind {kind!r}")


def ids(batch: int = 2, length: int = 7, vocab: int = 96, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)
