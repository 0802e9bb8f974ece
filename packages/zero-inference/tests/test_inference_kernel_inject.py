"""Kernel injection: the fused path equals the original model (fp32 and bf16)."""

from __future__ import annotations

import inference_models as M
import pytest
import torch
import zero_inference as zi
from zero_inference.kernel_inject import FusedGPT2, FusedLlama


@pytest.mark.parametrize("make, cls", [(M.gpt2, FusedGPT2), (M.llama, FusedLlama)], ids=["gpt2", "llama"])
def test_injected_equals_original(make, cls) -> None:
    x = M.ids(batch=2, length=9)
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    engine = zi.init_inference(make(), dtype="fp32", replace_with_kernel_inject=True)
    assert isinstance(engine.injected, cls)
    with torch.no_grad():
        for m in (None, mask):
            want = make()(x, attention_mask=m).logits
            got = engine(x, attention_mask=m).logits
            keep = (m if m is not None else torch.ones_like(x)).bool()
            rel = float((got - want)[keep].abs().max() / want.abs().max())
            assert rel < 1e-5, rel


def test_injected_bf16_close_to_plain_bf16() -> None:
    x = M.ids()
    plain = zi.init_inference(M.llama(), dtype="bf16")
    inj = zi.init_inference(M.llama(), dtype="bf16", replace_with_kernel_inject=True)
    a, b = plain(x).logits.float(), inj(x).logits.float()
    assert inj.injected.body.embed_tokens.weight.dtype == torch.bfloat16
    assert float((a - b).abs().max() / a.abs().max()) < 3e-2


def test_injected_output_is_indexable() -> None:
    engine = zi.init_inference(M.gpt2(), dtype="fp32", kernel_inject=True)
    out = engine(M.ids())
    assert out[0] is out.logits
    with pytest.raises(TypeError, match="does not take"):
        engine(M.ids(), past_key_values=object())


def _bert_classifier(seed: int = 0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
        hidden_act="relu",
    )
    return BertForSequenceClassification(cfg).eval()


@pytest.mark.parametrize("make", [M.bert, _bert_classifier], ids=["bert_mlm_gelu", "bert_cls_relu"])
def test_bert_encoder_injection_equals_original(make) -> None:
    from zero_inference.fused_encoder import FusedBertEncoder

    x = M.ids(batch=2, length=9)
    mask = torch.ones_like(x)
    mask[1, 5:] = 0  # right padding on one row
    engine = zi.init_inference(make(), dtype="fp32", replace_with_kernel_inject=True)
    assert isinstance(engine.module.bert.encoder, FusedBertEncoder)
    with torch.no_grad():
        for m in (None, mask):
            want = make()(x, attention_mask=m).logits
            got = engine(x, attention_mask=m).logits
            assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_bert_injection_rejects_decoder_configs() -> None:
    from transformers import BertConfig, BertLMHeadModel

    cfg = BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, is_decoder=True
    )
    with pytest.raises(ValueError, match="BERT configured as a decoder"):
        zi.init_inference(BertLMHeadModel(cfg), dtype="fp32", replace_with_kernel_inject=True)
