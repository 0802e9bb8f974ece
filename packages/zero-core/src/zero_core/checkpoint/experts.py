"""Checkpoint names and writers of Mixture-of-Experts parameters.

[Note: expert fragments]
With expert parallelism (zero-moe, ``ep_size > 1``) each rank holds only ``num_local_experts``
of a layer's experts, under *local* module names (``...zero_experts.0.weight`` is global expert
``r * num_local_experts`` on expert-parallel rank ``r``). A checkpoint must not depend on
``ep_size``, so an expert parameter's fragments are named with its *global* expert index
(``...zero_experts.<offset + i>.weight``), the same name the model has with ``ep_size=1``.
Expert parameters are tagged ``param.allreduce = False`` / ``param.group_name`` by zero-moe,
and an MoE layer exposes ``global_expert_offset`` and ``num_local_experts``; the rule below
uses only those attributes, so ``zero_core`` does not import ``zero_moe`` for dense models.

Which rank writes: a non-expert parameter is written by data-parallel rank 0 (every rank
holds a copy), an expert parameter by rank 0 of its expert-data-parallel group (the ranks
holding replicas of the same experts), so every global expert is written exactly once. On
load each rank reads its local experts under their global names, whatever ``ep_size`` wrote
them. The replicated (stage 0) strategy applies both rules itself (``replicated.py``); for
every strategy the saver renames fragments with :func:`global_expert_names` (partitioned
strategies name fragments by module name; renaming is idempotent because global names of a
rank with offset > 0 never collide with local ones), and the loader gives the reader the same
map as ``aliases``, so a strategy asking for its local expert name reads the global one.
Stages 1-3 partition experts over their expert-data-parallel group (stage 3: see
[Note: stage 3 expert parameters] in ``zero/stage3/expert_partition.py``) and each rank writes
its own partition range, so each expert is again written exactly once, whatever the stage and
``ep_size`` of the writer and of the reader.
"""

from __future__ import annotations

import torch

from zero_core.plugins import require
from zero_core.utils.param_groups import is_expert_param


def global_expert_names(module: torch.nn.Module) -> dict[str, str]:
    """``{module parameter name: checkpoint name}`` for expert parameters whose names differ.

    For every submodule with an int ``global_expert_offset`` and ``num_local_experts`` (an MoE
    layer), each ``ModuleList`` below it holding ``num_local_experts`` modules of expert
    parameters is the list of local experts: child ``i`` is renamed to ``offset + i``.
    """
    out: dict[str, str] = {}
    for layer_name, layer in module.named_modules():
        offset = getattr(layer, "global_expert_offset", None)
        local = getattr(layer, "num_local_experts", None)
        if not isinstance(offset, int) or not isinstance(local, int) or offset == 0:
            continue
        for list_name, lst in layer.named_modules():
            if not isinstance(lst, torch.nn.ModuleList) or len(lst) != local:
                continue
            params = list(lst.parameters())
            if not params or not all(is_expert_param(p) for p in params):
                continue
            base = ".".join(x for x in (layer_name, list_name) if x)
            for i, child in enumerate(lst):
                for pname, _ in child.named_parameters():
                    out[f"{base}.{i}.{pname}"] = f"{base}.{offset + i}.{pname}"
    return out


def writes_param(p: torch.nn.Parameter, dp_rank: int) -> bool:
    """Whether this rank writes ``p`` in a replicated checkpoint (see [Note: expert fragments])."""
    if not is_expert_param(p):
        return dp_rank == 0
    groups = require("zero_moe.groups", "checkpointing Mixture-of-Experts parameters")
    return groups.get_expert_data_parallel_rank(getattr(p, "group_name", "default")) == 0
