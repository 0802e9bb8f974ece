"""``zero.integrations.ZeroTrainer``: fine-tuning a tiny GPT-2 (built from a config, no
download) with ``transformers.Trainer`` at ZeRO stage 3 on 2 ranks; the Trainer's logged losses
equal zero's own loop over the same batches from the same initial weights, and ``save_model``
writes what ``from_pretrained`` loads."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from zero_core.testing import run_multirank

VOCAB, SEQ, STEPS, LR = 64, 8, 4, 0.01
CFG = {
    "zero_optimization": {
        "stage": 3,
        "param_persistence_threshold": 0,
        "gather_16bit_weights_on_model_save": True,
    },
    "optimizer": {"type": "Adam", "params": {"lr": LR}},
}


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model():
    import zero_core

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, attn_implementation="eager",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    with zero_core.Init(config_dict_or_path={**CFG, "train_micro_batch_size_per_gpu": 2}):
        return transformers.GPT2LMHeadModel(cfg)


def _rank(out: str) -> dict:
    import zero_core
    import zero_core.integrations as zi

    args = transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        lr_scheduler_type="constant",
        learning_rate=LR,
    )
    hf_style = {**CFG, "optimizer": {"type": "Adam", "params": {"lr": "auto"}}}  # filled from args
    trainer = zi.ZeroTrainer(
        model=_model(), args=args, train_dataset=Tokens(), zero_config=hf_style,
        data_collator=transformers.default_data_collator,
    )  # fmt: skip
    # zero's own loop: same initial weights, the batches the Trainer's loader gives this rank
    batches = []
    for b in trainer.get_train_dataloader():
        batches.append(b)
        if len(batches) == STEPS * 2:
            break
    own_cfg = {
        **CFG,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
    }
    engine, *_ = zero_core.initialize(model=_model(), config=own_cfg)
    own = []
    for s in range(STEPS):
        total = 0.0
        for b in batches[2 * s : 2 * s + 2]:
            loss = engine(input_ids=b["input_ids"], labels=b["labels"]).loss
            engine.backward(loss)
            engine.step()
            total += loss.item() / 2
        own.append(total)
    trainer.train()
    logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    trainer.save_model(os.path.join(out, "final"))
    with torch.no_grad():
        trainer.engine.eval()
        logits = trainer.engine(input_ids=batches[0]["input_ids"]).logits.clone()
    return {"own": own, "logged": logged, "logits": logits}


def test_trainer_at_stage3_matches_zeros_own_loop(tmp_path):
    results = run_multirank(_rank, 2, args=(str(tmp_path),), timeout=300)
    # the Trainer logs the mean over ranks of each step's loss
    own = [sum(r["own"][s] for r in results) / 2 for s in range(STEPS)]
    assert results[0]["logged"] == pytest.approx(own, rel=1e-5)  # fp32
    assert results[0]["logged"] == results[1]["logged"] and len(own) == STEPS and own[-1] != own[0]
    hf = transformers.GPT2LMHeadModel.from_pretrained(
        str(tmp_path / "final"), attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
        assert hf(input_ids=ids).logits.shape == (2, SEQ, VOCAB)
