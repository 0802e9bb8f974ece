"""Automatic tensor parallelism: find the transformer layers' linears and shard them.

[Note: auto TP discovery]
A model given without a policy is searched for its repeated transformer layers: the items of
an ``nn.ModuleList`` that are all of one class and hold linears (``nn.Linear`` or HF's
``Conv1D``, whose weight is stored transposed). Inside a layer, a linear is *row-parallel* when
its name is a known output projection (``o_proj``, ``out_proj``, ``c_proj``, ``down_proj``,
``fc2``, ``fc_out``, ``wo``, ``w2``, ``dense_4h_to_h``, or a ``dense`` under
``output``/``attention``/``self_attn``), and *column-parallel* otherwise; routers (``gate``,
``router``) stay replicated since their outputs are needed whole. An ``injection_policy``
``{layer class: (row-parallel linear names)}`` replaces the search: those classes are the
layers, the named linears are row-parallel, the other linears of the class are column-parallel.

Fused projections are column-split so that every rank keeps whole heads. Block layouts
(``c_attn``/``qkv_proj``/``Wqkv`` = [q | k | v], ``gate_up_proj`` = [gate | up]) are split per
block, with the q and k/v blocks sized from the attention's head counts (grouped-query attention
makes them unequal). ``query_key_value`` (GPT-NeoX, BLOOM, Falcon) stores each head's (or each
key/value group's) q, k and v together, so one contiguous slice holds whole heads, as does
GPT-BigCode's ``c_attn`` without multi-query; Falcon's and GPT-BigCode's multi-query variants
are [q heads | k | v] with one key/value head, which every rank keeps whole (its ``num_kv_heads``
stays 1). Attention modules that keep local head counts as attributes
(GPT-2's ``split_size``, ``num_heads``, ``num_kv_heads`` ...) get them divided, and tensors
that carry one slice per head into them (ALiBi biases) are cut to their heads (see
[Note: per-head attention inputs]). The input embedding and the LM head are split over the
vocabulary (see [Note: tensor-parallel layout]); every other module is replicated.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from zero_inference.param_source import (
    ModuleSource,
    ParamSource,
    Segments,
    column_segments,
    segment_ranges,
)
from zero_inference.tp_heads import install_head_slicing
from zero_inference.tp_layers import ColumnParallelLinear, RowParallelLinear, shard_embedding

ROW_NAMES = {
    "o_proj",
    "out_proj",
    "c_proj",
    "down_proj",
    "fc2",
    "fc_out",
    "wo",
    "w2",
    "dense_4h_to_h",
    "proj_out",
}
ROW_PARENTS_OF_DENSE = {"output", "attention", "self_attention", "attn", "self_attn"}
REPLICATED_NAMES = {
    "gate",
    "router",
    "q_attn",
}  # and any leaf ending in "_gate" (Qwen2-MoE's shared_expert_gate)
FUSED_BLOCKS = {"c_attn": 3, "qkv_proj": 3, "Wqkv": 3, "gate_up_proj": 2}
#: attention classes whose fused q/k/v is cut into head groups of [q | v | k] (CodeGen's forward
#: reshapes it to 4 groups): class name -> groups, used only when the module does not state its
#: groups itself as ``mp_num``. See [Note: grouped fused q/k/v]
GROUPED_QKV = {"CodeGenAttention": 4}
#: attributes of a grouped q/k/v attention that hold its full attention width; the forward may
#: derive the group width from them, so they become per-rank. See [Note: grouped fused q/k/v]
GROUPED_WIDTH_ATTRS = ("embed_dim",)
#: fused q/k/v whose rows are grouped per head (or per key/value group): see [Note: auto TP discovery]
HEAD_MAJOR_QKV = {"query_key_value"}
#: attention classes whose fused ``c_attn`` is head-major unless multi-query (GPT-BigCode)
HEAD_MAJOR_QKV_CLASSES = {"GPTBigCodeAttention"}
#: per-class local sizes the forward reads besides the head counts: (always, multi-query only).
#: GPT-BigCode splits its fused output at ``embed_dim`` and repeats its one key/value head
#: ``num_key_value_groups`` times, both per rank after sharding.
CLASS_HEAD_ATTRS = {"GPTBigCodeAttention": (("embed_dim",), ("num_key_value_groups",))}
QUERY_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head")
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads")
HEAD_ATTRS = (
    "split_size",
    *QUERY_HEAD_ATTRS,
    *KV_HEAD_ATTRS,
    "all_head_size",
)


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def is_transposed(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"


@dataclass
class TPPlan:
    """What to shard: module names (qualified from the model root) per kind."""

    # name -> number of equal fused blocks, or the fused segments (see param_source.Segments)
    column: dict[str, int | Segments] = field(default_factory=dict)
    row: set[str] = field(default_factory=set)
    # row-parallel name -> equal blocks of its input features, each split over the ranks (default 1)
    row_blocks: dict[str, int] = field(default_factory=dict)
    transposed: set[str] = field(default_factory=set)
    embeddings: list[str] = field(default_factory=list)
    lm_head: str | None = None
    tied: bool = False
    head_attrs: list[tuple[str, str]] = field(default_factory=list)  # (module name, attribute)
    full_heads: dict[str, int] = field(default_factory=dict)  # attention module -> its unsharded heads
    # attention modules that read head counts from their ``config``: they get a local copy
    local_configs: list[str] = field(default_factory=list)
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
                if leaf in REPLICATED_NAMES or leaf.endswith("_gate"):
                    continue
                row = _is_row(local)
            if is_transposed(sub):
                plan.transposed.add(full)
            owner_local = local.rpartition(".")[0]
            owner = layer.get_submodule(owner_local) if owner_local else layer
            groups = _qkv_groups(owner, tp_size)
            if row:
                plan.row.add(full)
                if groups > 1:
                    plan.row_blocks[full] = groups
            else:
                plan.column[full] = groups * 3 if groups > 1 else _fused_spec(leaf, owner, sub, tp_size)
                sharded_parents.add(owner_local)
        for parent in sharded_parents:
            owner = layer.get_submodule(parent) if parent else layer
            owner_name = ".".join(p for p in (layer_name, parent) if p)
            kv_whole = _keeps_kv_whole(owner)
            before = len(plan.head_attrs)
            always, multi_query_only = CLASS_HEAD_ATTRS.get(type(owner).__name__, ((), ()))
            if _qkv_groups(owner, tp_size) > 1:  # See [Note: grouped fused q/k/v]
                always = (*always, *GROUPED_WIDTH_ATTRS)
            for attr in (*HEAD_ATTRS, *always, *(multi_query_only if kv_whole else ())):
                value = getattr(owner, attr, None)
                if not isinstance(value, int) or isinstance(value, bool):
                    continue
                if kv_whole and attr in KV_HEAD_ATTRS:
                    continue  # multi-query: every rank keeps the one key/value head
                if value % tp_size:
                    raise ValueError(
                        f"tensor parallelism: {owner_name}.{attr} = {value} is not divisible by "
                        f"tp_size = {tp_size}; pick a tp_size that divides the number of heads"
                    )
                plan.head_attrs.append((owner_name, attr))
                if attr in QUERY_HEAD_ATTRS:
                    plan.full_heads.setdefault(owner_name, value)
            has_heads = len(plan.head_attrs) > before  # an attention module, not an MLP
            if has_heads and _config_int(getattr(owner, "config", None), "num_attention_heads") is not None:
                plan.local_configs.append(owner_name)
    _check_heads(model, tp_size)
    _find_vocab_modules(model, plan)
    return plan


def _qkv_groups(owner: nn.Module, tp_size: int) -> int:
    """Head groups of a grouped fused q/k/v attention (1 for every other module).

    [Note: grouped fused q/k/v]
    CodeGen's ``qkv_proj`` rows are 4 groups, each [q | v | k] of ``H/4`` heads, and its forward
    reshapes the output to those 4 groups (DeepSpeed's AutoTP special-cases it the same way).
    Cutting every one of the 12 equal blocks over the ranks leaves each rank 4 groups of
    [q | v | k] with ``H/(4 tp)`` heads, so the unchanged forward still finds its groups; those
    heads are ``g H/4 + r H/(4 tp) + j``, not a contiguous range, so ``out_proj`` takes, from each
    of 4 equal blocks of its input features, the rank's part (``TPPlan.row_blocks``).

    The layout is read from the module given, because it changed between transformers releases
    while the weights did not: 5.17 hard-codes ``mp_num = 4`` in the forward and computes the
    group width from ``num_attention_heads`` (divided per rank like every head count), whereas
    5.24 stores ``self.mp_num`` and computes the width as ``self.embed_dim // self.mp_num``. So
    the groups are the module's ``mp_num`` when it has one (the class table otherwise), and the
    module's full-width attributes (``GROUPED_WIDTH_ATTRS``) are divided like the head counts;
    a width that stayed whole would fold the rank's 4 groups into ``4 / tp`` wrong ones and
    give wrong logits without any error.
    """
    declared = getattr(owner, "mp_num", None)
    if isinstance(declared, int) and not isinstance(declared, bool) and declared > 1:
        groups = declared
    else:
        groups = GROUPED_QKV.get(type(owner).__name__, 1)
    heads = _config_int(owner, "num_attention_heads")
    if groups > 1 and heads is not None and (heads % groups or (heads // groups) % tp_size):
        raise ValueError(
            f"tensor parallelism: {type(owner).__name__} keeps its {heads} heads in {groups} groups of "
            f"{heads // groups}; tp_size = {tp_size} must divide the heads of a group"
        )
    return groups


def _keeps_kv_whole(owner: nn.Module) -> bool:
    """Multi-query attention (Falcon, GPT-BigCode): fused [q heads | k | v] with a single key/value head."""
    multi_query = bool(getattr(owner, "multi_query", False))
    return multi_query and not getattr(owner, "new_decoder_architecture", False)


def _head_counts(owner: nn.Module) -> tuple[int, int, int] | None:
    """(query heads, key/value heads, head dim) an attention module declares, or None."""

    def first(names: tuple[str, ...]) -> int | None:
        return next((v for v in (_config_int(owner, n) for n in names) if v is not None), None)

    config = getattr(owner, "config", None)
    heads = first(QUERY_HEAD_ATTRS) or _config_int(config, "num_attention_heads")
    head_dim = first(("head_dim", "head_size"))
    if heads is None or head_dim is None:
        return None
    kv = (
        1
        if _keeps_kv_whole(owner)
        else (first(KV_HEAD_ATTRS) or _config_int(config, "num_key_value_heads") or heads)
    )
    return heads, kv, head_dim


def _config_int(config: object, name: str) -> int | None:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _fused_spec(leaf: str, owner: nn.Module, linear: nn.Module, tp_size: int) -> int | Segments:
    """How a column-parallel linear's output rows are cut. See [Note: auto TP discovery]."""
    weight = linear.weight
    out = weight.shape[1] if is_transposed(linear) else weight.shape[0]
    counts = _head_counts(owner)
    blocks = FUSED_BLOCKS.get(leaf, 1)
    if leaf in HEAD_MAJOR_QKV or (blocks == 3 and type(owner).__name__ in HEAD_MAJOR_QKV_CLASSES):
        if counts is not None and _keeps_kv_whole(owner):
            heads, _, head_dim = counts
            if (heads + 2) * head_dim == out:
                return ((heads * head_dim, True), (head_dim, False), (head_dim, False))
        return 1
    if blocks == 3 and counts is not None:
        heads, kv, head_dim = counts
        if kv != heads and (heads + 2 * kv) * head_dim == out:
            if kv % tp_size:
                raise ValueError(
                    f"tensor parallelism: {kv} key/value heads of a fused {leaf} cannot be split over "
                    f"tp_size = {tp_size}; pick a tp_size that divides the number of key/value heads"
                )
            return ((heads * head_dim, True), (kv * head_dim, True), (kv * head_dim, True))
    return blocks


def _check_heads(model: nn.Module, tp_size: int) -> None:
    config = getattr(model, "config", None)
    # Multi-query attention (one key/value head, fused with the queries) keeps that head whole.
    multi_query = any(_keeps_kv_whole(m) for m in model.modules())
    for attr in ("num_attention_heads", "num_key_value_heads", "n_head"):
        value = getattr(config, attr, None)
        if multi_query and attr == "num_key_value_heads" and value == 1:
            continue
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


def _localize_config(module: nn.Module, world: int) -> None:
    """Give an attention module that reads head counts from its config (Phi-3 slices its fused
    q/k/v with ``config.num_attention_heads``) a copy with this rank's counts; the model's own
    config, shared by every module, keeps the full ones."""
    local = copy.copy(module.config)
    names = (
        ["num_attention_heads"] if _keeps_kv_whole(module) else ["num_attention_heads", "num_key_value_heads"]
    )
    for name in names:
        value = _config_int(local, name)
        if value is not None:
            setattr(local, name, value // world)
    module.config = local


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

    for name, spec in plan.column.items():
        wname, bname = f"{name}.weight", f"{name}.bias"
        if name in plan.transposed:  # Conv1D: [in, out]; output features are columns
            ranges = segment_ranges(column_segments(spec, src.shape(wname)[1]), rank, world)
            weight = torch.cat([src.cols(wname, a, b) for a, b in ranges], dim=1).t()
        else:
            ranges = segment_ranges(column_segments(spec, src.shape(wname)[0]), rank, world)
            weight = torch.cat([src.rows(wname, a, b) for a, b in ranges], dim=0)
        bias = None
        if bname in src.names():
            bias = _cast(torch.cat([src.rows(bname, a, b) for a, b in ranges], dim=0), dtype, device)
        set_module(name, ColumnParallelLinear(_cast(weight, dtype, device), bias, group=group))
    for name in plan.row:
        wname, bname = f"{name}.weight", f"{name}.bias"
        blocks = plan.row_blocks.get(name, 1)  # See [Note: grouped fused q/k/v]
        if name in plan.transposed:
            ranges = segment_ranges(column_segments(blocks, src.shape(wname)[0]), rank, world)
            weight = torch.cat([src.rows(wname, a, b) for a, b in ranges], dim=0).t()
        else:
            ranges = segment_ranges(column_segments(blocks, src.shape(wname)[1]), rank, world)
            weight = torch.cat([src.cols(wname, a, b) for a, b in ranges], dim=1)
        bias = _cast(src.full(bname), dtype, device) if bname in src.names() else None
        set_module(name, RowParallelLinear(_cast(weight, dtype, device), bias, group=group))
    for owner, attr in plan.head_attrs:
        module = model.get_submodule(owner)
        setattr(module, attr, getattr(module, attr) // world)
    for owner in plan.local_configs:
        _localize_config(model.get_submodule(owner), world)
    for owner, heads in plan.full_heads.items():
        install_head_slicing(model.get_submodule(owner), heads, rank, world)

    shared: nn.Parameter | None = None
    for name in plan.embeddings:
        old = model.get_submodule(name)
        vocab = old.num_embeddings
        per = -(-vocab // world)
        start = rank * per
        rows = _pad_rows(src.rows(f"{name}.weight", start, min(start + per, vocab)), per)
        new = shard_embedding(old, _cast(rows, dtype, device), start=start, group=group)
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
