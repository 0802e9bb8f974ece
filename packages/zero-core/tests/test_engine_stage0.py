"""Stage 0 (data parallel) trains exactly like single-process PyTorch on the global batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from zero_core.testing import run_multirank

STEPS = 20
MICRO = 2
SEQ = 8
VOCAB = 32


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.l1 = nn.Linear(16, 24)
        self.l2 = nn.Linear(24, 16)
        self.head = nn.Linear(16, VOCAB)
        self.unused = nn.Linear(3, 3)  # never used in forward: must keep grad None everywhere

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(self.emb(x)))
        logits = self.head(self.l2(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def _data(step: int, world: int, gas: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    n = world * gas * MICRO
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


def _reference(
    world: int, gas: int, clip: float, opt_name: str
) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyLM()
    opt = _optimizer(opt_name, model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = _data(step, world, gas)
        loss = model(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_stage0(gas: int, clip: float, opt_name: str, bucket: int, overlap: bool):
    import zero_core
    from zero_core import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    torch.manual_seed(0)
    model = TinyLM()
    opt = _optimizer(opt_name, model.parameters())
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": 0, "reduce_bucket_size": bucket, "overlap_comm": overlap},
    }
    engine, _, _, _ = zero_core.initialize(model=model, optimizer=opt, config=cfg)
    losses = []
    for step in range(STEPS):
        x, y = _data(step, world, gas)
        for micro in range(gas):
            lo = (micro * world + rank) * MICRO
            loss = engine(x[lo : lo + MICRO], y[lo : lo + MICRO])
            engine.backward(loss)
            engine.step()
        # the global-batch loss is the mean over ranks and micro-batches
        t = torch.tensor([engine.last_loss])
        comm.all_reduce(t)
        losses.append(t.item() / world)
    assert model.unused.weight.grad is None
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "world,gas,clip,opt_name,bucket,overlap",
    [
        (2, 1, 0.0, "adamw", 500, True),
        (2, 3, 0.5, "sgd", 10**9, True),
        (4, 1, 0.5, "adam", 37, False),
        (4, 2, 0.0, "adamw", 200, True),
    ],
)
def test_stage0_matches_single_process(world, gas, clip, opt_name, bucket, overlap):
    ref_losses, ref_state = _reference(world, gas, clip, opt_name)
    results = run_multirank(_train_stage0, world, args=(gas, clip, opt_name, bucket, overlap), timeout=180)
    for losses, state in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
