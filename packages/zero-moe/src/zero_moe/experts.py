"""The container of the experts a rank holds, and the tags that mark expert parameters."""

from __future__ import annotations

import copy

import torch
from torch import nn

from zero_moe.deepspeed_names import accept_deepspeed_experts_names


def tag_expert_params(module: nn.Module, group_name: str) -> None:
    """Mark every parameter of ``module`` as an expert parameter of group ``group_name``.

    ``allreduce = False`` tells a data-parallel engine not to reduce it over the whole
    data-parallel group; ``group_name`` names the expert-data-parallel group to reduce it over
    (see [Note: expert parallel groups] in groups.py). These are DeepSpeed's attribute names.
    """
    for param in module.parameters():
        param.allreduce = False
        param.group_name = group_name


class Experts(nn.Module):
    """``num_local_experts`` independent copies of ``expert``, the experts held by this rank.

    Local expert ``i`` on expert-parallel rank ``r`` is global expert ``r * num_local_experts + i``.
    Copies start with identical weights (deep copies of the module passed in, as DeepSpeed
    does), so the initial weights of a global expert do not depend on ``ep_size``.
    """

    def __init__(self, expert: nn.Module, num_local_experts: int, expert_group_name: str) -> None:
        super().__init__()
        self.zero_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        self.expert_group_name = expert_group_name
        tag_expert_params(self, expert_group_name)
        accept_deepspeed_experts_names(self)  # See [Note: DeepSpeed MoE names]

    @staticmethod
    def _run(expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = expert(x)
        if isinstance(out, tuple):  # experts returning (output, extras...) as DeepSpeed allows
            out = out[0]
        if out.shape != x.shape:
            raise ValueError(
                f"Experts: an expert must map [tokens, hidden] to the same shape, got {tuple(x.shape)} -> "
                f"{tuple(out.shape)}"
            )
        return out

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Apply local expert ``i`` to ``inputs[i]``; ``inputs`` is ``[num_local_experts, T, M]``."""
        outs = [self._run(expert, chunk) for expert, chunk in zip(self.zero_experts, inputs.unbind(0))]
        return torch.stack(outs, dim=0)

    def forward_ragged(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Apply local expert ``i`` to the ``i``-th run of ``sizes[i]`` rows of ``x``.

        Experts with no rows still run (on an empty input), so their gradients exist and
        every rank issues the same gradient collectives.
        """
        chunks = torch.split(x, sizes, dim=0)
        return torch.cat([self._run(expert, c) for expert, c in zip(self.zero_experts, chunks)], dim=0)
