"""A pipeline without ``loss_fn`` (DeepSpeed: "models that return their loss from forward"):
the labels travel with the activations and the last layer returns the loss; it trains like the
same layers in one process. ``eval_batch(compute_loss=False)`` averages the outputs as DeepSpeed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zero_core.testing import run_multirank
from zero_pipe import LayerSpec, PipelineEngine, PipelineModule

DIM, MB, MICRO_BATCHES, BATCHES, LAYERS = 6, 3, 4, 5, 5


class Carry(nn.Module):
    """A layer that passes the labels along: (x, y) -> (tanh(W x), y)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, inputs):
        x, y = inputs
        return torch.tanh(self.lin(x)), y


class MSELoss(nn.Module):
    def forward(self, inputs):
        x, y = inputs
        return ((x - y) ** 2).mean()


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _specs():
    return [LayerSpec(Carry) for _ in range(LAYERS)] + [LayerSpec(MSELoss)]


def _data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x, y = torch.randn(MB, DIM, generator=g), torch.randn(MB, DIM, generator=g)
        out.append(((x, y), torch.zeros(MB)))  # the labels slot is unused: the loss is in the model
    return out


def _train_rank(stages: int) -> dict:
    model = PipelineModule(_specs(), num_stages=stages, seed_layers=True, partition_method="uniform")
    dp = torch.distributed.get_world_size() // stages
    engine = PipelineEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        {"train_batch_size": MB * MICRO_BATCHES * dp, "train_micro_batch_size_per_gpu": MB},
    )
    data, per = _data(BATCHES * MICRO_BATCHES * dp), MICRO_BATCHES * dp
    replica = engine.grid.data_parallel_id
    losses = [
        float(engine.train_batch(iter(data[b * per : (b + 1) * per][replica::dp]))) for b in range(BATCHES)
    ]
    eval_loss = float(engine.eval_batch(iter(_data(MICRO_BATCHES, seed=9))))
    return {"losses": losses, "eval": eval_loss}


def _reference(dp: int) -> tuple[list[float], float]:
    layers = []
    for idx in range(LAYERS):
        torch.manual_seed(1234 + idx)  # seed_layers: base_seed + layer index
        layers.append(Carry())
    loss_layer = MSELoss()
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.1)

    def run(inputs):
        for m in layers:
            inputs = m(inputs)
        return loss_layer(inputs)

    data, per, losses = _data(BATCHES * MICRO_BATCHES * dp), MICRO_BATCHES * dp, []
    for b in range(BATCHES):
        opt.zero_grad()
        batch = [run(inputs) for inputs, _ in data[b * per : (b + 1) * per]]
        loss = torch.stack(batch).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        eval_loss = torch.stack([run(inputs) for inputs, _ in _data(MICRO_BATCHES, seed=9)]).mean().item()
    return losses, eval_loss


@pytest.mark.parametrize("world,stages", [(2, 2), (4, 2), (3, 3)], ids=["2-stages", "2x2", "3-stages"])
def test_loss_computed_by_the_last_layer(world, stages):
    ref_losses, ref_eval = _reference(world // stages)
    for out in run_multirank(_train_rank, world, args=(stages,), timeout=180):
        torch.testing.assert_close(
            torch.tensor(out["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6
        )
        assert out["eval"] == pytest.approx(ref_eval, rel=1e-5)


def _eval_outputs_rank() -> dict:
    specs = [LayerSpec(Plain) for _ in range(4)]
    model = PipelineModule(specs, num_stages=2, loss_fn=nn.functional.mse_loss, seed_layers=True)
    engine = PipelineEngine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), {"train_micro_batch_size_per_gpu": MB}
    )
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(MB, DIM, generator=g), torch.randn(MB, DIM, generator=g)) for _ in range(3)]
    averaged, logits = engine.eval_batch(
        iter(data), compute_loss=False, return_logits=True, num_micro_batches=3
    )
    raw = engine.eval_batch(iter(data), compute_loss=False, reduce_output=None, num_micro_batches=3)
    return {"stage": engine.stage_id, "averaged": averaged, "logits": logits, "raw": raw}


def test_eval_without_loss_averages_the_outputs():
    first, last = run_multirank(_eval_outputs_rank, 2)
    assert first["averaged"] is None and first["logits"] is None and first["raw"] is None
    assert len(last["logits"]) == 3 and len(last["raw"]) == 3
    torch.testing.assert_close(last["averaged"], torch.stack(last["logits"]).mean(0))
    for a, b in zip(last["raw"], last["logits"]):
        torch.testing.assert_close(a, b)


def _bad_rank() -> str:
    # One stage: with more, the other stages would wait for this one until the p2p timeout.
    model = PipelineModule([LayerSpec(Plain), LayerSpec(Plain)], num_stages=1)  # no loss_fn, tensor output
    engine = PipelineEngine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), {"train_micro_batch_size_per_gpu": MB}
    )
    try:
        engine.train_batch(iter([(torch.randn(MB, DIM), torch.zeros(MB))]))
    except ValueError as e:
        return str(e)
    return ""


def test_last_layer_output_that_is_not_a_loss_is_a_clear_error():
    (last,) = run_multirank(_bad_rank, 1, timeout=60)
    assert "the last layer's output (the PipelineModule has no loss_fn) must be a one-element" in last
    assert "tensor of shape (3, 6)" in last
