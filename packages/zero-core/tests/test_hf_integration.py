"""Hugging Face without edits, on a tiny GPT-2 built from a config (no download), at ZeRO
stage 3 on 2 ranks:

* ``save_16bit_model`` writes what transformers' ``from_pretrained`` loads (one
  ``model.safetensors``, or shards with ``model.safetensors.index.json``), and
  ``zero.integrations.from_pretrained`` builds a model from such a directory straight into
  ZeRO-3 partitions, each rank reading about its share only;
* ``zero.integrations.ZeroTrainer`` (``transformers.Trainer``): its logged losses equal zero's
  own loop over the same batches from the same initial weights, and ``save_model`` writes what
  ``from_pretrained`` loads.

Everything runs in one 2-rank launch (launches dominate the time)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import transformers
from zero_core.testing import run_multirank
from zero_core.zero.stage3.param_records import is_partitioned

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

    def counting(f, key, lo, hi):
        out = original(f, key, lo, hi)
        read.append(out.numel())  # elements read from the file: exactly this rank's range
        return out

    hf_pretrained._read_range = counting
    try:
        model = from_pretrained(transformers.GPT2LMHeadModel, os.path.join(out, "sharded"), CFG)
    finally:
        hf_pretrained._read_range = original
    partitioned = all(is_partitioned(p) for p in model.parameters())
    engine, *_ = zero_core.initialize(
        model=model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), config=CFG
    )
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=_ids()).logits.clone()
    return {"logits": logits, "read": sum(read), "partitioned": partitioned}


def _all(out: str) -> dict:
    """Save, wait for rank 0's files, load into partitions; then the Trainer."""
    from zero_core import comm

    saved = _train_and_save(out)
    comm.barrier()
    loaded = _load_into_partitions(out)
    os.makedirs(os.path.join(out, "trainer"), exist_ok=True)
    return {"saved": saved, "loaded": loaded, "trainer": _trainer_rank(os.path.join(out, "trainer"))}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, object]:
    out = tmp_path_factory.mktemp("hf")
    return run_multirank(_all, 2, args=(str(out),), timeout=400), out


def test_save_16bit_model_loads_with_from_pretrained_and_into_partitions(launched):
    tmp_path = launched[1]
    saved = [r["saved"] for r in launched[0]]
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
    for res in [r["loaded"] for r in launched[0]]:
        assert res["partitioned"]
        torch.testing.assert_close(res["logits"], saved[0]["logits"], rtol=1e-5, atol=1e-6)
        # exactly this rank's range of every tensor: half of it, rounded up per parameter
        assert 0 < res["read"] <= total // 2 + len(list(hf.parameters())), (res["read"], total)


STEPS, LR = 4, 0.01
TRAINER_CFG = {
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
    with zero_core.Init(config_dict_or_path={**TRAINER_CFG, "train_micro_batch_size_per_gpu": 2}):
        return transformers.GPT2LMHeadModel(cfg)


def _trainer_rank(out: str) -> dict:
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
    hf_style = {**TRAINER_CFG, "optimizer": {"type": "Adam", "params": {"lr": "auto"}}}  # filled from args
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
        **TRAINER_CFG,
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
    eval_loss = trainer.evaluate(Tokens())["eval_loss"]  # the Trainer's evaluation loop, on the engine
    with torch.no_grad():
        trainer.engine.eval()
        logits = trainer.engine(input_ids=batches[0]["input_ids"]).logits.clone()
    return {"own": own, "logged": logged, "logits": logits, "ids": batches[0]["input_ids"], "eval": eval_loss}


def test_trainer_at_stage3_matches_zeros_own_loop(launched):
    tmp_path = launched[1] / "trainer"
    results = [r["trainer"] for r in launched[0]]
    # the Trainer logs the mean over ranks of each step's loss
    own = [sum(r["own"][s] for r in results) / 2 for s in range(STEPS)]
    assert results[0]["logged"] == pytest.approx(own, rel=1e-5)  # fp32
    assert results[0]["logged"] == results[1]["logged"] and len(own) == STEPS and own[-1] != own[0]
    assert results[0]["eval"] == results[1]["eval"]
    hf = transformers.GPT2LMHeadModel.from_pretrained(
        str(tmp_path / "final"), attn_implementation="eager"
    ).eval()
    with torch.no_grad():  # the trained weights, as the engine holds them after training
        logits = hf(input_ids=results[0]["ids"]).logits
    torch.testing.assert_close(logits, results[0]["logits"], rtol=1e-5, atol=1e-6)
    # ZeroTrainer.evaluate on 2 ranks == a plain Trainer's evaluate of the saved model, one process
    had_group = torch.distributed.is_initialized()  # before TrainingArguments, which may start one
    try:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "plain"), per_device_eval_batch_size=8, report_to=[], use_cpu=True
        )
        plain = transformers.Trainer(model=hf, args=args, data_collator=transformers.default_data_collator)
        assert results[0]["eval"] == pytest.approx(plain.evaluate(Tokens())["eval_loss"], rel=1e-5)
    finally:
        # accelerate may start a one-process group here; a later run_multirank in this pytest
        # process (another test file on the same xdist worker) refuses to fork with it alive
        if not had_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
