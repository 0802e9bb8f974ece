"""Pipeline checkpoints: an engine checkpoint saved at 2 stages loads at 4 and at 1 with the same
outputs and resumes training exactly; per-layer module files (save_state_dict) are verified and
sealed; files are safetensors + JSON. Exact continuation across layouts and ZeRO stages:
test_pipe_universal_checkpoint.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn
from zero_core.testing import run_multirank
from zero_pipe import LayerSpec, PipelineEngine, PipelineModule, TiedLayerSpec

DIM, VOCAB, MB, MBS = 8, 11, 2, 2


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, DIM) * 0.5)

    def forward(self, ids):
        return self.weight[ids]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _logits(embed, x):
    return x @ embed.weight.t()


def specs():
    return (
        [TiedLayerSpec("embed", Embed)]
        + [LayerSpec(Block) for _ in range(4)]
        + [TiedLayerSpec("embed", Embed, forward_fn=_logits)]
    )


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (MB,), generator=g), torch.randint(0, VOCAB, (MB,), generator=g))
        for _ in range(n)
    ]


def _engine(stages, seed_layers=True):
    model = PipelineModule(
        specs(),
        num_stages=stages,
        loss_fn=nn.functional.cross_entropy,
        seed_layers=seed_layers,
        base_seed=99 if not seed_layers else 1234,
        partition_method="uniform",
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, PipelineEngine(
        model,
        opt,
        {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": MBS},
        lr_scheduler=sched,
    )


def _train(engine, batches, seed):
    d = data(batches * MBS, seed)
    return [engine.train_batch(iter(d[b * MBS : (b + 1) * MBS])).item() for b in range(batches)]


def _save_rank(root):
    model, engine = _engine(2)
    _train(engine, 3, seed=1)
    engine.save_checkpoint(root, tag="t3", client_state={"epoch": 4})
    draws = torch.rand(3)  # the generator as saved: a load in the same layout puts it back
    cont = _train(engine, 2, seed=2)
    _, logits = engine.eval_batch(iter(data(MBS, seed=3)), return_logits=True)
    # A fresh engine (other init) resumes from the checkpoint: same losses as continuing.
    _, engine2 = _engine(2, seed_layers=False)
    path, client = engine2.load_checkpoint(root)
    assert torch.equal(torch.rand(3), draws)
    resumed = _train(engine2, 2, seed=2)
    return cont, resumed, client, engine2.global_steps, engine2.get_lr(), logits


def _load_rank(root):
    model, engine = _engine(4, seed_layers=False)
    engine.load_checkpoint(root, tag="t3", load_optimizer_states=False)
    _, logits = engine.eval_batch(iter(data(MBS, seed=3)), return_logits=True, num_micro_batches=MBS)
    return logits


def test_checkpoint_roundtrip_and_other_stage_counts(tmp_path):
    root = str(tmp_path / "ckpt")
    res = run_multirank(_save_rank, 2, args=(root,))
    for cont, resumed, client, steps, lr, _ in res:
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(cont), rtol=1e-6, atol=1e-7)
        assert client == {"epoch": 4} and steps == 5 and lr == [0.01 * 0.5**2]
    ckpt = os.path.join(root, "t3")
    files = sorted(os.listdir(ckpt))
    assert not any(f.endswith((".pt", ".pkl", ".bin")) or ".tmp" in f for f in files)
    # one zero-core checkpoint over both stages: a rank table and tensor file per global rank
    assert [f for f in files if f.startswith("rank_")] == [
        "rank_00000.json",
        "rank_00000.safetensors",
        "rank_00001.json",
        "rank_00001.safetensors",
    ]
    record = json.load(open(os.path.join(ckpt, "checkpoint.json")))
    assert record["world_size"] == 2 and record["pipeline"]["num_stages"] == 2
    assert record["pipeline"]["tied_owner_stages"] == {"embed": [0, 1]}
    tables = [json.load(open(os.path.join(ckpt, f"rank_0000{r}.json"))) for r in range(2)]
    tied = [[f for f in t["fragments"] if f["name"].startswith("tied_modules.")] for t in tables]
    assert tied[0] and not tied[1]  # the tied embedding (weight and Adam states): once, from stage 0
    assert open(os.path.join(root, "latest")).read() == "t3"

    # The model as saved (after 3 steps), evaluated at 2 stages, 4 stages and 1 stage.
    logits4 = run_multirank(_load_rank, 4, args=(root,))[-1]
    one = PipelineModule(
        specs(), num_stages=1, stage_id=0, loss_fn=nn.functional.cross_entropy, seed_layers=True, base_seed=7
    )
    one.load_state_dir(ckpt)
    with torch.no_grad():
        logits1 = [one(x) for x, _ in data(MBS, seed=3)]
    two = run_multirank(_eval_saved_rank, 2, args=(root,))[-1]
    assert logits4 is not None and len(logits4) == MBS
    for a, b, c in zip(two, logits4, logits1):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-7)


def _eval_saved_rank(root):
    model, engine = _engine(2, seed_layers=False)
    engine.load_checkpoint(root, tag="t3")
    _, logits = engine.eval_batch(iter(data(MBS, seed=3)), return_logits=True)
    # Tags are validated before anything is written or read (issue 25: '..' wrote into the parent).
    for bad in ("..", "../x", "a/b"):
        with pytest.raises(ValueError, match="checkpoint tag must be"):
            engine.save_checkpoint(root, tag=bad)
        with pytest.raises(ValueError, match="checkpoint tag must be"):
            engine.load_checkpoint(root, tag=bad)
    assert sorted(os.listdir(os.path.dirname(root))) == [os.path.basename(root)]
    from zero_core.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"missing does not exist: not a complete checkpoint"):
        engine.load_checkpoint(root, tag="missing")  # any directory used to load, even none
    return logits


def _sgd_engine(stages, method="uniform", seed_layers=True):
    """Plain SGD (no optimizer state) with a WarmupLR from the config: a run resumed in another
    layout continues exactly when the scheduler state and counters come back."""
    import zero_core

    model = PipelineModule(
        specs(),
        num_stages=stages,
        loss_fn=nn.functional.cross_entropy,
        seed_layers=seed_layers,
        base_seed=1234 if seed_layers else 5,
        partition_method=method,
    )
    cfg = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": MBS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 8},
        },
    }
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    return engine


def _save_sched_rank(root):
    engine = _sgd_engine(2)
    _train(engine, 3, seed=1)
    engine.save_checkpoint(root, tag="s3", client_state={"epoch": 2})
    return _train(engine, 2, seed=2), engine.get_lr()


def _load_other_layout_rank(root):
    engine = _sgd_engine(torch.distributed.get_world_size(), seed_layers=False)
    _, client = engine.load_checkpoint(root, tag="s3", load_optimizer_states=False)
    state = (engine.global_steps, engine.global_samples, engine.get_lr(), client)
    return _train(engine, 2, seed=2), engine.get_lr(), state


def _load_other_partition_rank(root):
    engine = _sgd_engine(2, method="type:Embed", seed_layers=False)
    engine.load_checkpoint(root, tag="s3")
    return _train(engine, 2, seed=2), list(engine.module.parts)


def test_other_layout_resumes_scheduler_counters_and_client_state(tmp_path):
    """Loading at another number of stages without optimizer states still restores the LR
    scheduler, the step/sample counters and the client state (as DeepSpeed does), so the run
    continues with the same losses; so does another partition of the layers, optimizer states included."""
    root = str(tmp_path / "ckpt")
    cont, lr = run_multirank(_save_sched_rank, 2, args=(root,))[-1]
    for world in (4, 1):
        for resumed, lr_end, (steps, samples, lr0, client) in run_multirank(
            _load_other_layout_rank, world, args=(root,)
        ):
            assert steps == 3 and samples == 3 * MB * MBS and client == {"epoch": 2}
            assert lr0 != [0.01]  # the warmup goes on; a fresh scheduler would restart at warmup_min_lr
            torch.testing.assert_close(torch.tensor(resumed), torch.tensor(cont), rtol=1e-5, atol=1e-6)
            assert lr_end == lr
    for resumed, parts in run_multirank(_load_other_partition_rank, 2, args=(root,)):
        assert parts != [0, 3, 6]  # other stage boundaries than the saved (uniform) ones
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(cont), rtol=1e-5, atol=1e-6)


def _one_stage():
    return PipelineModule(
        specs(), num_stages=1, stage_id=0, loss_fn=nn.functional.cross_entropy, seed_layers=True, base_seed=7
    )


def test_module_checkpoint_is_verified_and_sealed(tmp_path):
    """A flipped bit in a layer file, an edited index, a format-1 directory: each a clear error, never a load."""
    from zero_core.checkpoint import CheckpointError

    ckpt = tmp_path / "layers"
    saved = _one_stage()
    saved.save_state_dict(str(ckpt))
    # the tools read the directory too: the module's state dict, every file verified
    from zero_core.checkpoint.inspect import describe
    from zero_core.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    converted = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    assert sorted(converted) == sorted(saved.state_dict())
    assert all(torch.equal(converted[k], v) for k, v in saved.state_dict().items())
    assert "zero-pipe module layers (save_state_dict) | 6 layers | saved at 1 stage" in describe(str(ckpt))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # staging renamed into place
    index = json.load(open(ckpt / "pipe_layers.json"))
    assert "seal" in index and set(index["files"]) == {
        f"layer_{i:02d}-model_00-model_states.safetensors" for i in range(5)
    }
    _one_stage().load_state_dir(str(ckpt))
    layer = ckpt / "layer_02-model_00-model_states.safetensors"
    data = bytearray(layer.read_bytes())
    data[-3] ^= 0x80
    layer.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"layer_02-model_00-model_states\.safetensors fails its checksum"
    ):
        _one_stage().load_state_dir(str(ckpt))
    index["num_layers"] = 7
    (ckpt / "pipe_layers.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"pipe_layers\.json fails its checksum \(seal\)"):
        _one_stage().load_state_dir(str(ckpt))
    index.pop("seal")
    index["format_version"] = 1
    (ckpt / "pipe_layers.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="format_version 1.*version 1, from before checksums"):
        _one_stage().load_state_dir(str(ckpt))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a pipeline checkpoint"):
        _one_stage().save_state_dict(str(tmp_path / "other"))
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
