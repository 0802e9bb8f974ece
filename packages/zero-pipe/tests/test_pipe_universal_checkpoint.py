"""Universal pipeline checkpoints: saved in one layout (stages x data-parallel replicas, ZeRO stage),
loaded in another, training continues exactly as the uninterrupted run (losses and final weights,
fp32 within 1e-5), tied weights, buffers, the LR scheduler and the counters included; the saved
checkpoint converts with zero_to_fp32 to the model's full state dict and inspect_checkpoint shows it.
Engine checkpoints of format 2 (written before, fixtures/format2 by fixtures/make_format2_checkpoint.py
with that zero-pipe) still load: in their own layout training continues as the run that wrote them
did; in another layout the optimizer states are refused with a message saying what to do, and the
weights, scheduler and counters load without them.

Each scenario's reference is the saving run itself continued past the save; the loading run starts
from another initialisation, so nothing but the checkpoint can make it match.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from zero_core.testing import run_multirank
from zero_pipe import LayerSpec, PipelineModule, TiedLayerSpec

DIM, VOCAB, MB, MICRO = 8, 11, 2, 4  # MICRO micro-batches of MB samples per global batch
BEFORE, AFTER = 2, 2  # batches before the save, and after it


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, DIM) * 0.5)

    def forward(self, ids):
        return self.weight[ids]


class Block(nn.Module):
    """A linear layer with a fixed (non-trained) buffer: a load that missed it would change the outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.register_buffer("mix", torch.rand(DIM))

    def forward(self, x):
        return torch.tanh(self.lin(x) * self.mix)


def _logits(embed, x):
    return x @ embed.weight.t()


def specs():
    return (
        [TiedLayerSpec("embed", Embed)]
        + [LayerSpec(Block) for _ in range(4)]
        + [TiedLayerSpec("embed", Embed, forward_fn=_logits)]
    )


def _batch(b):
    g = torch.Generator().manual_seed(100 + b)
    return [
        (torch.randint(0, VOCAB, (MB,), generator=g), torch.randint(0, VOCAB, (MB,), generator=g))
        for _ in range(MICRO)
    ]


def _engine(stages, zero_stage, seed, chunks=1):
    import zero_core

    torch.manual_seed(seed)  # the loading runs start from other weights (and buffers) than the saved ones
    model = PipelineModule(
        specs(),
        num_stages=stages,
        loss_fn=nn.functional.cross_entropy,
        partition_method="uniform",
        num_chunks=chunks,
    )
    cfg = {
        "train_batch_size": MB * MICRO,
        "train_micro_batch_size_per_gpu": MB,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 0.02}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.002, "warmup_max_lr": 0.02, "warmup_num_steps": 6},
        },
        "zero_optimization": {"stage": zero_stage},
        "steps_per_print": 1000,
    }
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    return engine


def _train(engine, first, count):
    """Batches ``first .. first + count - 1``: each replica takes its share of the micro-batches."""
    grid = engine.grid
    per = engine.gradient_accumulation_steps()
    losses = []
    for b in range(first, first + count):
        mine = _batch(b)[grid.data_parallel_id * per : (grid.data_parallel_id + 1) * per]
        losses.append(engine.train_batch(iter(mine)).item())
    return losses


def _weights(engine):
    """This stage's weights and buffers (replica 0 only), by their names in the checkpoint."""
    if engine.grid.data_parallel_id != 0:
        return {}
    return {k: v.detach().clone().float() for k, v in engine.module.state_dict().items()}


def _state(engine):
    return {
        "steps": engine.global_steps,
        "samples": engine.global_samples,
        "lr": engine.get_lr(),
    }


def _save_run(root, stages, zero_stage):
    engine = _engine(stages, zero_stage, seed=1)
    _train(engine, 0, BEFORE)
    engine.save_checkpoint(root, client_state={"epoch": 1})
    at_save = _weights(engine)
    losses = _train(engine, BEFORE, AFTER)
    return losses, _weights(engine), _state(engine), at_save


