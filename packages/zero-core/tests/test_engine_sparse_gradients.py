"""Sparse embedding gradients and DeepSpeed's ``sparse_gradients`` bookkeeping (stage 0).

DeepSpeed trains ``nn.Embedding(..., sparse=True)`` in data parallelism; with
``sparse_gradients: true`` it lists every embedding weight in
``engine.sparse_tensor_module_names``, saves the set with its checkpoints and restores it on
load (merging on a non-strict load of another model). The reduction itself is tested in
test_sparse_gradients.py ([Note: sparse gradient reduction]); here the bookkeeping, with training
matching single-process PyTorch. See [Note: sparse gradients].
"""

from __future__ import annotations

import copy
import warnings

import torch
from zero_core.testing import run_multirank

VOCAB, DIM, WORLD = 12, 4, 2


class EmbNet(torch.nn.Module):
    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM, sparse=sparse)
        self.head = torch.nn.Linear(DIM, 3)

    def forward(self, ids, y):
        return torch.nn.functional.cross_entropy(self.head(self.emb(ids).mean(1)), y)


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randint(0, VOCAB, (2, 3), generator=g), torch.randint(0, 3, (2,), generator=g)


def _cfg(**extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_optimization": {"stage": 0},
        **extra,
    }


def _rank(save_dir: str) -> dict:
    import zero_core
    from zero_core import comm

    rank = comm.get_rank()
    torch.manual_seed(0)
    engine, *_ = zero_core.initialize(model=EmbNet(), config=_cfg(sparse_gradients=True))
    assert engine.sparse_tensor_module_names == {"emb.weight"}
    for step in range(3):
        engine.backward(engine(*_batch(step, rank)))
        engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # off: nothing to say
        plain, *_ = zero_core.initialize(model=EmbNet(sparse=False), config=_cfg())
    assert plain.sparse_tensor_module_names == set()
    plain.load_checkpoint(save_dir, tag="t")  # strict: the checkpoint's set, as DeepSpeed
    names = [plain.sparse_tensor_module_names]

    class NoEmb(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(DIM, 3)

    other, *_ = zero_core.initialize(model=NoEmb(), config=_cfg(sparse_gradients=True))
    other.load_checkpoint(save_dir, tag="t", load_module_strict=False, load_optimizer_states=False)
    names.append(other.sparse_tensor_module_names)  # non-strict: the saved names this model has
    return {"state": state, "names": names}


def test_sparse_embedding_trains_as_pytorch_and_the_names_follow_checkpoints(tmp_path):
    torch.manual_seed(0)
    ref = copy.deepcopy(EmbNet())
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        for r in range(WORLD):
            (ref(*_batch(step, r)) / WORLD).backward()
        opt.step()
        opt.zero_grad()
    for got in run_multirank(_rank, WORLD, args=(str(tmp_path),), timeout=180):
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)
        assert got["names"] == [{"emb.weight"}, set()]
