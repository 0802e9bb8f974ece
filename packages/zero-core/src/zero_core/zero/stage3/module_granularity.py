"""``zero_optimization.module_granularity_threshold``: fine-grained modules become z3 leaves.

[Note: module granularity threshold]
A model of many small modules (a LayerNorm and a Linear per block, hundreds of blocks) costs
stage 3 one hook and one fetch per module and direction, each a gather when the module's
parameters are not already there: host work and collective latency that dwarf the arithmetic.
DeepSpeed's ``stage3_module_granularity_threshold`` marks such modules as ZeRO-3 leaves, so each
is fetched and released as one unit, and this does the same with the same rule, through the leaf
mechanism of [Note: z3 leaf modules] (no second one).

The *granularity* of a module is its parameter count (its subtree's, each parameter counted where
it is registered) divided, rounded down, by its number of layers: every childless module with
parameters in its subtree counts one, and every non-container module with children counts one
more (itself). A module without parameters, a childless module and a container
(``Sequential``, ``ModuleList``, ``ModuleDict``, ``ParameterList``, ``ParameterDict``, which may
never run a forward of their own) is never chosen, nor a subtree of more than 1e9 parameters
(all of it would be gathered at once). Walking from the root, the first module whose granularity
is at most the threshold becomes a leaf and its subtree is not visited further. A threshold no
module reaches warns (naming the smallest granularity, the value that would take effect), as
DeepSpeed does: a key that does nothing must say so. The marks stay on the modules (DeepSpeed's
``_z3_leaf`` flag), so they show in :func:`~zero_core.zero.stage3.leaf_modules.get_z3_leaf_modules`.
Fewer hooks fire and, when prefetching does not already coalesce the gathers
(``prefetch_bucket_size``), fewer collectives run; the values computed are the same.
"""

from __future__ import annotations

import sys
import warnings

import torch

from zero_core.zero.stage3.leaf_modules import set_z3_leaf_module

_MAX_LEAF_NUMEL = 10**9
_CONTAINERS = (
    torch.nn.Sequential,
    torch.nn.ModuleList,
    torch.nn.ModuleDict,
    torch.nn.ParameterList,
    torch.nn.ParameterDict,
)


def _numel(p: torch.nn.Parameter) -> int:
    """The parameter's full element count, partitioned (``zero_numel``) or not."""
    return int(getattr(p, "zero_numel", p.numel()))


def granularities(root: torch.nn.Module) -> dict[int, int]:
    """id(module) -> granularity for every module of ``root`` (``sys.maxsize``: never a leaf)."""
    out: dict[int, int] = {}

    def visit(module: torch.nn.Module) -> tuple[int, int]:  # (layers, parameters) of the subtree
        out[id(module)] = sys.maxsize
        if next(module.parameters(), None) is None:
            return 0, 0
        params = sum(_numel(p) for p in module.parameters(recurse=False))
        children = list(module.children())
        if not children:
            return 1, params
        layers = 0
        for child in children:
            child_layers, child_params = visit(child)
            layers += child_layers
            params += child_params
        if isinstance(module, _CONTAINERS):
            return layers, params
        layers += 1
        out[id(module)] = params // layers if params <= _MAX_LEAF_NUMEL else sys.maxsize
        return layers, params

    visit(root)
    return out


def mark_fine_grained_leaves(root: torch.nn.Module, threshold: int) -> list[torch.nn.Module]:
    """Mark the modules of ``root`` chosen by ``threshold`` as z3 leaves; return them (in walk order).
    See [Note: module granularity threshold]. ``threshold`` 0 marks nothing."""
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ValueError(
            f"zero_optimization.module_granularity_threshold must be an int >= 0, got {threshold!r}"
        )
    if threshold == 0:
        return []
    sizes = granularities(root)
    chosen: list[torch.nn.Module] = []

    def walk(module: torch.nn.Module) -> None:
        if next(module.parameters(), None) is None:
            return
        if sizes[id(module)] <= threshold:
            chosen.append(module)
            return
        for child in module.children():
            walk(child)

    walk(root)
    if not chosen:
        smallest = min(sizes.values(), default=sys.maxsize)
        hint = (
            f"the smallest module granularity here is {smallest}"
            if smallest < sys.maxsize
            else "no module qualifies"
        )
        warnings.warn(
            f"zero_optimization.module_granularity_threshold={threshold} has no effect: {hint} "
            "(a module's parameter count over its number of layers; containers and childless modules "
            "never qualify); set it at least that high to fetch fine-grained modules as one unit",
            UserWarning,
            stacklevel=3,
        )
    for module in chosen:  # See [Note: z3 leaf modules]
        set_z3_leaf_module(module, True)
        for p in module.parameters():
            p.zero_z3_leaf_module = True
    return chosen
