"""Sparse reduction of embedding gradients at ZeRO stage 0 (DeepSpeed's sparse all-reduce).

[Note: sparse gradient reduction]
An ``nn.Embedding(sparse=True)`` (or ``EmbeddingBag``) gives its weight a sparse COO gradient
holding only the rows the batch looked up. Reducing it as a dense tensor would send every row;
DeepSpeed instead all-gathers each rank's (row indices, row values), divided by the world size
first, and sums the rows, so a step that touches few rows sends few bytes. zero does the same
at stage 0, for every natively sparse gradient (DeepSpeed needs no config key for those either):
one all-gather of (row count, had-a-gradient) per parameter, then the indices and the values,
padded to the largest row count; the result is coalesced, so duplicate rows are summed and the
gradient norm and clipping see each row once. With ``"sparse_gradients": true`` the dense
gradients of ``nn.Embedding``/``EmbeddingBag`` weights are sent the same way, as their non-zero
rows (DeepSpeed's older meaning of the key, which it removed in 0.19), and written back dense.

Cost: the row counts are data-dependent, so each sparse parameter costs host reads per
reduction (the largest count and every rank's count), as in DeepSpeed; models without sparse
gradients pay nothing. The exchange runs after backward, not overlapped with it.

ZeRO stages 1-3 partition a dense flat gradient buffer and do not take sparse gradients:
``check_no_sparse_gradients`` refuses them at ``initialize`` with an error (DeepSpeed supports
them at stage 0 only as well), rather than densify them silently. With a wider
``data_types.grad_accum_dtype`` the micro-step gradients are summed in that dtype here (see
[Note: gradient accumulation dtype] in ``grad_buckets.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero_core import comm

_EMBEDDINGS = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def sparse_gradient_params(module: torch.nn.Module, compress_dense: bool) -> dict[int, bool]:
    """id of each trainable embedding weight reduced sparsely -> whether its gradient is natively sparse."""
    out: dict[int, bool] = {}
    for m in module.modules():
        if isinstance(m, _EMBEDDINGS) and m.weight.requires_grad and (m.sparse or compress_dense):
            out[id(m.weight)] = bool(m.sparse)
    return out


def check_no_sparse_gradients(module: torch.nn.Module, stage: int) -> None:
    """Refuse sparse gradients at ZeRO stages 1-3, naming the parameters. See the Note above
    (``"sparse_gradients": true`` at those stages is a config error already)."""
    if stage == 0:
        return
    names = [
        f"{name}.weight" if name else "weight"
        for name, m in module.named_modules()
        if isinstance(m, _EMBEDDINGS) and m.sparse and m.weight.requires_grad
    ]
    if names:
        raise ValueError(
            f"ZeRO stage {stage} partitions dense gradients and does not take sparse ones; these embeddings "
            f"have sparse=True: {', '.join(names)}. Build them with sparse=False, or train at ZeRO stage 0, "
            "which reduces sparse gradients sparsely (as DeepSpeed)"
        )


class SparseGradReducer:
    """Averages the gradients of ``params`` over ``group`` as rows; see the Note above."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        native: dict[int, bool],
        *,
        group: dist.ProcessGroup | None = None,
        divisor: int,
        comm_dtype: torch.dtype | None = None,
        accum_dtype: torch.dtype | None = None,
    ) -> None:
        self.params = list(params)
        self.native = native
        self.group = group
        self.divisor = divisor
        self.comm_dtype = comm_dtype
        self.accum_dtype = accum_dtype
        self._acc: dict[int, torch.Tensor] = {}  # the wide sums (accum_dtype)

    def accumulate(self) -> None:
        """After each backward (with ``accum_dtype``): add the micro-step gradients into the wide sums."""
        if self.accum_dtype is None:
            return
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad.to(self.accum_dtype)
            self._acc[id(p)] = g if id(p) not in self._acc else self._acc[id(p)] + g
            p.grad = None

    def grad_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """``p``'s gradient as the step reads it (the wide sum with ``accum_dtype``)."""
        return self._acc.get(id(p)) if self.accum_dtype is not None else p.grad

    def _set(self, p: torch.nn.Parameter, value: torch.Tensor | None) -> None:
        if self.accum_dtype is None:
            p.grad = value
        elif value is None:
            self._acc.pop(id(p), None)
        else:
            self._acc[id(p)] = value

    def zero_grad(self) -> None:
        self._acc.clear()

    def _rows(self, p: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (row indices, row values) of ``p``'s gradient (empty without one)."""
        g = self.grad_of(p)
        width = p.shape[1:]
        if g is None:
            return (
                torch.zeros(0, dtype=torch.long, device=p.device),
                torch.zeros((0, *width), dtype=self.accum_dtype or p.dtype, device=p.device),
            )
        if g.is_sparse:
            c = g.coalesce()
            return c.indices()[0], c.values()
        rows = g.reshape(g.shape[0], -1).ne(0).any(dim=1).nonzero().reshape(-1)
        return rows, g.index_select(0, rows)

    @torch.no_grad()
    def reduce(self) -> None:
        """Exchange every parameter's rows and leave the averaged gradient (collective, in order)."""
        for p in self.params:
            self._reduce_one(p)

    def _reduce_one(self, p: torch.nn.Parameter) -> None:
        indices, values = self._rows(p)
        dtype = values.dtype
        send = values.to(self.comm_dtype) if self.comm_dtype is not None else values.clone()
        send.div_(self.divisor)
        world = comm.get_world_size(self.group)
        meta = torch.tensor([indices.numel(), int(self.grad_of(p) is not None)], device=p.device)
        metas = torch.empty(world * 2, dtype=meta.dtype, device=p.device)
        comm.all_gather_into_tensor(metas, meta, group=self.group)
        counts_and_flags = metas.view(world, 2).tolist()  # host read: See the Note's cost paragraph
        counts = [c for c, _ in counts_and_flags]
        if not any(f for _, f in counts_and_flags):
            self._set(p, None)
            return
        most = max(counts)
        if most == 0:  # gradients without a non-zero row anywhere: zero
            zero = torch.zeros(p.shape, dtype=dtype, device=p.device)
            self._set(p, zero.to_sparse(sparse_dim=1) if self.native[id(p)] else zero)
            return
        idx_pad = torch.zeros(most, dtype=torch.long, device=p.device)
        idx_pad[: indices.numel()] = indices
        val_pad = torch.zeros((most, *send.shape[1:]), dtype=send.dtype, device=p.device)
        val_pad[: send.shape[0]] = send
        idx_all = torch.empty(world * most, dtype=torch.long, device=p.device)
        val_all = torch.empty((world * most, *send.shape[1:]), dtype=send.dtype, device=p.device)
        comm.all_gather_into_tensor(idx_all, idx_pad, group=self.group)
        comm.all_gather_into_tensor(val_all, val_pad, group=self.group)
        keep = torch.cat(
            [torch.arange(r * most, r * most + c, device=p.device) for r, c in enumerate(counts)]
        )
        rows, vals = idx_all.index_select(0, keep), val_all.index_select(0, keep).to(dtype)
        if self.native[id(p)]:
            grad = torch.sparse_coo_tensor(rows.unsqueeze(0), vals, p.shape, check_invariants=False)
            self._set(p, grad.coalesce())
        else:
            self._set(p, torch.zeros(p.shape, dtype=dtype, device=p.device).index_add_(0, rows, vals))
