"""Tensor-parallel linear and embedding layers holding one rank's shard.

[Note: tensor-parallel layout]
Megatron-style: a column-parallel linear keeps a block of output features (its output is the
rank's slice, consumed by the next row-parallel linear without communication); a row-parallel
linear keeps the matching block of input features, so each rank computes a partial sum and an
all-reduce (through ``zero_core.comm``) completes it before the bias is added once. Fused
projections (GPT-2's ``c_attn`` = [q | k | v]) are column-split per block so every rank keeps
whole heads of q, k and v. Embeddings and the LM head are split over the vocabulary (rows):
the embedding looks up the rows it owns, zeros the others and all-reduces; the LM head computes
its vocabulary slice and all-gathers the logits. A vocabulary that does not divide ``tp_size``
is padded to the next multiple (padding logits are cut off after the gather). Tied LM head and
input embedding stay tied: both hold the same vocabulary rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from zero_core import comm

from zero_inference.quantize import Int8Weight, apply_linear


def shard_rows(t: torch.Tensor, rank: int, world: int, blocks: int = 1) -> torch.Tensor:
    """Rank's slice of dim 0 of ``t``, taken from each of ``blocks`` equal blocks (fused projections)."""
    if t.shape[0] % blocks or (t.shape[0] // blocks) % world:
        raise ValueError(
            f"cannot split dimension {t.shape[0]} into {blocks} block(s) over {world} tensor-parallel ranks"
        )
    parts = t.chunk(blocks, dim=0)
    return torch.cat([p.chunk(world, dim=0)[rank] for p in parts], dim=0).clone()


class ShardedLinear(nn.Module):
    """Common state of the TP linears: a weight ``[out_local, in_local]`` (fp or int8) and a bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: object = None) -> None:
        super().__init__()
        self.weight: nn.Parameter | Int8Weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.group = group

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def quantize_(self, q_groups: int) -> None:
        """Replace the weight by its int8 form (see [Note: int8 weight groups])."""
        weight = self.weight
        del self.weight
        self.weight = Int8Weight(weight.data, q_groups)

    def extra_repr(self) -> str:
        return f"in_local={self.in_features}, out_local={self.out_features}, bias={self.bias is not None}"


class ColumnParallelLinear(ShardedLinear):
    """Output features split over ranks; ``gather_output`` all-gathers them (used for the LM head)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        group: object = None,
        gather_output: bool = False,
        full_out_features: int | None = None,
    ) -> None:
        super().__init__(weight, bias, group)
        self.gather_output = gather_output
        self.full_out_features = full_out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = apply_linear(self.weight, x, self.bias)
        if not self.gather_output:
            return y
        world = comm.get_world_size(self.group)
        # all_gather_into_tensor concatenates along dim 0: gather [world, ..., out_local] then move.
        y = y.contiguous()
        out = torch.empty((world, *y.shape), dtype=y.dtype, device=y.device)
        comm.all_gather_into_tensor(out, y, group=self.group)
        out = torch.movedim(out, 0, -2).reshape(*y.shape[:-1], world * y.shape[-1])
        if self.full_out_features is not None:
            out = out[..., : self.full_out_features]
        return out


class RowParallelLinear(ShardedLinear):
    """Input features split over ranks; partial products are all-reduced, then the bias is added."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = apply_linear(self.weight, x, None)
        if comm.get_world_size(self.group) > 1:
            y = y.contiguous()
            comm.all_reduce(y, group=self.group)
        return y + self.bias if self.bias is not None else y


def _vocab_parallel_lookup(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows of ``module.weight`` (vocabulary ``[start, start + rows)``) for ``ids``, summed over ranks."""
    local = ids - module.start
    outside = (local < 0) | (local >= module.weight.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), module.weight)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    if comm.get_world_size(module.group) > 1:
        comm.all_reduce(out, group=module.group)
    return out


class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` whose rows (vocabulary) are split over ranks; see [Note: tensor-parallel layout]."""

    def __init__(
        self,
        weight: torch.Tensor,
        *,
        start: int,
        num_embeddings: int,
        padding_idx: int | None = None,
        group: object = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.num_embeddings = num_embeddings
        self.embedding_dim = weight.shape[1]
        self.padding_idx = padding_idx
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _vocab_parallel_lookup(self, ids)

    def extra_repr(self) -> str:
        return f"rows [{self.start}, {self.start + self.weight.shape[0]}) of {self.num_embeddings}"


class _VocabParallelLookup(nn.Embedding):
    """The sharded lookup in place of ``nn.Embedding.forward``, under an embedding subclass."""

    start: int
    group: object

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _vocab_parallel_lookup(self, ids)


_PARALLEL_SUBCLASSES: dict[type, type] = {}


def shard_embedding(old: nn.Module, rows: torch.Tensor, *, start: int, group: object = None) -> nn.Module:
    """The vocabulary-parallel form of the embedding ``old`` holding ``rows`` (vocabulary from ``start``).

    A plain ``nn.Embedding`` becomes a :class:`VocabParallelEmbedding`. A subclass with its own
    ``forward`` (Gemma scales its embeddings by sqrt(hidden)) keeps that forward: ``old`` itself
    becomes an instance of a subclass of its class whose ``nn.Embedding.forward`` (what its
    ``super().forward`` reaches) is the sharded lookup, so the extra work still happens.
    """
    if type(old) is nn.Embedding or not isinstance(old, nn.Embedding):
        return VocabParallelEmbedding(
            rows,
            start=start,
            num_embeddings=old.num_embeddings,
            padding_idx=getattr(old, "padding_idx", None),
            group=group,
        )
    cls = type(old)
    parallel = _PARALLEL_SUBCLASSES.get(cls)
    if parallel is None:
        parallel = type(f"VocabParallel{cls.__name__}", (cls, _VocabParallelLookup), {})
        _PARALLEL_SUBCLASSES[cls] = parallel
    old.__class__ = parallel
    old.weight = nn.Parameter(rows, requires_grad=False)
    old.start = start
    old.group = group
    return old


def vocab_shard(weight: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, int]:
    """(this rank's rows of a ``[vocab, dim]`` matrix padded to a multiple of ``world``, first row index)."""
    vocab = weight.shape[0]
    per = -(-vocab // world)
    start = rank * per
    rows = weight[start : min(start + per, vocab)]
    if rows.shape[0] < per:
        pad = torch.zeros((per - rows.shape[0], *weight.shape[1:]), dtype=weight.dtype, device=weight.device)
        rows = torch.cat([rows, pad], dim=0)
    return rows.clone(), start