def _load_run(root, stages, zero_stage, chunks=1):
    engine = _engine(stages, zero_stage, seed=2, chunks=chunks)
    _, client = engine.load_checkpoint(root)
    resumed_at = _state(engine)
    losses = _train(engine, BEFORE, AFTER)
    return losses, _weights(engine), _state(engine), (client, resumed_at)


def _merge(results, index):
    out = {}
    for r in results:
        out.update(r[index])
    return out


def _assert_continues(reference, loaded):
    """The loaded run's losses, final weights, LR and counters equal the uninterrupted run's."""
    ref_losses, ref_weights, ref_state = reference[0][0], _merge(reference, 1), reference[0][2]
    for losses, _, state, (client, resumed_at) in loaded:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        assert client == {"epoch": 1}
        assert resumed_at["steps"] == BEFORE and resumed_at["samples"] == BEFORE * MB * MICRO
        assert state["steps"] == ref_state["steps"] == BEFORE + AFTER
        assert state["samples"] == ref_state["samples"]
        torch.testing.assert_close(
            torch.tensor(state["lr"][0]), torch.tensor(ref_state["lr"][0]), rtol=1e-6, atol=0
        )
    weights = _merge(loaded, 1)
    assert sorted(weights) == sorted(ref_weights)
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def saved_2x1_stage0(tmp_path_factory):
    """2 stages x 1 replica, ZeRO stage 0: the checkpoint and the uninterrupted run."""
    root = str(tmp_path_factory.mktemp("pipe_2x1") / "ckpt")
    return root, run_multirank(_save_run, 2, args=(root, 2, 0))


def test_two_stages_to_one_stage_at_zero_stage_1(saved_2x1_stage0):
    root, reference = saved_2x1_stage0
    _assert_continues(reference, run_multirank(_load_run, 1, args=(root, 1, 1)))


def test_2x1_to_2x2_at_zero_stage_1_with_interleaved_chunks(saved_2x1_stage0):
    """Twice the replicas (each ZeRO-1 partition now half the optimizer state), two chunks per stage."""
    root, reference = saved_2x1_stage0
    _assert_continues(reference, run_multirank(_load_run, 4, args=(root, 2, 1, 2)))


def test_one_stage_at_zero_stage_1_to_two_stages_at_zero_stage_0(tmp_path):
    """1 stage x 2 replicas with partitioned optimizer states -> 2 stages x 1 replica, replicated."""
    root = str(tmp_path / "ckpt")
    reference = run_multirank(_save_run, 2, args=(root, 1, 1))
    _assert_continues(reference, run_multirank(_load_run, 2, args=(root, 2, 0)))


class OtherBlock(Block):
    """The same shapes under another name: a different model to a strict load."""

    def __init__(self) -> None:
        super().__init__()
        self.other = self.lin
        del self.lin

    def forward(self, x):
        return torch.tanh(self.other(x) * self.mix)


def _mismatch_rank(root, zero_dir):
    import zero_core
    from zero_core.checkpoint import CheckpointError

    def engine_of(layers):
        model = PipelineModule(layers, num_stages=1, loss_fn=nn.functional.cross_entropy)
        cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": MICRO}
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 0.02}}
        return zero_core.initialize(model=model, config=cfg)[0]

    with pytest.raises(CheckpointError, match="has 6 layers, this one 7"):
        engine_of(specs() + [LayerSpec(Block)]).load_checkpoint(root)
    other = specs()
    other[2] = LayerSpec(OtherBlock)
    engine = engine_of(other)
    with pytest.raises(
        CheckpointError, match=r"missing \['layers\.2\.other\.weight'.*unexpected \['layers\.2\.lin\.bias'"
    ):
        engine.load_checkpoint(root)
    engine.load_checkpoint(root, load_module_strict=False)  # the layers that match load
    assert engine.global_steps == BEFORE
    # a checkpoint of a ZeroEngine holds no pipeline layout (and other names)
    cfg = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    zero_core.initialize(model=nn.Linear(2, 2), config=cfg)[0].save_checkpoint(zero_dir)
    with pytest.raises(CheckpointError, match="without a pipeline section: it was saved by a ZeroEngine"):
        engine_of(specs()).load_checkpoint(zero_dir)


