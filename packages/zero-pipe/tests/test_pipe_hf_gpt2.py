"""A Hugging Face GPT-2, cut into pipeline layers (embedding tied to the LM head across the first
and last stage, addressed as ``tied_weight_attr="wte.weight"``), trains like the whole model in
one process: AdamW, gradient clipping, data parallel replicas and the interleaved schedule."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from zero_core.testing import run_multirank

VOCAB, SEQ, MB, BATCHES = 97, 16, 2, 6
CONFIG = {
    "train_micro_batch_size_per_gpu": MB,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "gradient_clipping": 1.0,
}


def _reference_model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    cfg._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(cfg)


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        ref = _reference_model().transformer
        self.wte, self.wpe = ref.wte, ref.wpe

    def forward(self, ids):
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))


class Block(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.block = _reference_model().transformer.h[index]

    def forward(self, h):
        # The whole model builds the causal mask once and hands it to every block.
        n = h.shape[1]
        mask = torch.full((n, n), torch.finfo(h.dtype).min).triu(1)[None, None]
        out = self.block(h, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out


class FinalNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = _reference_model().transformer.ln_f

    def forward(self, h):
        return self.ln(h)


def _lm_head(embed, h):
    return h @ embed.wte.weight.t()


def _loss(logits, labels):
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def _data(micro_batches):
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, VOCAB, (MB, SEQ), generator=g) for _ in range(BATCHES * micro_batches)]
    return [(x, x.clone()) for x in ids]


def _train_rank(stages, micro_batches, chunks):
    from zero_core import initialize
    from zero_pipe import LayerSpec, PipelineModule, TiedLayerSpec

    tied = {"tied_weight_attr": "wte.weight"}
    specs = [TiedLayerSpec("embed", Embed, **tied)]
    specs += [LayerSpec(Block, i) for i in range(4)]
    specs += [LayerSpec(FinalNorm), TiedLayerSpec("embed", Embed, forward_fn=_lm_head, **tied)]
    model = PipelineModule(
        specs, num_stages=stages, loss_fn=_loss, partition_method="uniform", num_chunks=chunks
    )
    dp = torch.distributed.get_world_size() // stages
    engine, *_ = initialize(
        model=model,
        model_parameters=model.parameters(),
        config={**CONFIG, "train_batch_size": MB * micro_batches * dp},
    )
    data, per_batch = _data(micro_batches * dp), micro_batches * dp
    replica = engine.grid.data_parallel_id
    losses = []
    for b in range(BATCHES):
        mine = data[b * per_batch : (b + 1) * per_batch][replica::dp]
        losses.append(float(engine.train_batch(iter(mine))))
    wte = model.tied_modules["embed"].wte.weight.detach().clone() if "embed" in model.tied_modules else None
    return engine.stage_id, losses, wte


def _reference(micro_batches):
    model = _reference_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    data, losses = _data(micro_batches), []
    for b in range(BATCHES):
        opt.zero_grad()
        total = 0.0
        for ids, labels in data[b * micro_batches : (b + 1) * micro_batches]:
            loss = _loss(model(ids).logits, labels) / micro_batches
            loss.backward()
            total += loss.item()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(total)
    return losses, model.transformer.wte.weight.detach()


@pytest.mark.parametrize(
    "world,stages,micro_batches,chunks",
    [(2, 2, 4, 1), (4, 2, 3, 1), (2, 2, 4, 2)],
    ids=["2-stages", "2-stages-x-2-replicas", "interleaved"],
)
def test_hf_gpt2_pipeline_matches_single_process(world, stages, micro_batches, chunks):
    results = run_multirank(_train_rank, world, args=(stages, micro_batches, chunks), timeout=180.0)
    dp = world // stages
    ref_losses, ref_wte = _reference(micro_batches * dp)
    for stage, losses, wte in results:
        if stage == stages - 1:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        # Every stage holding the tied embedding (first and last) keeps a bit-identical copy.
        assert wte is not None
        torch.testing.assert_close(wte, results[0][2], rtol=0, atol=0)
        torch.testing.assert_close(wte, ref_wte, rtol=1e-5, atol=1e-6)
