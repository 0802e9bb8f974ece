"""Expert-parallel inference for models with zero-moe ``MoE`` layers.

[Note: expert-parallel inference]
With ``moe: {ep_size: N}`` (or the top-level ``ep_size``), every ``zero_moe.MoE`` layer of the
model that was built with ``ep_size=1`` (all experts on every rank, as a single-process model or
a full checkpoint has them) is re-sharded the way zero-moe lays experts out: expert-parallel
rank ``r`` keeps global experts ``r*E/N .. (r+1)*E/N - 1`` and drops the others, the layer's
``ep_size`` / ``num_local_experts`` become ``N`` / ``E/N``, and its expert groups are created by
``zero_moe.groups`` (or ``ep_group`` from the config is used). Tokens then travel to the rank
holding their expert by all-to-all, exactly as in zero-moe training, so every rank's output
equals the single-process model's on the same input. Layers already built with ``ep_size=N``
(experts sharded at construction) are only checked and wired to their groups.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from zero_core import comm
from zero_core.plugins import require


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The zero-moe ``MoE`` layers of ``model`` (by class, so zero-moe need not be imported)."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if type(m).__name__ == "MoE" and type(m).__module__.startswith("zero_moe")
    ]


def shard_experts(model: nn.Module, ep_size: int, ep_group: dist.ProcessGroup | None = None) -> int:
    """Shard the experts of every ``MoE`` layer of ``model`` over ``ep_size`` ranks; returns the layer count.

    See [Note: expert-parallel inference].
    """
    require("zero_moe", "MoE inference (moe.ep_size)")
    from zero_moe import groups
    from zero_moe.experts import tag_expert_params

    layers = moe_layers(model)
    if ep_size == 1:
        return len(layers)
    if not comm.is_initialized():
        raise RuntimeError(
            f"moe.ep_size={ep_size} needs torch.distributed initialised (zero_core.distributed.init_distributed() "
            "or a launcher such as `zero run`)"
        )
    if not layers:
        raise ValueError(
            f"moe.ep_size={ep_size} was given but {type(model).__name__} has no zero_moe.MoE layer"
        )
    if ep_group is not None:
        if comm.get_world_size(ep_group) != ep_size:
            raise ValueError(
                f"moe.ep_group has {comm.get_world_size(ep_group)} ranks but moe.ep_size={ep_size}"
            )
        name, rank = groups.group_name_for(ep_size), comm.get_rank(ep_group)
    else:
        name = groups.create_expert_and_data_parallel(ep_size)
        ep_group = groups.get_expert_parallel_group(name)
        rank = groups.get_expert_parallel_rank(name)
    for layer_name, layer in layers:
        experts = layer.zero_moe.experts
        if layer.ep_size == ep_size:
            layer.zero_moe._set_ep_group(ep_group)
            layer._parallel_ready = True
            continue
        if layer.ep_size != 1:
            raise ValueError(
                f"MoE layer {layer_name!r} was built with ep_size={layer.ep_size}; inference can re-shard only "
                f"layers built with ep_size=1 (or already at moe.ep_size={ep_size})"
            )
        total = layer.num_experts
        if total % ep_size:
            raise ValueError(
                f"MoE layer {layer_name!r}: num_experts={total} is not divisible by moe.ep_size={ep_size}"
            )
        local = total // ep_size
        keep = list(experts.zero_experts)[rank * local : (rank + 1) * local]
        experts.zero_experts = nn.ModuleList(keep)  # the other ranks' experts are freed here
        experts.num_local_experts = local
        experts.expert_group_name = name
        tag_expert_params(experts, name)
        layer.ep_size, layer.num_local_experts, layer.expert_group_name = ep_size, local, name
        layer.zero_moe.ep_size, layer.zero_moe.num_local_experts = ep_size, local
        layer.zero_moe._set_ep_group(ep_group)
        layer._parallel_ready = True
    return len(layers)
