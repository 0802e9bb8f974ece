"""Small reference models and seeded batches for tests that train with zero and with plain PyTorch.

Import them from here (``from zero_core.testing.models import TinyLM, token_batch``), not from
``zero_core.testing``, which stays free of torch so that importing the harness is cheap.

[Note: reference models]
A parity test builds the same model twice, once in the single-process reference and once on
every rank, and expects identical initial weights. Both sides call ``torch.manual_seed(s)`` and
then the constructor, so the weights depend only on the order in which the constructor creates
its submodules. The classes here therefore create their submodules in one fixed order, whatever
the options (``TinyLM``: ``emb``, ``attn``, ``l1``, ``l2``, ``norm``, ``head``, ``unused``; the
ones the options leave out are simply skipped), and keep those attribute names, because tests
reach into them (``model.l1.weight``) and compare state dicts key by key.

Batches come from their own ``torch.Generator`` seeded per call, never from the global RNG, so
drawing a batch cannot shift the weights of a model built afterwards, and every rank can draw
the *global* batch of a step and slice out its own part.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

_MLP_KINDS = ("residual", "two_layer", "one_layer")


def _check_sizes(where: str, **sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {name} must be an int >= 1, got {value!r}")


class TinyLM(nn.Module):
    """A token model whose forward returns the cross-entropy loss of predicting ``y`` from ``x``.

    ``h = emb(x)``; with ``attention`` a causal, bias-free two-head self-attention is added
    residually; then the MLP, by ``mlp``: ``"residual"`` ``h = h + l2(tanh(l1(h)))``,
    ``"two_layer"`` ``h = l2(tanh(l1(h)))``, ``"one_layer"`` ``h = tanh(l1(h))`` (no ``l2``;
    the head reads the hidden width); ``norm`` applies a LayerNorm; ``head`` gives the logits,
    cast to fp32 before the loss so the model also trains in bf16/fp16. ``unused`` adds a
    ``Linear(3, 3)`` that forward never touches (its gradient must stay None).
    ``forward(x, y, poison=True)`` returns ``loss * inf``, for tests of overflow handling.
    See [Note: reference models] for why the submodule order is fixed.
    """

    def __init__(
        self,
        vocab: int = 32,
        dim: int = 16,
        hidden: int = 23,
        *,
        attention: bool = False,
        mlp: str = "residual",
        norm: bool = True,
        unused: bool = False,
    ) -> None:
        super().__init__()
        _check_sizes("TinyLM", vocab=vocab, dim=dim, hidden=hidden)
        if mlp not in _MLP_KINDS:
            raise ValueError(f"TinyLM: mlp must be one of {list(_MLP_KINDS)}, got {mlp!r}")
        self.vocab, self.mlp_kind = vocab, mlp
        self.emb = nn.Embedding(vocab, dim)
        # A key bias would have an (almost) zero gradient whose rounding noise Adam turns into steps.
        self.attn = nn.MultiheadAttention(dim, 2, bias=False, batch_first=True) if attention else None
        self.l1 = nn.Linear(dim, hidden)
        self.l2 = None if mlp == "one_layer" else nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim) if norm else None
        self.head = nn.Linear(hidden if self.l2 is None else dim, vocab)
        self.unused = nn.Linear(3, 3) if unused else None

    def forward(self, x: torch.Tensor, y: torch.Tensor, poison: bool = False) -> torch.Tensor:
        h = self.emb(x)
        if self.attn is not None:
            mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
            h = h + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        if self.l2 is None:
            h = torch.tanh(self.l1(h))
        else:
            m = self.l2(torch.tanh(self.l1(h)))
            h = h + m if self.mlp_kind == "residual" else m
        if self.norm is not None:
            h = self.norm(h)
        logits = self.head(h)
        loss = F.cross_entropy(logits.float().reshape(-1, self.vocab), y.reshape(-1))
        return loss * float("inf") if poison else loss


class _Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))`` then ``x + fc2(gelu(fc1(x)))``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(x)))


class BlockLM(nn.Module):
    """``emb``, ``blocks`` (``n_blocks`` transformer blocks, one submodule each, so that stage 3
    gathers and prefetches per block), ``head``; forward takes token ids and returns the
    next-token cross-entropy. With ``skip_odd`` the forward skips block 1 on odd calls (counted in
    ``calls``), a model whose module order changes between iterations.
    Train it with SGD, not Adam: the attention's key bias has a zero true gradient, and Adam turns
    the summation-order noise of that zero into full-size steps of either sign."""

    def __init__(self, n_blocks: int = 3, vocab: int = 32, dim: int = 16, *, skip_odd: bool = False) -> None:
        super().__init__()
        _check_sizes("BlockLM", n_blocks=n_blocks, vocab=vocab, dim=dim)
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([_Block(dim) for _ in range(n_blocks)])
        self.head = nn.Linear(dim, vocab)
        self.skip_odd = skip_odd
        self.calls = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for i, b in enumerate(self.blocks):
            if self.skip_odd and i == 1 and self.calls % 2 == 1:
                continue
            x = b(x)
        self.calls += 1
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), ids[:, 1:].reshape(-1))


class MLPClassifier(nn.Module):
    """``cross_entropy(l2(tanh(l1(x))), y)``: a two-layer classifier of float feature vectors."""

    def __init__(self, n_in: int, hidden: int, n_classes: int) -> None:
        super().__init__()
        _check_sizes("MLPClassifier", n_in=n_in, hidden=hidden, n_classes=n_classes)
        self.l1 = nn.Linear(n_in, hidden)
        self.l2 = nn.Linear(hidden, n_classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.l2(torch.tanh(self.l1(x))), y)


def token_batch(seed: int, rows: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, two ``(rows, seq)`` int64 tensors of tokens in ``[0, vocab)``, drawn in
    that order from a generator seeded with ``seed`` (the same seed gives the same batch)."""
    _check_sizes("token_batch", rows=rows, seq=seq, vocab=vocab)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, seq), generator=g), torch.randint(
        0, vocab, (rows, seq), generator=g
    )


def classification_batch(
    seed: int, rows: int, n_in: int, n_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features ``randn(rows, n_in)`` and labels in ``[0, n_classes)``, in that order from a
    generator seeded with ``seed``."""
    _check_sizes("classification_batch", rows=rows, n_in=n_in, n_classes=n_classes)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, n_in, generator=g), torch.randint(0, n_classes, (rows,), generator=g)
