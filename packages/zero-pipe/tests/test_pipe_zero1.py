"""ZeRO stage 1 across the data-parallel group of a pipeline (2 stages x 2 replicas):
parity with one process (tied weights, Adam, gradient clipping) and optimizer-state memory."""

from __future__ import annotations

import torch
from torch import nn
from zero_core.testing import run_multirank
from zero_pipe import LayerSpec, PipelineConfigError, PipelineEngine, PipelineModule, TiedLayerSpec

DIM, VOCAB, MB, CLIP = 8, 13, 2, 0.5


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
        return torch.tanh(self.lin(x)) + x


def _logits(embed, x):
    return x @ embed.weight.t()


def specs():
    return [
        TiedLayerSpec("embed", Embed),
        LayerSpec(Block),
        LayerSpec(Block),
        LayerSpec(Block),
        TiedLayerSpec("embed", Embed, forward_fn=_logits),
    ]


def data(n):
    g = torch.Generator().manual_seed(11)
    return [
        (torch.randint(0, VOCAB, (MB,), generator=g), torch.randint(0, VOCAB, (MB,), generator=g))
        for _ in range(n)
    ]


def _engine(stage, micro_batches):
    model = PipelineModule(
        specs(),
        num_stages=2,
        loss_fn=nn.functional.cross_entropy,
        seed_layers=True,
        partition_method="uniform",
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    cfg = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": micro_batches,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
    }
    return model, PipelineEngine(model, opt, cfg)


def _zero1_rank(micro_batches, batches):
    out = {}
    for stage in (0, 1):
        model, engine = _engine(stage, micro_batches)
        dp, dp_rank = engine.dp_size, model.grid().data_parallel_id
        d = data(batches * micro_batches * dp)
        losses, norms = [], []
        for b in range(batches):
            start = (b * dp + dp_rank) * micro_batches
            losses.append(engine.train_batch(iter(d[start : start + micro_batches])).item())
            norms.append(engine.get_global_grad_norm())
        params = {
            f"{i}.{n}": p.detach().clone()
            for i, m in model.layer_modules().items()
            for n, p in m.named_parameters()
        }
        out[stage] = (losses, norms, params, engine.memory_breakdown()["optimizer_states"])
    errors = []
    for bad in (2, 3):
        try:
            _engine(bad, micro_batches)
        except PipelineConfigError as err:
            errors.append(str(err))
    return out, errors


def test_zero1_pipeline_matches_single_process_and_partitions_optimizer_state():
    micro_batches, batches, dp = 2, 10, 2
    results = run_multirank(_zero1_rank, 4, args=(micro_batches, batches))
    torch.manual_seed(1234)
    embed = Embed()
    blocks = []
    for i in range(3):
        torch.manual_seed(1235 + i)
        blocks.append(Block())
    params = list(embed.parameters()) + [p for b in blocks for p in b.parameters()]
    opt = torch.optim.Adam(params, lr=0.02)
    d = data(batches * micro_batches * dp)
    ref_losses, ref_norms = [], []
    for b in range(batches):
        chunk = d[b * micro_batches * dp : (b + 1) * micro_batches * dp]
        x = torch.cat([c[0] for c in chunk])
        y = torch.cat([c[1] for c in chunk])
        opt.zero_grad()
        h = embed(x)
        for blk in blocks:
            h = blk(h)
        loss = nn.functional.cross_entropy(_logits(embed, h), y)
        loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        ref_losses.append(loss.item())
    ref = {"0.weight": embed.weight, "4.weight": embed.weight}
    for i, blk in enumerate(blocks):
        for n, p in blk.named_parameters():
            ref[f"{i + 1}.{n}"] = p
    assert max(ref_norms) > CLIP  # clipping is exercised
    for out, errors in results:
        for stage in (0, 1):
            losses, norms, got, _ = out[stage]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
            for name, p in got.items():
                torch.testing.assert_close(p, ref[name].detach(), rtol=1e-5, atol=1e-6)
        full, sharded = out[0][3], out[1][3]
        assert 0 < sharded <= full / dp + 64, (full, sharded)  # states drop by the dp size (+ padding, step)
        assert len(errors) == 2 and all("not compatible with pipeline parallelism" in e for e in errors)
