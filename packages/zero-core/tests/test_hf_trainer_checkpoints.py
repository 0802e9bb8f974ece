"""``ZeroTrainer``'s ``checkpoint-N`` folders: what they hold, and resuming from them.

A tiny GPT-2 trains 6 optimizer steps (2 epochs of 3, shuffled, linear warm-up/decay) with a
checkpoint every 2 steps, at 2 ranks; resuming from ``checkpoint-4`` (epoch 1, after its first
step) must continue that run exactly: the losses and learning rates logged from step 5 on and
the final weights equal the uninterrupted run's (fp32, 1e-5), at ZeRO stages 2 and 3, from a
path and from ``True`` (the latest in ``output_dir``), at the same world size and at 1 and 4
ranks (the global batch kept at 8: per-device 2 x accumulation 4 / 2 / 1). One run has dropout:
at the same world size it continues exactly only if the random generators are restored after
the Trainer skipped the batches already trained on. ``save_total_limit`` keeps the newest and
the best checkpoints; ``load_best_model_at_end`` ends with the best one's weights (by eval
loss). Three launches (2, 1 and 4 ranks) run every Trainer (launches dominate the time).
"""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file
from zero_core.testing import run_multirank

VOCAB, SEQ, STEPS, RESUME = 64, 8, 6, 4
GLOBAL_BATCH, PER_DEVICE = 8, 2


def _zero_config(stage: int, gather: bool = True) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero.update(param_persistence_threshold=0, gather_16bit_weights_on_model_save=gather)
    return {"zero_optimization": zero, "optimizer": {"type": "Adam", "params": {"lr": "auto"}}}


