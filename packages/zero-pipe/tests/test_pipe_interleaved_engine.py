"""The engine running the interleaved schedule (several chunks per stage), and tuple/bool
activations between stages, vs one process training the same nn.Sequential (fp32)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zero_core.testing import run_multirank
from zero_pipe import LayerSpec, PipelineEngine, PipelineModule

DIM, MB = 6, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def specs(n_blocks):
    return (
        [LayerSpec(nn.Linear, DIM, DIM)]
        + [LayerSpec(Block) for _ in range(n_blocks)]
        + [LayerSpec(nn.Linear, DIM, 3)]
    )


def reference(layer_specs):
    layers = []
    for idx, spec in enumerate(layer_specs):
        torch.manual_seed(1234 + idx)
        layers.append(spec.build())
    return nn.Sequential(*layers)


def data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(MB, DIM, generator=g), torch.randint(0, 3, (MB,), generator=g)) for _ in range(n)]


def _interleaved_rank(layer_specs, chunks, micro_batches, batches):
    stages = torch.distributed.get_world_size()
    model = PipelineModule(
        layer_specs,
        num_stages=stages,
        loss_fn=nn.functional.cross_entropy,
        seed_layers=True,
        partition_method="uniform",
        num_chunks=chunks,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = PipelineEngine(
        model, opt, {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": micro_batches}
    )
    d = data(batches * micro_batches)
    losses = [
        engine.train_batch(iter(d[b * micro_batches : (b + 1) * micro_batches])).item()
        for b in range(batches)
    ]
    params = {
        f"{i}.{n}": p.detach().clone()
        for i, m in model.layer_modules().items()
        for n, p in m.named_parameters()
    }
    loss, logits = engine.eval_batch(iter(data(micro_batches, seed=7)), return_logits=True)
    return losses, params, loss.item(), logits, len(model.chunk_funcs)


@pytest.mark.parametrize("world,n_blocks,micro_batches", [(2, 6, 4), (2, 6, 3), (4, 6, 5)])
def test_interleaved_engine_matches_single_process(world, n_blocks, micro_batches):
    layer_specs, chunks, batches = specs(n_blocks), 2, 10
    results = run_multirank(_interleaved_rank, world, args=(layer_specs, chunks, micro_batches, batches))
    ref = reference(layer_specs)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    d = data(batches * micro_batches)
    ref_losses = []
    for b in range(batches):
        chunk = d[b * micro_batches : (b + 1) * micro_batches]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(
            ref(torch.cat([c[0] for c in chunk])), torch.cat([c[1] for c in chunk])
        )
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    ref_params = dict(ref.named_parameters())
    seen = set()
    for losses, params, _eval_loss, _logits, n_chunks in results:
        assert n_chunks == chunks
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name].detach(), rtol=1e-5, atol=1e-6)
            seen.add(name)
    assert seen == set(ref_params)
    with torch.no_grad():
        ref_logits = [ref(x) for x, _ in data(micro_batches, seed=7)]
    last = results[-1][3]
    assert last is not None and len(last) == micro_batches
    for out, r in zip(last, ref_logits):
        torch.testing.assert_close(out, r, rtol=1e-5, atol=1e-6)


# -- tuple (hidden, bool mask) activations ---------------------------------------------------
class MaskStart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.lin(x), x > 0


class MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, inputs):
        h, mask = inputs
        assert mask.dtype == torch.bool
        return torch.tanh(self.lin(h)) * mask + h * (~mask), mask


class MaskEnd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, 3)

    def forward(self, inputs):
        h, mask = inputs
        return self.lin(h.masked_fill(~mask, 0.0))


def mask_specs():
    return [LayerSpec(MaskStart), LayerSpec(MaskedBlock), LayerSpec(MaskedBlock), LayerSpec(MaskEnd)]


def _mask_rank(micro_batches, batches):
    model = PipelineModule(
        mask_specs(),
        num_stages=2,
        loss_fn=nn.functional.cross_entropy,
        seed_layers=True,
        partition_method="uniform",
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = PipelineEngine(
        model,
        opt,
        {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": micro_batches},
        has_bool_tensors=True,
    )
    d = data(batches * micro_batches, seed=5)
    losses = [
        engine.train_batch(iter(d[b * micro_batches : (b + 1) * micro_batches])).item()
        for b in range(batches)
    ]
    return losses, {
        f"{i}.{n}": p.detach().clone()
        for i, m in model.layer_modules().items()
        for n, p in m.named_parameters()
    }


def test_tuple_and_bool_activations_match_single_process():
    micro_batches, batches = 3, 10
    results = run_multirank(_mask_rank, 2, args=(micro_batches, batches))
    ref = reference(mask_specs())
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    d = data(batches * micro_batches, seed=5)
    ref_losses = []
    for b in range(batches):
        chunk = d[b * micro_batches : (b + 1) * micro_batches]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(
            ref(torch.cat([c[0] for c in chunk])), torch.cat([c[1] for c in chunk])
        )
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    ref_params = dict(ref.named_parameters())
    for losses, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name].detach(), rtol=1e-5, atol=1e-6)
