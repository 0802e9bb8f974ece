"""Hugging Face models (random weights from small configs) trained under stage 3 on 2 ranks.

Built inside ``zero.Init``; the loss trajectory must match single-process training within
1e-5 relative (fp32, 10 steps) and ``save_16bit_model`` output must load into a fresh model
with ``load_state_dict`` and give the same logits.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers  # zero-core's test extra installs it
from zero_core.testing import run_multirank

STEPS, BATCH, SEQ, VOCAB = 10, 2, 8, 64


def _build(kind: str) -> torch.nn.Module:
    t = transformers
    if kind == "gpt2":
        cfg = t.GPT2Config(
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
        return t.GPT2LMHeadModel(cfg)
    if kind == "llama":
        cfg = t.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
            attn_implementation="eager",
        )
        return t.LlamaForCausalLM(cfg)
    cfg = t.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    return t.BertForMaskedLM(cfg)


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _data(world: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS, world, BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _reference(kind: str, world: int) -> list[list[float]]:
    torch.manual_seed(0)
    model = _build(kind)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data, out = _data(world), []
    for s in range(STEPS):
        losses = []
        for r in range(world):
            loss = _loss(model, data[s, r])
            (loss / world).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        out.append(losses)
    return out


def _rank(kind: str, world: int, save_dir: str) -> tuple:
    import zero_core
    from zero_core import comm

    rank = comm.get_rank()
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": 3,
            "param_persistence_threshold": 0,
            "prefetch_bucket_size": 2000,
            "gather_16bit_weights_on_model_save": True,
        },
    }
    torch.manual_seed(0)
    with zero_core.Init(config_dict_or_path=cfg):
        model = _build(kind)
    model.train()
    largest_local = max(p.numel() for p in model.parameters())  # released: empty data
    engine, *_ = zero_core.initialize(
        model=model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), config=cfg
    )
    data, losses = _data(world), []
    for s in range(STEPS):
        loss = _loss(engine, data[s, rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=data[0, 0]).logits.clone()
    saved = engine.save_16bit_model(save_dir, "model.safetensors")
    return losses, logits, saved, largest_local


KINDS = ["gpt2", "llama", "bert"]


def _all_kinds(world: int, save_dir: str) -> list:
    return [_rank(kind, world, os.path.join(save_dir, kind)) for kind in KINDS]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, str]:
    """All three models trained in one 2-rank launch (launches dominate the suite's time)."""
    save_dir = str(tmp_path_factory.mktemp("hf"))
    return run_multirank(_all_kinds, 2, args=(2, save_dir), timeout=240), save_dir


@pytest.mark.parametrize("kind", KINDS)
def test_hf_model_under_stage3(kind: str, trained: tuple[list, str]) -> None:
    world = 2
    results, save_dir = trained
    got = [r[KINDS.index(kind)] for r in results]
    ref = _reference(kind, world)
    for r in range(world):
        losses, _, saved, largest_local = got[r]
        assert saved is True
        assert largest_local == 0, "parameters must be partitioned after zero.Init"
        for s in range(STEPS):
            assert losses[s] == pytest.approx(ref[s][r], rel=1e-5), (kind, r, s)
    from safetensors.torch import load_file

    fresh = _build(kind)
    fresh.load_state_dict(load_file(os.path.join(save_dir, kind, "model.safetensors")), strict=True)
    fresh.eval()
    with torch.no_grad():
        logits = fresh(input_ids=_data(world)[0, 0]).logits
    torch.testing.assert_close(logits, got[0][1], rtol=1e-5, atol=1e-5)
