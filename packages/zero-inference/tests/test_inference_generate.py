"""generate(): greedy equals transformers' generate; sampling, padding, eos and limits."""

from __future__ import annotations

import inference_models as M
import pytest
import torch
import zero_inference as zi


@pytest.mark.parametrize("make", [M.gpt2, M.llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("inject", [False, True], ids=["hf", "injected"])
def test_greedy_matches_transformers(make, inject: bool) -> None:
    x = M.ids(batch=3, length=5)
    want = make().generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False, pad_token_id=0
    )
    engine = zi.init_inference(make(), dtype="fp32", replace_with_kernel_inject=inject)
    assert torch.equal(engine.generate(x, max_new_tokens=10), want)


@pytest.mark.parametrize("make", [M.gpt2, M.llama], ids=["gpt2", "llama"])
def test_left_padding_matches_transformers(make) -> None:
    x = M.ids(batch=2, length=6)
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    x[0, :2] = 0
    want = make().generate(x, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for inject in (False, True):
        engine = zi.init_inference(make(), dtype="fp32", replace_with_kernel_inject=inject)
        assert torch.equal(engine.generate(x, attention_mask=mask, max_new_tokens=6), want), inject


def test_sampling_is_seeded_and_valid() -> None:
    engine = zi.init_inference(M.llama(), dtype="fp32", replace_with_kernel_inject=True)
    x = M.ids(batch=2, length=4)
    a = engine.generate(
        x,
        max_new_tokens=8,
        do_sample=True,
        top_k=10,
        top_p=0.9,
        temperature=0.7,
        generator=torch.Generator().manual_seed(3),
    )
    b = engine.generate(
        x,
        max_new_tokens=8,
        do_sample=True,
        top_k=10,
        top_p=0.9,
        temperature=0.7,
        generator=torch.Generator().manual_seed(3),
    )
    assert torch.equal(a, b) and a.shape == (2, 12) and int(a.max()) < 96
    greedy = engine.generate(x, max_new_tokens=8)
    c = engine.generate(
        x, max_new_tokens=8, do_sample=True, top_k=1, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(c, greedy)  # top_k=1 sampling is greedy


def test_eos_stops_and_pads() -> None:
    engine = zi.init_inference(M.gpt2(), dtype="fp32")
    x = M.ids(batch=1, length=4)
    first = int(engine.generate(x, max_new_tokens=1)[0, -1])
    out = engine.generate(x, max_new_tokens=5, eos_token_id=first)
    assert out.shape == (1, 5) and int(out[0, -1]) == first


def test_limits_and_validation() -> None:
    engine = zi.init_inference(M.gpt2(), dtype="fp32", max_out_tokens=8)
    with pytest.raises(ValueError, match="exceeds max_out_tokens=8"):
        engine.generate(M.ids(length=5), max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        engine.generate(M.ids(), max_new_tokens=0)
    with pytest.raises(ValueError, match="input_ids must be a 2-D torch.long tensor"):
        engine.generate(torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="needs a causal language model"):
        zi.init_inference(M.bert().bert, dtype="fp32").generate(M.ids())


def test_unset_settings_follow_generation_config() -> None:
    """As in DeepSpeed, whose generate is the model's own: eos, pad and length from generation_config."""
    x = M.ids(batch=2, length=4)
    ref = M.gpt2()
    first = int(zi.init_inference(M.gpt2(), dtype="fp32").generate(x, max_new_tokens=1)[0, -1])
    for model in (ref, M.gpt2()):
        model.generation_config.eos_token_id = first  # row 0 stops after one token
        model.generation_config.pad_token_id = 3
    want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False)
    engine = zi.init_inference(M.gpt2(), dtype="fp32")
    engine.module.generation_config.eos_token_id = first
    engine.module.generation_config.pad_token_id = 3
    got = engine.generate(x, max_new_tokens=6)
    assert torch.equal(got, want) and int(got[0, 5]) == 3
    assert engine.generate(x, max_length=7).shape[1] <= 7
    with pytest.raises(ValueError, match="max_length=4 leaves no room"):
        engine.generate(x, max_length=4)


def test_other_transformers_arguments_use_the_models_generate() -> None:
    x = M.ids(batch=2, length=5)
    kw = {
        "num_beams": 3,
        "repetition_penalty": 1.3,
        "max_new_tokens": 5,
        "attention_mask": torch.ones_like(x),
    }
    want = M.llama().generate(x, pad_token_id=0, **kw)
    assert torch.equal(zi.init_inference(M.llama(), dtype="fp32").generate(x, pad_token_id=0, **kw), want)
    injected = zi.init_inference(M.llama(), dtype="fp32", replace_with_kernel_inject=True)
    with pytest.raises(TypeError, match=r"\['num_beams', 'repetition_penalty'\] are not supported"):
        injected.generate(x, **kw)
