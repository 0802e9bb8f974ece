"""``MoE``: DeepSpeed's Mixture-of-Experts layer (``deepspeed.moe.layer.MoE``) for zero."""

from __future__ import annotations

import copy
import importlib.util
import warnings

import torch
from torch import nn
from zero_core import comm
from zero_core.config.no_effect import warn_no_effect

from zero_moe import groups
from zero_moe.deepspeed_names import accept_deepspeed_moe_names
from zero_moe.dispatch import MOELayer
from zero_moe.experts import Experts
from zero_moe.gating import NOISY_GATE_POLICIES, TopKGate

DROPLESS_IMPLS = ("ragged", "padded")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"MoE: {name} must be an int >= {minimum}, got {value!r}")


def _check_factor(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"MoE: {name} must be a number > 0, got {value!r}")


def _check_sizes(
    hidden_size: object, expert: object, num_experts: object, ep_size: object, k: object
) -> None:
    _check_int("hidden_size", hidden_size, 1)
    if not isinstance(expert, nn.Module):
        raise TypeError(f"MoE: expert must be a torch.nn.Module, got {type(expert).__name__}")
    _check_int("num_experts", num_experts, 1)
    _check_int("ep_size", ep_size, 1)
    if num_experts % ep_size != 0:
        raise ValueError(
            f"MoE: num_experts ({num_experts}) must be divisible by ep_size ({ep_size}) so every "
            "expert-parallel rank holds the same number of experts"
        )
    _check_int("k", k, 1)
    if k > num_experts:
        raise ValueError(f"MoE: k ({k}) cannot exceed num_experts ({num_experts})")


def _checked_policy(noisy_gate_policy: object) -> str | None:
    """``noisy_gate_policy`` with DeepSpeed's string ``'None'`` read as None."""
    if noisy_gate_policy == "None":
        noisy_gate_policy = None
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(
            f"MoE: noisy_gate_policy must be 'Jitter', 'RSample', 'None' or None, got {noisy_gate_policy!r}"
        )
    return noisy_gate_policy


def _warn_tutel(stacklevel: int) -> None:
    reason = (
        "tutel is not installed"
        if importlib.util.find_spec("tutel") is None
        else "zero-moe does not integrate tutel"
    )
    warnings.warn(
        f"MoE(use_tutel=True): {reason}; using the built-in dispatch instead",
        UserWarning,
        stacklevel=stacklevel,
    )


class MoE(nn.Module):
    """A Mixture-of-Experts layer: ``num_experts`` copies of ``expert`` behind a top-k gate.

    Arguments are DeepSpeed's (see the MoE chapter of its API reference); beyond it, ``k`` may
    be any value up to ``num_experts``, and ``dropless_impl`` chooses how ``drop_tokens=False``
    is carried out: ``"ragged"`` (default) sends exactly the routed tokens with uneven
    all-to-all, ``"padded"`` pads every expert to the largest load as DeepSpeed does.

    Experts are sharded over ``ep_size`` ranks: expert-parallel rank ``r`` holds global experts
    ``r*E/ep .. (r+1)*E/ep - 1``. When ``torch.distributed`` is initialised the expert groups are
    created in the constructor (every rank must build its MoE layers in the same order);
    otherwise call :meth:`set_zero_parallelism` after initialising it.

    ``enable_expert_tensor_parallelism`` only matters with tensor model parallelism, which zero
    does not provide: it is recorded (for engines), has no effect on the computation, and
    ``True`` warns so, once per process (zero-core's ``config/no_effect.py`` ``NO_EFFECT``).
    ``use_tutel`` is accepted for compatibility; the built-in dispatch is always used.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        *,
        dropless_impl: str = "ragged",
    ) -> None:
        super().__init__()
        _check_sizes(hidden_size, expert, num_experts, ep_size, k)
        _check_factor("capacity_factor", capacity_factor)
        _check_factor("eval_capacity_factor", eval_capacity_factor)
        _check_int("min_capacity", min_capacity, 0)
        noisy_gate_policy = _checked_policy(noisy_gate_policy)
        if dropless_impl not in DROPLESS_IMPLS:
            raise ValueError(f"MoE: dropless_impl must be one of {DROPLESS_IMPLS}, got {dropless_impl!r}")
        if use_tutel:
            _warn_tutel(stacklevel=3)

        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.k = k
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        if enable_expert_tensor_parallelism:
            warn_no_effect("moe.enable_expert_tensor_parallelism")
        self.expert_group_name = groups.group_name_for(ep_size)

        gate = TopKGate(
            hidden_size,
            num_experts,
            k=k,
            capacity_factor=capacity_factor,
            eval_capacity_factor=eval_capacity_factor,
            min_capacity=min_capacity,
            noisy_gate_policy=noisy_gate_policy,
            drop_tokens=drop_tokens,
            use_rts=use_rts,
            top2_2nd_expert_sampling=top2_2nd_expert_sampling,
            ragged_dropless=dropless_impl == "ragged",
        )
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.zero_moe = MOELayer(gate, experts, ep_size, self.num_local_experts)
        accept_deepspeed_moe_names(self)  # See [Note: DeepSpeed MoE names]
        if use_residual:
            # Residual MoE: a dense copy of the expert, mixed in by a learned 2-way coefficient.
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)
        self._parallel_ready = False
        if ep_size == 1 or comm.is_initialized():
            self.set_zero_parallelism()

    def set_zero_parallelism(self) -> None:
        """Create (or reuse) this layer's expert groups; DeepSpeed's ``set_deepspeed_parallelism``."""
        if self.ep_size > 1 and not comm.is_initialized():
            raise RuntimeError(
                f"MoE(ep_size={self.ep_size}) needs torch.distributed to be initialised before its expert "
                "groups can be created"
            )
        name = groups.create_expert_and_data_parallel(self.ep_size)
        self.zero_moe._set_ep_group(groups.get_expert_parallel_group(name))
        self._parallel_ready = True

    @property
    def global_expert_offset(self) -> int:
        """Global index of this rank's local expert 0."""
        return groups.get_expert_parallel_rank(self.expert_group_name) * self.num_local_experts

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``hidden_states [..., hidden_size]`` through the experts.

        ``used_token`` (shape ``hidden_states.shape[:-1]``, nonzero = used) excludes tokens from
        routing: their MoE output is zero. Returns ``(output, l_aux, exp_counts)``: the output
        (same shape as the input), the load-balancing loss, and the per-expert assignment counts
        of this rank's tokens before dropping (int64, CPU).
        """
        if not self._parallel_ready:
            raise RuntimeError(
                "MoE.forward: expert groups not created; call set_zero_parallelism() after initialising "
                "torch.distributed"
            )
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
            raise ValueError("MoE.forward: hidden_states must be a tensor with at least 2 dims [..., hidden]")
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"MoE.forward: last dim of hidden_states is {hidden_states.shape[-1]}, expected hidden_size="
                f"{self.hidden_size}"
            )
        if used_token is not None and tuple(used_token.shape) != tuple(hidden_states.shape[:-1]):
            raise ValueError(
                f"MoE.forward: used_token must have shape {tuple(hidden_states.shape[:-1])} (hidden_states "
                f"without its last dim), got {tuple(used_token.shape)}"
            )
        tokens = hidden_states.reshape(-1, self.hidden_size)
        mask = None if used_token is None else used_token.reshape(-1)
        output, l_aux, exp_counts = self.zero_moe(tokens, mask)
        output = output.view(hidden_states.shape)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = torch.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, l_aux, exp_counts
