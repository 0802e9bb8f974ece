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


def ids(batch: int = 2, length: int = 7, vocab: int = 96, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)
