"""PipelineEngine training/eval vs one process training the same nn.Sequential (fp32)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zero_core.testing import run_multirank
from zero_pipe import LayerSpec, PipelineEngine, PipelineModule, TiedLayerSpec

DIM, VOCAB, MB = 8, 11, 2


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.tanh(self.proj(x))


def specs():
    return (
        [LayerSpec(nn.Linear, DIM, DIM)]
        + [LayerSpec(Head) for _ in range(3)]
        + [LayerSpec(nn.Linear, DIM, 3)]
    )


def reference(layer_specs):
    layers = []
    for idx, spec in enumerate(layer_specs):
        torch.manual_seed(1234 + idx)
        layers.append(spec.build())
    return nn.Sequential(*layers)


def make_data(num_batches, micro_batches, dp, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = num_batches * micro_batches * dp
    return [
        (torch.randn(MB, DIM, generator=g), torch.randint(0, 3, (MB,), generator=g)) for _ in range(total)
    ]


def my_micro_batches(data, micro_batches, dp, dp_rank, batch):
    """The micro-batches data-parallel replica ``dp_rank`` trains on in batch ``batch``."""
    start = batch * micro_batches * dp
    chunk = data[start : start + micro_batches * dp]
    return chunk[dp_rank * micro_batches : (dp_rank + 1) * micro_batches]


def _train_rank(num_stages, micro_batches, batches, lookahead):
    world = torch.distributed.get_world_size()
    dp = world // num_stages
    model = PipelineModule(
        specs(), num_stages=num_stages, loss_fn=nn.functional.cross_entropy, seed_layers=True
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = PipelineEngine(
        model,
        opt,
        {
            "train_micro_batch_size_per_gpu": MB,
            "gradient_accumulation_steps": micro_batches,
            "pipeline": {"lookahead": lookahead},
        },
    )
    assert engine.lookahead == lookahead
    data = make_data(batches, micro_batches, dp)
    dp_rank = model.grid().data_parallel_id
    losses = []
    for b in range(batches):
        it = iter(my_micro_batches(data, micro_batches, dp, dp_rank, b))
        losses.append(engine.train_batch(it).item())
    params = {
        f"{idx}.{n}": p.detach().clone()
        for idx, m in model.layer_modules().items()
        for n, p in m.named_parameters()
    }
    eval_data = make_data(1, micro_batches, 1, seed=99)
    loss, logits = engine.eval_batch(iter(eval_data), return_logits=True)
    return losses, params, loss.item(), logits


def _reference_run(num_stages, micro_batches, batches, dp):
    model = reference(specs())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = make_data(batches, micro_batches, dp)
    losses = []
    for b in range(batches):
        chunk = data[b * micro_batches * dp : (b + 1) * micro_batches * dp]
        x = torch.cat([c[0] for c in chunk])
        y = torch.cat([c[1] for c in chunk])
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    eval_data = make_data(1, micro_batches, 1, seed=99)
    with torch.no_grad():
        outs = [model(x) for x, _ in eval_data]
        eval_loss = torch.stack(
            [nn.functional.cross_entropy(o, y) for o, (_, y) in zip(outs, eval_data)]
        ).mean()
    return model, losses, eval_loss.item(), outs


def _close(a, b, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "world,num_stages,micro_batches,lookahead",
    [
        (2, 2, 1, 0),
        (2, 2, 4, 0),
        (4, 4, 3, 0),
        (4, 4, 6, 0),
        (4, 2, 2, 0),
        (4, 2, 5, 0),
        (2, 2, 4, 1),
        (4, 4, 6, 2),
    ],
)
def test_pipeline_matches_single_process(world, num_stages, micro_batches, lookahead):
    batches = 10
    dp = world // num_stages
    results = run_multirank(
        _train_rank, world, args=(num_stages, micro_batches, batches, lookahead), timeout=120.0
    )
    ref_model, ref_losses, ref_eval, ref_outs = _reference_run(num_stages, micro_batches, batches, dp)
    ref_params = dict(ref_model.named_parameters())
    seen = set()
    for losses, params, eval_loss, _logits in results:
        _close(torch.tensor(losses), torch.tensor(ref_losses))
        _close(torch.tensor(eval_loss), torch.tensor(ref_eval))
        for name, p in params.items():
            _close(p, ref_params[name].detach())
            seen.add(name)
    assert seen == set(ref_params)
    last = results[world - 1] if dp == 1 else results[-1]
    assert last[3] is not None and len(last[3]) == micro_batches
    for out, ref in zip(last[3], ref_outs):
        _close(out, ref)


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, DIM) * 0.3)

    def forward(self, ids):
        return self.weight[ids]


def _logits(embed, x):
    return x @ embed.weight.t()


def tied_specs():
    return [
        TiedLayerSpec("embed", Embed),
        LayerSpec(Head),
        LayerSpec(Head),
        TiedLayerSpec("embed", Embed, forward_fn=_logits),
    ]


def _tied_rank(micro_batches, batches):
    model = PipelineModule(
        tied_specs(),
        num_stages=2,
        loss_fn=nn.functional.cross_entropy,
        seed_layers=True,
        partition_method="uniform",
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = PipelineEngine(
        model, opt, {"train_batch_size": MB * micro_batches, "train_micro_batch_size_per_gpu": MB}
    )
    data = _tied_data(batches, micro_batches)
    losses = [
        engine.train_batch(iter(data[b * micro_batches : (b + 1) * micro_batches])).item()
        for b in range(batches)
    ]
    return (
        losses,
        model.tied_modules["embed"].weight.detach().clone(),
        {
            f"{idx}.{n}": p.detach().clone()
            for idx, m in model.layer_modules().items()
            for n, p in m.named_parameters()
        },
    )


def _tied_data(batches, micro_batches):
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, VOCAB, (MB,), generator=g), torch.randint(0, VOCAB, (MB,), generator=g))
        for _ in range(batches * micro_batches)
    ]


def test_tied_embeddings_stay_identical_and_match_reference():
    micro_batches, batches = 3, 10
    (l0, w0, p0), (l1, w1, p1) = run_multirank(_tied_rank, 2, args=(micro_batches, batches))
    torch.testing.assert_close(w0, w1, rtol=0, atol=0)  # bit-identical copies
    # Reference: one shared module, seeded as the first occurrence (layer 0).
    torch.manual_seed(1234)
    embed = Embed()
    torch.manual_seed(1235)
    h1 = Head()
    torch.manual_seed(1236)
    h2 = Head()
    params = list(embed.parameters()) + list(h1.parameters()) + list(h2.parameters())
    opt = torch.optim.Adam(params, lr=0.01)
    data = _tied_data(batches, micro_batches)
    ref_losses = []
    for b in range(batches):
        chunk = data[b * micro_batches : (b + 1) * micro_batches]
        x = torch.cat([c[0] for c in chunk])
        y = torch.cat([c[1] for c in chunk])
        opt.zero_grad()
        loss = nn.functional.cross_entropy(_logits(embed, h2(h1(embed(x)))), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    _close(torch.tensor(l1), torch.tensor(ref_losses))
    _close(w0, embed.weight.detach())
    _close(p0["1.proj.weight"], h1.proj.weight.detach())
    _close(p1["2.proj.weight"], h2.proj.weight.detach())


def _errors_rank():
    model = PipelineModule(specs(), num_stages=2, loss_fn=nn.functional.cross_entropy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    msgs = []
    for bad in (
        {"train_micro_batch_size_per_gpu": MB, "zero_optimization": {"stage": 2}},
        {"train_batch_size": 5, "train_micro_batch_size_per_gpu": 2},
    ):
        try:
            PipelineEngine(model, opt, bad)
        except ValueError as err:
            msgs.append(str(err))
    engine = PipelineEngine(model, opt, {"train_micro_batch_size_per_gpu": MB})
    for fn in (engine.forward, engine.backward, engine.step):
        try:
            fn()
        except RuntimeError as err:
            msgs.append(str(err))
    return msgs


def test_engine_errors_are_clear():
    for msgs in run_multirank(_errors_rank, 2):
        assert "stage=2 is not compatible" in msgs[0]
        assert "divisible" in msgs[1]
        assert all("train_batch()" in m for m in msgs[2:]) and len(msgs) == 5


def _eval_no_bcast_rank():
    model = PipelineModule(specs(), num_stages=3, loss_fn=nn.functional.cross_entropy, seed_layers=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PipelineEngine(
        model, opt, {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": 2}
    )
    eval_data = make_data(1, 2, 1, seed=5)
    kept = engine.eval_batch(iter(eval_data), bcast_loss=False)
    shared = engine.eval_batch(iter(eval_data))
    return engine.is_last_stage(), kept, shared


def test_eval_without_bcast_leaves_other_stages_none():
    """bcast_loss=False: only the last stage has the loss; the others get None (as in DeepSpeed),
    not a zero that reads like a loss."""
    results = run_multirank(_eval_no_bcast_rank, 3)
    last_loss = results[-1][2]
    for is_last, kept, shared in results:
        torch.testing.assert_close(shared, last_loss)
        if is_last:
            torch.testing.assert_close(kept, last_loss)
        else:
            assert kept is None