def test_a_different_model_is_a_clear_error(saved_2x1_stage0, tmp_path):
    root, _ = saved_2x1_stage0
    run_multirank(_mismatch_rank, 1, args=(root, str(tmp_path / "zero")))


def test_zero_to_fp32_and_inspect_read_a_pipeline_checkpoint(saved_2x1_stage0, tmp_path):
    """The conversion equals the model's full state dict at the save and loads strictly into the
    module built as one stage; inspect_checkpoint reports the pipeline layout and verifies every file."""
    from safetensors.torch import load_file
    from zero_core.checkpoint.inspect import describe
    from zero_core.checkpoint.zero_to_fp32 import main

    root, reference = saved_2x1_stage0
    at_save = _merge(reference, 3)
    out = tmp_path / "model.safetensors"
    assert main([root, str(out), "-q"]) == 0
    converted = load_file(str(out))
    assert sorted(converted) == sorted(at_save)
    for name, value in at_save.items():
        assert torch.equal(converted[name], value), name
    one = PipelineModule(specs(), num_stages=1, stage_id=0, loss_fn=nn.functional.cross_entropy)
    one.load_state_dict(converted)  # strict
    report = describe(root)
    assert "pipeline: 2 stages x 1 chunk, 1 data-parallel replica, ZeRO stage 0, 6 layers" in report
    assert "tied: embed (stages 0, 1)" in report
    assert report.count("OK") == 2  # both rank files verified


# -- format 2 ----------------------------------------------------------------------------
FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "format2")
ROOT = os.path.join(FIXTURE, "ckpt")


def _same_layout_rank():
    engine = _engine(2, 0, seed=2)
    _, client = engine.load_checkpoint(ROOT)
    start = (engine.global_steps, engine.global_samples, client)
    return _train(engine, BEFORE, AFTER), _weights(engine), start


def test_format2_checkpoint_continues_in_its_own_layout():
    expected = json.load(open(os.path.join(FIXTURE, "expected.json")))
    want = load_file(os.path.join(FIXTURE, "expected.safetensors"))
    results = run_multirank(_same_layout_rank, 2)
    weights = {}
    for losses, w, start in results:
        assert start == (BEFORE, BEFORE * MB * MICRO, {"epoch": 1})
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-6
        )
        weights.update(w)
    assert sorted(weights) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _other_layout_rank():
    engine = _engine(1, 1, seed=2)
    with pytest.raises(ValueError, match=r"format-2 zero-pipe checkpoint.*load_optimizer_states=False"):
        engine.load_checkpoint(ROOT)
    _, client = engine.load_checkpoint(ROOT, load_optimizer_states=False)
    saved = PipelineModule(specs(), num_stages=1, stage_id=0)
    saved.load_state_dir(os.path.join(ROOT, "global_step2"))
    same = all(torch.equal(engine.module.state_dict()[k], v) for k, v in saved.state_dict().items())
    return same, engine.global_steps, client


def test_format2_checkpoint_in_another_layout_loads_without_optimizer_states():
    [(same, steps, client)] = run_multirank(_other_layout_rank, 1)
    assert same and steps == BEFORE and client == {"epoch": 1}


def test_zero_to_fp32_says_how_to_convert_a_format2_checkpoint():
    from zero_core.checkpoint.format import CheckpointError
    from zero_core.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with pytest.raises(CheckpointError, match="does not record its layers' module names.*save it again"):
        get_fp32_state_dict_from_zero_checkpoint(ROOT)