class Tokens(torch.utils.data.Dataset):
    """Token rows from ``[lo, hi)``: training uses the lower half of the vocabulary, the
    evaluation set of the best-model run the upper half (its loss rises as training goes on)."""

    def __init__(self, n: int, lo: int = 0, hi: int = VOCAB // 2, seed: int = 5) -> None:
        self.ids = torch.randint(lo, hi, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model(stage: int, dropout: float):
    import zero_core

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, attn_implementation="eager",
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    if stage != 3:
        return transformers.GPT2LMHeadModel(cfg)
    with zero_core.Init(config_dict_or_path={**_zero_config(3), "train_micro_batch_size_per_gpu": 2}):
        return transformers.GPT2LMHeadModel(cfg)


def _trainer(out: str, stage: int, dropout: float, eval_dataset=None, gather: bool = True, **overrides):
    import zero_core.integrations as zi

    world = torch.distributed.get_world_size()
    settings = dict(
        output_dir=out,
        per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=GLOBAL_BATCH // (PER_DEVICE * world),
        max_steps=STEPS,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        learning_rate=0.01,
        lr_scheduler_type="linear",
        warmup_steps=2,
        max_grad_norm=1.0,
    )
    args = transformers.TrainingArguments(**{**settings, **overrides})
    return zi.ZeroTrainer(
        model=_model(stage, dropout), args=args, train_dataset=Tokens(24), eval_dataset=eval_dataset,
        zero_config=_zero_config(stage, gather), data_collator=transformers.default_data_collator,
    )  # fmt: skip


def _train(out: str, stage: int, resume=None, dropout: float = 0.0, **options):
    """Train (or resume), then save the final weights to ``out/final``; what the test compares."""
    trainer = _trainer(out, stage, dropout, **options)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(out, "final"))
    return trainer


def _logs(trainer) -> list:
    """``(step, loss, learning rate)`` of every logged training step."""
    return [(e["step"], e["loss"], e["learning_rate"]) for e in trainer.state.log_history if "loss" in e]


def _interrupted(src: str, out: str) -> None:
    """``out`` holding only the checkpoint ``src``, as a run stopped after saving it leaves it."""
    from zero_core import comm

    if comm.get_rank() == 0:
        shutil.copytree(src, os.path.join(out, os.path.basename(src)))
    comm.barrier()


def _best_model_run(out: str) -> dict:
    trainer = _train(
        out, 3, eval_strategy="steps", eval_steps=1, save_steps=1, save_total_limit=2,
        load_best_model_at_end=True, eval_dataset=Tokens(8, VOCAB // 2, VOCAB, seed=7),
    )  # fmt: skip
    evals = [(e["step"], e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e]
    return {
        "best": trainer.state.best_model_checkpoint,
        "evals": evals,
        "after": trainer.evaluate()["eval_loss"],
    }


def _two_ranks(out: str) -> dict:
    """The uninterrupted runs, the resumes at 2 ranks, and the best-model run."""
    base = {
        "s2": _logs(_train(f"{out}/s2", 2)),
        "s3": _logs(_train(f"{out}/s3", 3, save_total_limit=2)),
        "s2_dropout": _logs(_train(f"{out}/s2_dropout", 2, dropout=0.1)),
    }
    dropout_src = f"{out}/s2_dropout/checkpoint-{RESUME}"
    resumed = {"s2_dropout": _logs(_train(f"{out}/s2_dropout_at2", 2, resume=dropout_src, dropout=0.1))}
    _interrupted(f"{out}/s3/checkpoint-{RESUME}", f"{out}/s3_at2")
    resumed["s3"] = _logs(_train(f"{out}/s3_at2", 3, resume=True))
    return {"base": base, "resumed": resumed, "best": _best_model_run(f"{out}/best")}


def _other_size(out: str) -> dict:
    """Resume both stages from the 2-rank runs' checkpoint-4: one from a path, one from True.

    At 4 ranks stage 3 runs without gather_16bit_weights_on_model_save: its checkpoints hold
    the weights in the engine's checkpoint only. At 1 rank, a resume with half the global
    batch warns."""
    world = torch.distributed.get_world_size()
    latest = "s2" if world == 1 else "s3"
    res = {}
    for name, stage in (("s2", 2), ("s3", 3)):
        dst = f"{out}/{name}_at{world}"
        src = f"{out}/{name}/checkpoint-{RESUME}"
        if name == latest:
            _interrupted(src, dst)
        resume = True if name == latest else src
        res[name] = _logs(_train(dst, stage, resume=resume, gather=not (stage == 3 and world == 4)))
    if world == 1:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(
                f"{out}/s2_half_batch",
                2,
                resume=f"{out}/s2/checkpoint-{RESUME}",
                gradient_accumulation_steps=2,
            )
        res["warned"] = [str(w.message) for w in caught if "global batch" in str(w.message)]
    return res


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, object]:
    out = tmp_path_factory.mktemp("trainer_ckpt")
    results = {2: run_multirank(_two_ranks, 2, args=(str(out),), timeout=600)[0]}
    for world in (1, 4):
        results[world] = run_multirank(_other_size, world, args=(str(out),), timeout=600)[0]
    return results, out


def _after_resume(logs: list) -> list:
    return [entry for entry in logs if entry[0] > RESUME]


def _final_weights(run) -> dict:
    """The weights a run ended with: its ``final`` model, or, where it saved none (stage 3
    without gathering), its last checkpoint's engine state through zero_to_fp32."""
    from zero_core.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    model = run / "final" / "model.safetensors"
    if model.is_file():
        return load_file(str(model))
    return get_fp32_state_dict_from_zero_checkpoint(str(run / f"checkpoint-{STEPS}"))


def _assert_same_run(resumed: list, base: list, run, base_run) -> None:
    got, want = _after_resume(resumed), _after_resume(base)
    assert [s for s, *_ in got] == list(range(RESUME + 1, STEPS + 1))
    assert [s for s, *_ in want] == [s for s, *_ in got]
    assert [loss for _, loss, _ in got] == pytest.approx([loss for _, loss, _ in want], rel=1e-5)
    assert [lr for *_, lr in got] == pytest.approx([lr for *_, lr in want], rel=1e-6)
    # the steps before the resume point come back from trainer_state.json
    assert resumed[:RESUME] == base[:RESUME]
    a, b = _final_weights(run), _final_weights(base_run)
    assert set(b) <= set(a), set(b) - set(a)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_checkpoint_folder_holds_the_trainer_files_and_no_pickle(launched):
    out = launched[1]
    folder = out / "s2" / f"checkpoint-{RESUME}"
    names = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    expected = {
        "trainer_state.json", "config.json", "model.safetensors", "latest", "zero_to_fp32.py",
        "rng_state_0.safetensors", "rng_state_0.json", "rng_state_1.safetensors", "rng_state_1.json",
        f"global_step{RESUME}/checkpoint.json",
    }  # fmt: skip
    assert expected <= names, expected - names
    assert not [n for n in names if n.endswith((".pt", ".pth", ".bin", ".pkl"))], names
    assert (folder / "latest").read_text().strip() == f"global_step{RESUME}"
    # the Trainer's own helpers see a valid checkpoint
    assert transformers.trainer_utils.get_last_checkpoint(str(out / "s2")).endswith(f"checkpoint-{STEPS}")


def test_resume_at_the_same_world_size(launched):
    results, out = launched
    two = results[2]
    for name in ("s2_dropout", "s3"):
        _assert_same_run(two["resumed"][name], two["base"][name], out / f"{name}_at2", out / name)
    # dropout makes the run depend on the restored generators: a run without it differs
    assert two["base"]["s2_dropout"][-1][1] != two["base"]["s2"][-1][1]


@pytest.mark.parametrize("world", [1, 4])
def test_resume_at_another_world_size(launched, world):
    results, out = launched
    for name in ("s2", "s3"):
        _assert_same_run(
            results[world][name], results[2]["base"][name], out / f"{name}_at{world}", out / name
        )
    if world == 4:  # stage 3 without gathering: the weights are in the engine's checkpoint only
        last = out / "s3_at4" / f"checkpoint-{STEPS}"
        assert (last / "config.json").is_file() and not (last / "model.safetensors").exists()
    else:  # a resume with another global batch goes on, with a warning
        (warned,) = results[1]["warned"]
        assert "global batch of 8 samples per step, this run has 4" in warned


def test_save_total_limit_keeps_the_newest(launched):
    out = launched[1]
    kept = sorted(p.name for p in (out / "s3").iterdir() if p.name.startswith("checkpoint-"))
    assert kept == ["checkpoint-4", "checkpoint-6"]
    everything = sorted(p.name for p in (out / "s2").iterdir() if p.name.startswith("checkpoint-"))
    assert everything == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]  # no limit: all kept


def test_load_best_model_at_end(launched):
    results, out = launched
    best = results[2]["best"]
    evals = dict(best["evals"])
    step = min(evals, key=evals.get)
    assert step != STEPS, evals  # the best is not the last: loading it changes the weights
    assert best["best"] == str(out / "best" / f"checkpoint-{step}")
    kept = sorted(p.name for p in (out / "best").iterdir() if p.name.startswith("checkpoint-"))
    assert kept == sorted({f"checkpoint-{step}", f"checkpoint-{STEPS}"})
    # after training the engine holds the best checkpoint's weights
    assert best["after"] == pytest.approx(evals[step], rel=1e-6)
    final = load_file(str(out / "best" / "final" / "model.safetensors"))
    saved = load_file(str(out / "best" / f"checkpoint-{step}" / "model.safetensors"))
    last = load_file(str(out / "best" / f"checkpoint-{STEPS}" / "model.safetensors"))
    for k in final:
        torch.testing.assert_close(final[k], saved[k], rtol=0, atol=0, msg=k)
    assert any(not torch.equal(final[k], last[k]) for k in final)


def test_resume_refuses_what_is_not_a_zero_trainer_checkpoint(tmp_path):
    from zero_core.integrations.hf_trainer_checkpoint import check_trainer_checkpoint

    with pytest.raises(ValueError, match="no such directory"):
        check_trainer_checkpoint(str(tmp_path / "missing"))
    with pytest.raises(TypeError, match="must be a path or True"):
        check_trainer_checkpoint(3)
    (tmp_path / "model.safetensors").write_bytes(b"")  # a save_only_model folder
    with pytest.raises(ValueError, match="engine's checkpoint.*model weights only"):
        check_trainer_checkpoint(str(tmp_path))
    (tmp_path / "latest").write_text("global_step4")
    with pytest.raises(ValueError, match="names 'global_step4'.*checkpoint.json is missing"):
        check_trainer_checkpoint(str(tmp_path))
    (tmp_path / "global_step4").mkdir()
    (tmp_path / "global_step4" / "checkpoint.json").write_text("{}")
    with pytest.raises(ValueError, match="no trainer_state.json.*interrupted"):
        check_trainer_checkpoint(str(tmp_path))
    (tmp_path / "latest").write_text("../x")
    with pytest.raises(ValueError, match="not a valid tag"):
        check_trainer_checkpoint(str(tmp_path))


def test_rng_files_restore_the_generators_at_the_same_world_size_only(tmp_path):
    import random

    from zero_core.checkpoint import rng
    from zero_core.checkpoint.format import CheckpointError

    torch.manual_seed(1)
    random.seed(1)
    rng.save_rank_file(str(tmp_path), "rng_state", 1, 2)
    want = (torch.rand(3), random.random())
    assert rng.load_rank_file(str(tmp_path), "rng_state", 1, 2) is None
    assert torch.equal(torch.rand(3), want[0]) and random.random() == want[1]
    assert "saved at world size 2, this run has 4" in rng.load_rank_file(str(tmp_path), "rng_state", 1, 4)
    assert "does not exist" in rng.load_rank_file(str(tmp_path), "rng_state", 0, 2)
    data = (tmp_path / "rng_state_1.safetensors").read_bytes()
    (tmp_path / "rng_state_1.safetensors").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="rng_state_1.safetensors"):
        rng.load_rank_file(str(tmp_path), "rng_state", 1, 2)


def test_save_only_model_with_load_best_model_at_end_is_refused(tmp_path):
    import zero_core.integrations as zi

    had_group = torch.distributed.is_initialized()
    try:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), save_only_model=True, load_best_model_at_end=True,
            eval_strategy="steps", save_strategy="steps", report_to=[], use_cpu=True,
        )  # fmt: skip
        with pytest.raises(ValueError, match="save_only_model=True writes no engine checkpoint"):
            zi.ZeroTrainer(
                model=torch.nn.Linear(2, 2), args=args, eval_dataset=Tokens(2),
                zero_config={"zero_optimization": {"stage": 2}},
            )  # fmt: skip
    finally:  # a later run_multirank in this process refuses to fork with a group alive
        if not had_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
