"""Hugging Face without edits: ``save_16bit_model`` under stage 3 writes what transformers'
``from_pretrained`` loads (one ``model.safetensors``, or shards with
``model.safetensors.index.json``), and ``zero.integrations.from_pretrained`` builds a model from
such a directory straight into ZeRO-3 partitions, each rank reading about its share only."""

from __future__ import annotations

import json
import os
import warnings

import torch
import transformers
from zero_core.testing import run_multirank

VOCAB, SEQ = 64, 8
CFG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 0.0,
    "zero_optimization": {
        "stage": 3,
        "param_persistence_threshold": 0,
        "gather_16bit_weights_on_model_save": True,
    },
}


def gpt2_config() -> transformers.GPT2Config:
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        tie_word_embeddings=True,
        attn_implementation="eager",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _train_and_save(out: str) -> dict:
    import zero_core
    from zero_core import comm

    torch.manual_seed(0)
    with zero_core.Init(config_dict_or_path=CFG):
        model = transformers.GPT2LMHeadModel(gpt2_config())
    engine, *_ = zero_core.initialize(
        model=model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), config=CFG
    )
    for _ in range(2):
        engine.backward(engine(input_ids=_ids(), labels=_ids()).loss)
        engine.step()
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=_ids()).logits.clone()
    if comm.get_rank() == 0:
        model.config.save_pretrained(os.path.join(out, "sharded"))
        model.config.save_pretrained(os.path.join(out, "single"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.save_16bit_model(os.path.join(out, "sharded"), max_shard_size=4000)
        engine.save_16bit_model(os.path.join(out, "single"), "pytorch_model.bin")  # DeepSpeed's name
    return {"logits": logits, "warned": [str(w.message) for w in caught if "pickle" in str(w.message)]}


def _load_into_partitions(out: str) -> dict:
    import zero_core
    from zero_core.integrations import from_pretrained, hf_pretrained

    read = []
    original = hf_pretrained._read_range

    def counting(sl, shape, lo, hi):
        row = 1 if len(shape) <= 1 else int(torch.tensor(shape[1:]).prod())
        read.append(((-(-hi // row)) - lo // row) * row if hi > lo else 0)
        return original(sl, shape, lo, hi)

    hf_pretrained._read_range = counting
    try:
        model = from_pretrained(transformers.GPT2LMHeadModel, os.path.join(out, "sharded"), CFG)
    finally:
        hf_pretrained._read_range = original
    partitioned = all(hasattr(p, "zero_state") for p in model.parameters())
    engine, *_ = zero_core.initialize(
        model=model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), config=CFG
    )
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=_ids()).logits.clone()
    return {"logits": logits, "read": sum(read), "partitioned": partitioned}


def _both(out: str) -> tuple[dict, dict]:
    """One launch (launches dominate the time): save, wait for rank 0's files, load."""
    from zero_core import comm

    saved = _train_and_save(out)
    comm.barrier()
    return saved, _load_into_partitions(out)


def test_save_16bit_model_loads_with_from_pretrained_and_into_partitions(tmp_path):
    results = run_multirank(_both, 2, args=(str(tmp_path),), timeout=300)
    saved = [s for s, _ in results]
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((sharded / s).is_file() for s in shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert (single / "model.safetensors").is_file() and not (single / "pytorch_model.bin").exists()
    assert len(saved[0]["warned"]) == 1 and "model.safetensors" in saved[0]["warned"][0]
    # transformers' own from_pretrained, one process, both layouts
    for directory in (sharded, single):
        hf = transformers.GPT2LMHeadModel.from_pretrained(str(directory), attn_implementation="eager").eval()
        with torch.no_grad():
            torch.testing.assert_close(hf(input_ids=_ids()).logits, saved[0]["logits"], rtol=1e-5, atol=1e-6)
    # into partitions on 2 ranks: same logits, each rank reading about half of the weights
    total = sum(p.numel() for p in hf.parameters())
    for res in [r for _, r in results]:
        assert res["partitioned"]
        torch.testing.assert_close(res["logits"], saved[0]["logits"], rtol=1e-5, atol=1e-6)
        assert 0 < res["read"] < 0.6 * total, (res["read"], total)
