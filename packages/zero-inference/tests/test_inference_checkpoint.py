"""Loading HF safetensors checkpoints into an empty model; ZeRO-Inference partitioning."""

from __future__ import annotations

import json

import inference_models as M
import pytest
import torch
import zero_inference as zi


@pytest.mark.parametrize("make", [M.gpt2, M.llama], ids=["gpt2", "llama"])
def test_hf_safetensors_dir_into_empty_model(make, tmp_path) -> None:
    make().save_pretrained(tmp_path)
    with zi.empty_model():
        empty = make(seed=9)
    assert all(p.is_meta for p in empty.parameters())
    engine = zi.init_inference(empty, dtype="fp32", checkpoint=str(tmp_path))
    x = M.ids()
    with torch.no_grad():
        want = make()(x).logits
    assert float((engine(x).logits - want).abs().max()) == 0.0


def test_json_load_policy(tmp_path) -> None:
    M.llama().save_pretrained(tmp_path)
    policy = {"type": "ds_model", "checkpoints": ["model.safetensors"], "version": 1.0}
    (tmp_path / "policy.json").write_text(json.dumps(policy))
    with zi.empty_model():
        empty = M.llama(seed=9)
    engine = zi.init_inference(empty, dtype="fp32", checkpoint="policy.json", base_dir=str(tmp_path))
    with torch.no_grad():
        assert torch.equal(engine(M.ids()).logits, M.llama()(M.ids()).logits)


def test_checkpoint_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a safetensors file nor a directory"):
        zi.init_inference(M.gpt2(), dtype="fp32", checkpoint=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="pickle checkpoints are not loaded"):
        zi.init_inference(M.gpt2(), dtype="fp32", checkpoint="model.bin")
    with zi.empty_model():
        empty = M.gpt2()
    with pytest.raises(ValueError, match="meta device; pass checkpoint="):
        zi.init_inference(empty, dtype="fp32")


def test_zero_inference_gathers_per_layer() -> None:
    x = M.ids()
    with torch.no_grad():
        want = M.llama()(x).logits
    engine = zi.init_inference(M.llama(), dtype="fp32", zero={"stage": 3, "offload_param": {"device": "cpu"}})
    layer_params = list(engine.module.model.layers.parameters())
    assert all(p.numel() == 0 for p in layer_params)  # released outside their layer's forward
    assert torch.equal(engine(x).logits, want)
    assert all(p.numel() == 0 for p in layer_params)
    assert torch.equal(
        engine.generate(x, max_new_tokens=3),
        M.llama().generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False, pad_token_id=0
        ),
    )
