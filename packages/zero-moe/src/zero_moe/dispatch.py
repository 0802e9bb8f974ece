"""Moving tokens to their experts and back: the differentiable all-to-all and the MoE layer core.

[Note: capacity dispatch]
Each rank scatters its kept assignments into a zero buffer ``[E, C, M]`` (slot ``position`` of
expert ``e``); rows ``[r*El, (r+1)*El)`` belong to expert-parallel rank ``r``, so one
equal-split all-to-all hands every rank ``[ep, El, C, M]``: the tokens of all ranks for its
own experts. Expert ``i`` runs on ``[:, i]`` flattened, a second all-to-all returns the
results in the original layout, and each token sums its ``k`` results times its weights.
Empty slots ride along as zeros; their outputs are never gathered.

[Note: ragged dispatch]
The dropless path without padding sends only real assignments. Assignments are sorted by
global expert (``GateOutput.order``), so the rows for rank ``r`` are contiguous; the per-expert
counts are exchanged first (an int64 all-to-all) to size the uneven all-to-all of the tokens.
Received rows arrive grouped by source rank, then local expert; a stable sort by local expert
regroups them, each expert runs on its run of rows, and the inverse permutation plus the
reverse all-to-all bring the results home.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import FunctionCtx
from zero_core import comm

from zero_moe.experts import Experts
from zero_moe.gating import GateOutput, TopKGate


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd: the backward is the reverse exchange of the gradient."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        input: torch.Tensor,
        group: dist.ProcessGroup | None,
        output_splits: list[int] | None,
        input_splits: list[int] | None,
        out_rows: int,
    ) -> torch.Tensor:
        ctx.group = group
        ctx.output_splits = output_splits
        ctx.input_splits = input_splits
        ctx.in_rows = input.shape[0]
        output = input.new_empty((out_rows, *input.shape[1:]))
        comm.all_to_all_single(output, input.contiguous(), output_splits, input_splits, group=group)
        return output

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_in = grad.new_empty((ctx.in_rows, *grad.shape[1:]))
        comm.all_to_all_single(
            grad_in, grad.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group
        )
        return grad_in, None, None, None, None


def all_to_all(
    input: torch.Tensor,
    group: dist.ProcessGroup | None,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
) -> torch.Tensor:
    """Differentiable all-to-all over dim 0; equal splits when the split lists are ``None``."""
    if group is None or comm.get_world_size(group) == 1:
        return input
    out_rows = input.shape[0] if output_splits is None else int(sum(output_splits))
    return _AllToAll.apply(input, group, output_splits, input_splits, out_rows)


class MOELayer(nn.Module):
    """Gate + dispatch + experts + combine for tokens ``[S, M]`` (the inner layer of :class:`MoE`)."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_size: int, num_local_experts: int) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.ep_group: dist.ProcessGroup | None = None

    def _set_ep_group(self, group: dist.ProcessGroup | None) -> None:
        self.ep_group = group
        self.gate.ep_group = group

    def forward(
        self, x: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        routing = self.gate(x, used_token)
        if routing.capacity is None:
            out = self._ragged(x, routing)
        else:
            out = self._padded(x, routing)
        return out, routing.l_aux, routing.exp_counts

    def _combine(self, x: torch.Tensor, results: torch.Tensor, routing: GateOutput) -> torch.Tensor:
        """Sum each token's expert ``results`` (one row per kept assignment, in ``order``) by weight."""
        num_tokens = x.shape[0]
        tokens = routing.order % num_tokens
        w = routing.weights.t().reshape(-1)[routing.order].to(results.dtype)
        return x.new_zeros(x.shape).index_add(0, tokens, results * w[:, None])

    def _padded(self, x: torch.Tensor, routing: GateOutput) -> torch.Tensor:
        # See [Note: capacity dispatch].
        num_tokens, model_dim = x.shape
        num_experts = routing.exp_counts.numel()
        capacity = routing.capacity
        assert capacity is not None
        flat_expert = routing.expert_idx.t().reshape(-1)[routing.order]
        flat_pos = routing.position.t().reshape(-1)[routing.order]
        slots = flat_expert * capacity + flat_pos
        tokens = routing.order % num_tokens
        buffer = x.new_zeros(num_experts * capacity, model_dim).index_copy(0, slots, x[tokens])
        received = all_to_all(buffer, self.ep_group)
        local = received.view(self.ep_size, self.num_local_experts, capacity, model_dim).transpose(0, 1)
        outs = self.experts(local.reshape(self.num_local_experts, self.ep_size * capacity, model_dim))
        outs = outs.view(self.num_local_experts, self.ep_size, capacity, model_dim).transpose(0, 1)
        returned = all_to_all(outs.reshape(num_experts * capacity, model_dim), self.ep_group)
        return self._combine(x, returned[slots], routing)

    def _ragged(self, x: torch.Tensor, routing: GateOutput) -> torch.Tensor:
        # See [Note: ragged dispatch].
        num_tokens = x.shape[0]
        send = x[routing.order % num_tokens]
        ep, n_local = self.ep_size, self.num_local_experts
        if self.ep_group is None or ep == 1:
            results = self.experts.forward_ragged(send, routing.counts.tolist())
            return self._combine(x, results, routing)
        send_counts = routing.counts
        recv_counts = torch.empty_like(send_counts)
        comm.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.ep_group)
        input_splits = send_counts.view(ep, n_local).sum(1).tolist()
        recv_matrix = recv_counts.view(ep, n_local)  # [source rank, local expert]
        output_splits = recv_matrix.sum(1).tolist()
        received = all_to_all(send, self.ep_group, output_splits, input_splits)
        row_expert = torch.repeat_interleave(
            torch.arange(n_local, device=x.device).repeat(ep), recv_matrix.reshape(-1)
        )
        perm = torch.argsort(row_expert, stable=True)
        grouped = self.experts.forward_ragged(received[perm], recv_matrix.sum(0).tolist())
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        results = all_to_all(grouped[inverse], self.ep_group, input_splits, output_splits)
        return self._combine(x, results, routing)
