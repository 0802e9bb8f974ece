"""Top-k gating: which experts each token goes to, with what weight, in which buffer slot.

[Note: gating semantics]
For ``S`` tokens and ``E`` experts, with gate probabilities ``g = softmax(logits)`` (fp32):

* **Selection.** The first choice is ``argmax`` of the logits (plus Gumbel noise with the
  ``RSample`` policy, in training); choices 2..k are the top ``k-1`` of the remaining experts
  (plus Gumbel noise when second-expert sampling is on, in training). Noise only changes
  *which* experts are picked, never the weights.
* **Weights.** For ``k == 1`` a token's output is scaled by its raw gate probability (as in
  GShard/DeepSpeed top-1); for ``k >= 2`` the probabilities of the *kept* choices are
  renormalised to sum to one, so a token whose second choice was dropped keeps full weight on
  its first.
* **Capacity.** ``ceil(S / E * capacity_factor * k)``, at least ``min_capacity``
  (``eval_capacity_factor`` in eval mode). The factor ``k`` reproduces DeepSpeed's top-2,
  which uses twice the top-1 capacity.
* **Priority.** Slots of an expert are filled by choice rank first (all first choices before
  any second choice), then by token position, or, with Random Token Selection, by a random
  permutation of the tokens, so dropping does not favour the start of the sequence.
* **Dropless** (``drop_tokens=False``): nothing is dropped. The padded variant sets the
  capacity to the largest expert load, agreed over the expert-parallel group with a MAX
  all-reduce (all-to-all needs equal chunks); the ragged variant has no capacity at all
  (see [Note: ragged dispatch] in dispatch.py).
* **Auxiliary loss.** ``l_aux = E * sum_e mean_s(g[:, e]) * mean_s(first_choice[:, e])``, the
  GShard load-balancing loss; tokens masked by ``used_token`` count as not routed.
* **exp_counts.** Assignments per expert over all ``k`` choices *before* dropping.

Positions are computed with one sort of the ``k*S`` assignments keyed by
``(expert, choice, token priority)`` rather than DeepSpeed's one-hot cumsum, so memory is
O(k*S) instead of O(S*E*C).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from zero_core import comm

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")


def compute_capacity(
    num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int, k: int = 1
) -> int:
    """Slots per expert: ``max(ceil(num_tokens / num_experts * capacity_factor * k), min_capacity)``."""
    for name, value in (("num_tokens", num_tokens), ("num_experts", num_experts), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"compute_capacity: {name} must be an int >= 1, got {value!r}")
    if not isinstance(capacity_factor, (int, float)) or not capacity_factor > 0:
        raise ValueError(f"compute_capacity: capacity_factor must be > 0, got {capacity_factor!r}")
    if isinstance(min_capacity, bool) or not isinstance(min_capacity, int) or min_capacity < 0:
        raise ValueError(f"compute_capacity: min_capacity must be an int >= 0, got {min_capacity!r}")
    return max(math.ceil(num_tokens / num_experts * capacity_factor * k), min_capacity)


def gumbel_noise(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Standard Gumbel samples ``-log(-log(U))``; U is kept off 0 and 1 so the result is finite."""
    u = torch.rand(shape, device=device, dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    return -torch.log(-torch.log(u.clamp(tiny, 1.0 - 1e-7)))


def multiplicative_jitter(x: torch.Tensor, epsilon: float = 1e-2) -> torch.Tensor:
    """The ``Jitter`` policy: scale each input element by U(1 - epsilon, 1 + epsilon)."""
    noise = torch.empty_like(x).uniform_(1.0 - epsilon, 1.0 + epsilon)
    return x * noise


@dataclass
class GateOutput:
    """Routing decided by :func:`topk_gating` for ``S`` tokens, ``k`` choices, ``E`` experts.

    Per-assignment tensors are ``[S, k]``; ``order`` indexes the flattened choice-major
    assignments (``j * S + s``) that were kept, grouped by expert in slot order.
    """

    l_aux: torch.Tensor  # scalar, differentiable w.r.t. the gate
    exp_counts: torch.Tensor  # [E] int64 on CPU: assignments per expert before dropping
    expert_idx: torch.Tensor  # [S, k] int64
    weights: torch.Tensor  # [S, k] fp32 combine weights; 0 where dropped or unused
    keep: torch.Tensor  # [S, k] bool
    position: torch.Tensor  # [S, k] int64 slot in the expert's buffer (meaningful where keep)
    order: torch.Tensor  # [n_kept] int64
    counts: torch.Tensor  # [E] int64 (on the logits' device): kept assignments per expert
    capacity: int | None  # slots per expert; None on the ragged dropless path

    def combine_weights(self) -> torch.Tensor:
        """DeepSpeed's dense ``[S, E, C]`` combine tensor (for inspection and tests)."""
        if self.capacity is None:
            raise ValueError("combine_weights: the ragged dropless path has no capacity")
        s, k = self.expert_idx.shape
        e = self.exp_counts.numel()
        out = self.weights.new_zeros(s, e, self.capacity)
        tok = torch.arange(s, device=self.weights.device)[:, None].expand(s, k)
        out[tok[self.keep], self.expert_idx[self.keep], self.position[self.keep]] = self.weights[self.keep]
        return out

    def dispatch_mask(self) -> torch.Tensor:
        return self.combine_weights() != 0


def topk_gating(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    *,
    used_token: torch.Tensor | None = None,
    rsample: bool = False,
    sample_rest: bool = False,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ragged: bool = False,
    ep_group: dist.ProcessGroup | None = None,
) -> GateOutput:
    """Route ``S`` tokens given gate ``logits [S, E]``. See [Note: gating semantics]."""
    if logits.dim() != 2:
        raise ValueError(f"topk_gating: logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    num_tokens, num_experts = logits.shape
    if num_tokens == 0:
        raise ValueError("topk_gating: got no tokens; the MoE layer needs at least one token per rank")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"topk_gating: k must be an int in [1, num_experts={num_experts}], got {k!r}")
    device = logits.device
    logits = logits.float()
    gates = F.softmax(logits, dim=1)
    first, expert_idx = _select_experts(
        logits, k, rsample, sample_rest
    )  # noise: See [Note: gating semantics]
    if used_token is None:
        valid = torch.ones(num_tokens, dtype=torch.bool, device=device)
    else:
        valid = used_token.reshape(-1).to(device) != 0

    # Load-balancing loss from the first choice of the used tokens.
    # scatter, not F.one_hot: one_hot reads the index range back to the host (a device sync per layer)
    first_mask = torch.zeros(num_tokens, num_experts, dtype=torch.float32, device=device)
    first_mask.scatter_(1, first[:, None], valid[:, None].float())
    l_aux = (gates.mean(dim=0) * first_mask.mean(dim=0)).sum() * num_experts

    slots = _Slots(expert_idx, valid, num_experts, use_rts)
    exp_counts = slots.loads[:num_experts].detach().to("cpu")
    if drop_tokens:
        capacity: int | None = compute_capacity(num_tokens, num_experts, capacity_factor, min_capacity, k)
        keep_flat = slots.flat_valid & (slots.position_flat < capacity)
    else:
        keep_flat = slots.flat_valid
        capacity = None if ragged else _dropless_capacity(slots.loads[:num_experts], ep_group)

    keep = keep_flat.reshape(k, num_tokens).t()
    weights = gates.gather(1, expert_idx) * keep.float()
    if k > 1:
        denom = weights.sum(dim=1, keepdim=True).clamp_min(torch.finfo(weights.dtype).eps)
        weights = weights / denom
    order = slots.order_all[keep_flat[slots.order_all]]
    counts = torch.bincount(slots.flat_expert[keep_flat], minlength=num_experts)
    return GateOutput(
        l_aux=l_aux,
        exp_counts=exp_counts,
        expert_idx=expert_idx,
        weights=weights,
        keep=keep,
        position=slots.position_flat.reshape(k, num_tokens).t(),
        order=order,
        counts=counts,
        capacity=capacity,
    )


@torch.no_grad()
def _select_experts(
    logits: torch.Tensor, k: int, rsample: bool, sample_rest: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first choice ``[S]`` and all ``k`` choices ``[S, k]`` of every token (noise changes
    the choice only)."""
    first_scores = logits + gumbel_noise(logits.shape, logits.device) if rsample else logits
    first = first_scores.argmax(dim=1)
    if k == 1:
        return first, first[:, None]
    rest_scores = logits + gumbel_noise(logits.shape, logits.device) if sample_rest else logits.clone()
    rest_scores.scatter_(1, first[:, None], float("-inf"))
    rest = rest_scores.topk(k - 1, dim=1).indices
    return first, torch.cat([first[:, None], rest], dim=1)


class _Slots:
    """The slot of every assignment in its expert's buffer: one sort keyed by (expert, choice
    rank, token priority); unused tokens sort after every expert (index ``E``)."""

    def __init__(
        self, expert_idx: torch.Tensor, valid: torch.Tensor, num_experts: int, use_rts: bool
    ) -> None:
        num_tokens, k = expert_idx.shape
        device = expert_idx.device
        self.flat_expert = expert_idx.t().reshape(-1)  # choice-major: j * S + s
        self.flat_valid = valid.repeat(k)
        sort_expert = torch.where(
            self.flat_valid, self.flat_expert, torch.full_like(self.flat_expert, num_experts)
        )
        if use_rts:
            token_priority = torch.randperm(num_tokens, device=device)
        else:
            token_priority = torch.arange(num_tokens, device=device)
        choice = torch.arange(k, device=device)[:, None]
        key = (choice * num_tokens + token_priority[None, :]).reshape(-1)
        self.order_all = torch.argsort(sort_expert * (k * num_tokens) + key)
        self.loads = torch.bincount(sort_expert, minlength=num_experts + 1)
        starts = torch.cumsum(self.loads, 0) - self.loads
        self.position_flat = torch.empty_like(self.flat_expert)
        self.position_flat[self.order_all] = (
            torch.arange(k * num_tokens, device=device) - starts[sort_expert[self.order_all]]
        )


def _dropless_capacity(loads: torch.Tensor, ep_group: dist.ProcessGroup | None) -> int:
    """The padded dropless capacity: the largest load of any expert over the expert-parallel group."""
    most = loads.max().reshape(1).clone()
    if ep_group is not None and comm.get_world_size(ep_group) > 1:
        comm.all_reduce(most, op=comm.ReduceOp.MAX, group=ep_group)
    return max(int(most.item()), 1)


class TopKGate(nn.Module):
    """The gate of an MoE layer: a bias-free fp32 linear map to expert logits, then routing.

    Noise (``noisy_gate_policy``, second-expert sampling) and Random Token Selection apply in
    training mode only; in eval mode ``eval_capacity_factor`` replaces ``capacity_factor``.
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
        ragged_dropless: bool = True,
    ) -> None:
        super().__init__()
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(
                f"TopKGate: noisy_gate_policy must be one of {NOISY_GATE_POLICIES}, got {noisy_gate_policy!r}"
            )
        self.wg = nn.Linear(model_dim, num_experts, bias=False).float()
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.ragged_dropless = ragged_dropless
        # Set by the MoE layer once the expert-parallel group exists (dropless capacity MAX).
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None) -> GateOutput:
        x = x.float()
        if self.training and self.noisy_gate_policy == "Jitter":
            x = multiplicative_jitter(x)
        logits = F.linear(x, self.wg.weight.float())
        return topk_gating(
            logits,
            self.k,
            self.capacity_factor if self.training else self.eval_capacity_factor,
            self.min_capacity,
            used_token=used_token,
            rsample=self.training and self.noisy_gate_policy == "RSample",
            sample_rest=self.training and self.top2_2nd_expert_sampling,
            drop_tokens=self.drop_tokens,
            use_rts=self.training and self.use_rts,
            ragged=self.ragged_dropless,
            ep_group=self.ep_group,
        )
