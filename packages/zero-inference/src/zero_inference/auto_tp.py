"""Automatic tensor parallelism: find the transformer layers' linears and shard them.

[Note: auto TP discovery]
A model given without a policy is searched for its repeated transformer layers: the items of
an ``nn.ModuleList`` that are all of one class and hold linears (``nn.Linear`` or HF's
``Conv1D``, whose weight is stored transposed). Inside a layer, a linear is *row-parallel* when
its name is a known output projection (``o_proj``, ``out_proj``, ``c_proj``, ``down_proj``,
``fc2``, ``wo``, ``w2``, ``dense_4h_to_h``, or a ``dense`` under ``output``/``attention``),
and *column-parallel* otherwise; routers (``gate``, ``router``) stay replicated since their
outputs are needed whole. An ``injection_policy`` ``{layer class: (row-parallel linear names)}``
replaces the search: those classes are the layers, the named linears are row-parallel, the
other linears of the class are column-parallel. Fused projections are column-split per block
(``c_attn``/``qkv_proj``/``Wqkv``: 3, ``gate_up_proj``: 2). Attention modules that keep local
head counts as attributes (GPT-2's ``split_size``, ``num_heads`` ...) get them divided.
The input embedding and the LM head are split over the vocabulary (see
[Note: tensor-parallel layout]); every other module is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from zero_inference.param_source import ModuleSource, ParamSource, iter_blocks
from zero_inference.tp_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

ROW_NAMES = {"o_proj", "out_proj", "c_proj", "down_proj", "fc2", "wo", "w2", "dense_4h_to_h", "proj_out"}
ROW_PARENTS_OF_DENSE = {"output", "attention", "self_attention", "attn"}
REPLICATED_NAMES = {"gate", "router", "q_attn"}
FUSED_BLOCKS = {"c_attn": 3, "qkv_proj": 3, "Wqkv": 3, "gate_up_proj": 2}
HEAD_ATTRS = (
    "split_size",
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "all_head_size",
    "n_head",
)


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def is_transposed(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"


@dataclass
class TPPlan:
    """What to shard: module names (qualified from the model root) per kind."""

    column: dict[str, int] = field(default_factory=dict)  # name -> number of fused blocks
    row: set[str] = field(default_factory=set)
    transposed: set[str] = field(default_factory=set)
    embeddings: list[str] = field(default_factory=list)
    lm_head: str | None = None
    tied: bool = False
    head_attrs: list[tuple[str, str]] = field(default_factory=list)  # (module name, attribute)
    layer_classes: tuple[type, ...] = ()


def _policy_classes(model: nn.Module, policy: dict) -> dict[type, tuple[str, ...]]:
    """``{class or class name: names}`` -> ``{class: names}``, validated against the model."""
    present = {type(m).__name__: type(m) for m in model.modules()}
    out: dict[type, tuple[str, ...]] = {}
    for key, names in policy.items():
        if isinstance(key, str):
            if key not in present:
                raise ValueError(f"injection_policy: no module of class {key!r} in the model")
            cls = present[key]
        elif isinstance(key, type) and issubclass(key, nn.Module):
            if key not in present.values():
                raise ValueError(f"injection_policy: no module of class {key.__name__} in the model")
            cls = key
        else:
            raise ValueError(f"injection_policy: keys must be nn.Module classes or class names, got {key!r}")
        if isinstance(names, str):
            names = (names,)
        if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
            raise ValueError(
                f"injection_policy[{cls.__name__}]: expected a tuple of linear names "
                f"(the output projections), got {names!r}"
            )
        out[cls] = tuple(names)
    return out


def _auto_layer_classes(model: nn.Module) -> set[type]:
    classes: set[type] = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            kinds = {type(m) for m in module}
            if len(kinds) == 1 and any(is_linear(m) for m in module[0].modules()):
                classes |= kinds
    return classes


def _is_row(local_name: str) -> bool:
    parts = local_name.split(".")
    if parts[-1] in ROW_NAMES:
        return True
    return parts[-1] == "dense" and len(parts) > 1 and parts[-2] in ROW_PARENTS_OF_DENSE


def discover_plan(model: nn.Module, tp_size: int, injection_policy: dict | None = None) -> TPPlan:
    """The sharding plan of ``model`` for ``tp_size`` ranks. See [Note: auto TP discovery]."""
    plan = TPPlan()
    policy = _policy_classes(model, injection_policy) if injection_policy else None
    layer_classes = set(policy) if policy is not None else _auto_layer_classes(model)
    if not layer_classes:
        raise ValueError(
            f"automatic tensor parallelism found no transformer layers in {type(model).__name__} "
            "(no nn.ModuleList of identical modules holding linears); pass injection_policy="
            "{LayerClass: ('attn_out_proj', 'mlp_out_proj')}"
        )
    plan.layer_classes = tuple(layer_classes)
    for layer_name, layer in model.named_modules():
        if type(layer) not in layer_classes:
            continue
        rows = policy[type(layer)] if policy is not None else None
        sharded_parents = set()
        for local, sub in layer.named_modules():
            if not local or not is_linear(sub):
                continue
            full = f"{layer_name}.{local}" if layer_name else local
            leaf = local.rsplit(".", 1)[-1]
            if rows is not None:
                row = any(local == r or local.endswith("." + r) for r in rows)
            else:
                if leaf in REPLICATED_NAMES:
                    continue
                row = _is_row(local)
            if is_transposed(sub):
                plan.transposed.add(full)
            if row:
                plan.row.add(full)
            else:
                plan.column[full] = FUSED_BLOCKS.get(leaf, 1)
                sharded_parents.add(local.rpartition(".")[0])
        for parent in sharded_parents:
            owner = layer.get_submodule(parent) if parent else layer
            owner_name = ".".join(p for p in (layer_name, parent) if p)
            for attr in HEAD_ATTRS:
                value = getattr(owner, attr, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    if value % tp_size:
                        raise ValueError(
                            f"tensor parallelism: {owner_name}.{attr} = {value} is not divisible by "
                            f"tp_size = {tp_size}; pick a tp_size that divides the number of heads"
                        )
                    plan.head_attrs.append((owner_name, attr))
    _check_heads(model, tp_size)
    _find_vocab_modules(model, plan)
    return plan


def _check_heads(model: nn.Module, tp_size: int) -> None:
    config = getattr(model, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads", "n_head"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value % tp_size:
            raise ValueError(
                f"tensor parallelism: the model's {attr} = {value} is not divisible by tp_size = {tp_size}"
            )


def _find_vocab_modules(model: nn.Module, plan: TPPlan) -> None:
    names = {id(m): n for n, m in model.named_modules()}
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    if isinstance(emb, nn.Embedding) and id(emb) in names:
        plan.embeddings.append(names[id(emb)])
    if isinstance(head, nn.Linear) and id(head) in names:
        plan.lm_head = names[id(head)]
        plan.tied = emb is not None and head.weight is emb.weight


def _cast(t: torch.Tensor, dtype: torch.dtype | None, device: torch.device | None) -> torch.Tensor:
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    if device is not None:
        t = t.to(device)
    return t.contiguous()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=0)


def apply_plan(
    model: nn.Module,
    plan: TPPlan,
    rank: int,
    world: int,
    *,
    group: object = None,
    source: ParamSource | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> None:
    """Replace the planned modules of ``model`` by this rank's shards, read from ``source``."""
    src = source if source is not None else ModuleSource(model)

    def set_module(name: str, new: nn.Module) -> None:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)

    def cat_slices(read, name: str, total: int, blocks: int) -> torch.Tensor:  # noqa: ANN001
        return torch.cat([read(name, a, b) for a, b in iter_blocks(total, blocks, rank, world)], dim=0)

    for name, blocks in plan.column.items():
        wname, bname = f"{name}.weight", f"{name}.bias"
        if name in plan.transposed:  # Conv1D: [in, out]; output features are columns
            shape = src.shape(wname)
            parts = [src.cols(wname, a, b) for a, b in iter_blocks(shape[1], blocks, rank, world)]
            weight = torch.cat(parts, dim=1).t()
        else:
            weight = cat_slices(src.rows, wname, src.shape(wname)[0], blocks)
        bias = cat_slices(src.rows, bname, src.shape(bname)[0], blocks) if bname in src.names() else None
        bias = _cast(bias, dtype, device) if bias is not None else None
        set_module(name, ColumnParallelLinear(_cast(weight, dtype, device), bias, group=group))
    for name in plan.row:
        wname, bname = f"{name}.weight", f"{name}.bias"
        if name in plan.transposed:
            ((start, stop),) = iter_blocks(src.shape(wname)[0], 1, rank, world)
            weight = src.rows(wname, start, stop).t()
        else:
            ((start, stop),) = iter_blocks(src.shape(wname)[1], 1, rank, world)
            weight = src.cols(wname, start, stop)
        bias = _cast(src.full(bname), dtype, device) if bname in src.names() else None
        set_module(name, RowParallelLinear(_cast(weight, dtype, device), bias, group=group))
    for owner, attr in plan.head_attrs:
        module = model.get_submodule(owner)
        setattr(module, attr, getattr(module, attr) // world)

    shared: nn.Parameter | None = None
    for name in plan.embeddings:
        old = model.get_submodule(name)
        vocab = old.num_embeddings
        per = -(-vocab // world)
        start = rank * per
        rows = _pad_rows(src.rows(f"{name}.weight", start, min(start + per, vocab)), per)
        new = VocabParallelEmbedding(
            _cast(rows, dtype, device),
            start=start,
            num_embeddings=vocab,
            padding_idx=old.padding_idx,
            group=group,
        )
        set_module(name, new)
        shared = new.weight
    if plan.lm_head is not None:
        old = model.get_submodule(plan.lm_head)
        vocab = old.out_features
        per = -(-vocab // world)
        start = rank * per
        stop = min(start + per, vocab)
        if plan.tied and shared is not None:
            weight = shared.data
        else:
            weight = _cast(_pad_rows(src.rows(f"{plan.lm_head}.weight", start, stop), per), dtype, device)
        bname = f"{plan.lm_head}.bias"
        bias = None
        if old.bias is not None and bname in src.names():
            bias = _cast(_pad_rows(src.rows(bname, start, stop), per), dtype, device)
        head = ColumnParallelLinear(weight, bias, group=group, gather_output=True, full_out_features=vocab)
        if plan.tied and shared is not None:
            head.weight = shared
        set_module(plan.lm_head, head)
