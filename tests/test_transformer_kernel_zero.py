"""zero-ops' fused BERT layer trained by zero-core's engine (cross-package: zero-ops does not
depend on zero-core or transformers).

A tiny ``transformers`` BERT (built locally, dropout 0.1, eager attention) fine-tunes 20 steps on
2 ranks; with its ``BertLayer`` modules replaced by the fused layer it must give the same losses
as the unreplaced model at stage 2 (fp32, 1e-5 relative), and also under stages 0, 1 and 3, with
the memory switches on, and with every fused layer under zero's activation checkpointing; the
trained weights, reverted to Hugging Face's layout, match too (the losses alone barely move
with small changes of the hidden states at this size, the weights do). The fused layer draws its dropout masks as ``BertLayer`` does (deterministic mode), so the same seed
gives the same masks in both models.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import transformers  # the zero meta-package's test extra installs it
from zero_core.testing import run_multirank

STEPS, MICRO, SEQ, VOCAB, WORLD = 20, 2, 8, 64, 2
SWITCHES = dict(normalize_invertible=True, gelu_checkpoint=True, attn_dropout_checkpoint=True)


class Checkpointed(nn.Module):
    """A fused layer run under zero's activation checkpointing (DeepSpeed's checkpointing.checkpoint)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        from zero_core.activation_checkpointing import checkpoint

        return checkpoint(self.inner, hidden_states, attention_mask)


def _build(replaced: bool, switches: dict, checkpointed: bool) -> nn.Module:
    from zero_ops.transformer import replace_bert_layers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        attn_implementation="eager",
    )
    model = transformers.BertForMaskedLM(cfg)
    if replaced:
        replace_bert_layers(model, **switches)
    if checkpointed:
        layers = model.bert.encoder.layer
        for i in range(len(layers)):
            layers[i] = Checkpointed(layers[i])
    return model


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    attn = torch.ones(MICRO, SEQ, dtype=torch.long)
    attn[1, SEQ - 3 :] = 0  # padding: the layers get BERT's attention mask
    return ids, attn


def _train(case: dict) -> list[float]:
    import zero_core
    from zero_core import comm

    rank = comm.get_rank()
    model = _build(case["replaced"], case.get("switches", {}), case.get("checkpointed", False))
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": case["stage"]},
    }
    if case.get("checkpointed"):
        cfg["activation_checkpointing"] = {"partition_activations": False}
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    engine.train()
    torch.manual_seed(100 + rank)  # dropout masks: per rank, the same in every case
    losses = []
    for step in range(STEPS):
        ids, attn = _data(step, rank)
        loss = engine(input_ids=ids, attention_mask=attn, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    if case["stage"] == 3:  # gather the partitioned parameters to read them
        with zero_core.GatheredParameters(list(model.parameters())):
            return torch.stack(losses).tolist(), _hf_state(model)
    return torch.stack(losses).tolist(), _hf_state(model)


def _hf_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained weights in Hugging Face's layout (fused layers reverted to BertLayer)."""
    from zero_ops.transformer import revert_bert_layers

    layers = model.bert.encoder.layer
    for i in range(len(layers)):
        if isinstance(layers[i], Checkpointed):
            layers[i] = layers[i].inner
    if not isinstance(layers[0], transformers.models.bert.modeling_bert.BertLayer):
        revert_bert_layers(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


CASES = [
    dict(replaced=False, stage=2),  # the reference: Hugging Face's BertLayer
    dict(replaced=True, stage=2),  # the swap itself
    dict(replaced=True, stage=1, switches=SWITCHES),
    dict(replaced=True, stage=0, checkpointed=True, switches={"attn_dropout_checkpoint": True}),
    dict(replaced=True, stage=3, switches={"gelu_checkpoint": True}),
]


def _run_cases() -> list[tuple]:
    return [_train(c) for c in CASES]


def test_replaced_bert_fine_tunes_like_bert_under_zero():
    results = run_multirank(_run_cases, WORLD, timeout=300)
    for rank, per_case in enumerate(results):
        ref, ref_state = per_case[0]
        assert len(ref) == STEPS and ref[-1] < 0.9 * ref[0]  # it learns
        for case, (losses, state) in zip(CASES[1:], per_case[1:], strict=True):
            where = f"{case}, rank {rank}"
            torch.testing.assert_close(
                torch.tensor(losses),
                torch.tensor(ref),
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, where=where: f"losses, {where}: {m}",
            )
            assert state.keys() == ref_state.keys(), where  # saved back in Hugging Face's layout
            for name, value in ref_state.items():
                if name.endswith("attention.self.key.bias"):
                    # softmax ignores a per-query constant: this gradient is ~0 (rounding noise),
                    # which Adam's normalisation amplifies to lr-sized steps in either model
                    continue
                torch.testing.assert_close(
                    state[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name, w=where: f"{n}, {w}: {m}"
                )


@pytest.mark.parametrize("checkpointed", [False, True])
def test_dropout_is_active_in_the_compared_runs(checkpointed):
    """The comparison above is not vacuous: two forwards of the fused model differ in training."""
    torch.manual_seed(0)
    model = _build(True, {}, checkpointed)
    model.train()
    ids, attn = _data(0, 0)
    assert not torch.equal(
        model(input_ids=ids, attention_mask=attn).logits, model(input_ids=ids, attention_mask=attn).logits
    )
