"""The PipelineEngine's smaller API (2 stages): is_first/last_stage, set_dataiterator with
train_batch(), set_batch_fn, set_train_batch_size, reset_activation_shape, and the per-layer
checkpoint names (ckpt_prefix, ckpt_layer_path, ckpt_layer_path_list)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from zero_core.testing import run_multirank
from zero_pipe import LayerSpec, PipelineEngine, PipelineModule, RepeatingLoader

DIM, MB, LAYERS = 5, 2, 4


def _engine(micro_batches: int = 2) -> tuple[PipelineModule, PipelineEngine]:
    specs = [LayerSpec(nn.Linear, DIM, DIM) for _ in range(LAYERS)]
    model = PipelineModule(
        specs, num_stages=2, loss_fn=nn.functional.mse_loss, seed_layers=True, partition_method="uniform"
    )
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": micro_batches}
    return model, PipelineEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)


def _data(n: int, rows: int = MB, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, DIM, generator=g), torch.randn(rows, DIM, generator=g)) for _ in range(n)]


def _reference_loss(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The untrained model in one process (seed_layers: layer i seeded with 1234 + i)."""
    layers = []
    for i in range(LAYERS):
        torch.manual_seed(1234 + i)
        layers.append(nn.Linear(DIM, DIM))
    net = nn.Sequential(*layers)
    with torch.no_grad():
        return torch.stack([nn.functional.mse_loss(net(x), y) for x, y in batches]).mean().item()


def _rank(ckpt_dir: str) -> dict:
    out: dict = {}
    data = _data(4)
    # train_batch(iterator) and set_dataiterator + train_batch() consume the same micro-batches
    _, explicit = _engine()
    given = [float(explicit.train_batch(iter(data[2 * b : 2 * b + 2]))) for b in range(2)]
    _, engine = _engine()
    engine.set_dataiterator(RepeatingLoader(data))
    out["first_last"] = (engine.is_first_stage(), engine.is_last_stage())
    out["dataiterator_same"] = [float(engine.train_batch()) for _ in range(2)] == given
    # set_batch_fn transforms every micro-batch (here: zero labels)
    _, zeroed = _engine()
    want = float(zeroed.train_batch(iter([(x, torch.zeros_like(y)) for x, y in data[:2]])))
    _, fn_engine = _engine()
    fn_engine.set_batch_fn(lambda batch: (batch[0], torch.zeros_like(batch[1])))
    out["batch_fn_same"] = float(fn_engine.train_batch(iter(data[:2]))) == want
    # set_train_batch_size: the number of micro-batches one train_batch consumes
    _, sized = _engine()
    sized.set_train_batch_size(3 * MB)
    stream = iter(data)
    sized.train_batch(stream)
    out["micro_batches"] = sized.gradient_accumulation_steps()
    out["consumed"] = 4 - len(list(stream)) if sized.is_first_stage() else None
    try:
        sized.set_train_batch_size(MB + 1)
        out["bad_size"] = ""
    except ValueError as e:
        out["bad_size"] = str(e)
    # reset_activation_shape: a new micro-batch shape after the first batches
    _, shaped = _engine()
    small, large = _data(2, rows=MB, seed=5), _data(2, rows=3 * MB, seed=6)
    out["eval_small"] = shaped.eval_batch(iter(small)).item()
    shaped.reset_activation_shape()
    out["eval_large"] = shaped.eval_batch(iter(large)).item()
    out["ref"] = (_reference_loss(small), _reference_loss(large))
    # per-layer checkpoint names
    model, _ = _engine()
    model.save_state_dict(ckpt_dir)
    torch.distributed.barrier()
    local = list(model.local_layer_range())
    out["prefix"] = model.ckpt_prefix("/ckpts", "step7")
    out["paths"] = [model.ckpt_layer_path(ckpt_dir, i) for i in range(len(local))]
    out["lists"] = [model.ckpt_layer_path_list(ckpt_dir, i) for i in range(len(local))]
    out["layers"] = local
    try:
        model.ckpt_layer_path(ckpt_dir, len(local))
        out["bad_index"] = ""
    except ValueError as e:
        out["bad_index"] = str(e)
    return out


def test_engine_api(tmp_path):
    first, last = run_multirank(_rank, 2, args=(str(tmp_path),), timeout=120)
    assert first["first_last"] == (True, False) and last["first_last"] == (False, True)
    for out in (first, last):
        assert out["dataiterator_same"] and out["batch_fn_same"]
        assert out["micro_batches"] == 3
        assert "must be a positive multiple of micro batch 2 * data-parallel size 1" in out["bad_size"]
        assert out["eval_small"] == pytest.approx(out["ref"][0], rel=1e-6)
        assert out["eval_large"] == pytest.approx(out["ref"][1], rel=1e-6)
        assert out["prefix"] == os.path.join("/ckpts", "step7")
        assert "outside this stage's 2 layers" in out["bad_index"]
        for idx, path, found in zip(out["layers"], out["paths"], out["lists"]):
            assert path == os.path.join(str(tmp_path), f"layer_{idx:02d}-model_00-model_states.safetensors")
            assert found == [path] and os.path.isfile(path)
    assert first["consumed"] == 3  # exactly the 3 micro-batches of the new batch size
    assert first["layers"] == [0, 1] and last["layers"] == [2, 3]
