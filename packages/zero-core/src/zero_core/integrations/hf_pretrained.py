"""A ``transformers`` model from pretrained weights, built directly into ZeRO-3 partitions.

[Note: from_pretrained into partitions]
DeepSpeed users get this from ``transformers`` itself: ``HfDeepSpeedConfig`` makes
``from_pretrained`` build the model inside ``deepspeed.zero.Init`` and load weights layer by
layer. transformers' hook is tied to the ``deepspeed`` package (``is_deepspeed_zero3_enabled``
then imports ``deepspeed`` and calls ``deepspeed.zero.Init``), so it cannot be pointed at zero.
:func:`from_pretrained` does the same job with zero's own pieces:

1. the model's config is read from the directory (``config.json``, no download) and the model
   is built from it inside :class:`zero.Init`, so no rank ever holds the full model. As in
   DeepSpeed (whose ``zero.Init`` takes its remote device from the config), a config whose
   ``zero_optimization.offload_param.device`` is ``"cpu"`` or ``"nvme"`` puts each shard there
   as its submodule is built (``remote_device`` overrides it): a model larger than memory goes
   straight into NVMe partitions;
2. :func:`load_pretrained_into_partitions` opens the safetensors files (``model.safetensors``,
   or the shards that ``model.safetensors.index.json`` lists: what ``save_pretrained`` and
   ``save_16bit_model`` write) and, for every partitioned parameter, reads exactly this rank's
   flat range ``[rank * shard, (rank + 1) * shard)`` with one ``pread`` (zero's own safetensors
   reader, ``checkpoint.tensor_file``), so each rank reads ``1 / world`` of the weights and
   holds one shard at a time: no memory map, whose touched pages would count in the process's
   resident memory until the file is closed. Unpartitioned parameters and buffers are read whole.

Tied weights (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) are one parameter
found under any of its names; a name saved without the model's base prefix (a base model's
file loaded into a model with a head) is found too. Pickle files (``pytorch_model.bin``) are
refused: convert them to safetensors first.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from zero_core.checkpoint.tensor_file import TensorFile
from zero_core.zero.stage3.param_records import full_shape, partition_state
from zero_core.zero.stage3.partitioned_param import is_partitioned, write_shard

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _weight_files(path: str) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it, for a pretrained directory."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"from_pretrained: {path!r} is not a directory of pretrained weights")
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"from_pretrained: {index} has no weight_map object")
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        with TensorFile(single) as f:
            return dict.fromkeys(f.keys(), single)
    found = sorted(os.listdir(path))
    if any(n.endswith((".bin", ".pt", ".pth")) for n in found):
        raise ValueError(
            f"from_pretrained: {path} holds only torch pickle weights ({found}); zero reads safetensors only "
            "(convert with transformers' save_pretrained(..., safe_serialization=True))"
        )
    raise FileNotFoundError(f"from_pretrained: no {SINGLE_FILE} or {INDEX_FILE} in {path} (found {found})")


def _read_range(f: TensorFile, key: str, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the flattened tensor ``key`` of ``f``: exactly those bytes, one ``pread``."""
    return f.read(key, lo, hi)


def _candidates(name: str, aliases: list[str], prefix: str) -> list[str]:
    out = []
    for n in [name, *aliases]:
        out.append(n)
        if prefix and n.startswith(prefix + "."):
            out.append(n[len(prefix) + 1 :])
        elif prefix:
            out.append(f"{prefix}.{n}")
    return out


@torch.no_grad()
def _load_param(param: torch.nn.Parameter, f: TensorFile, key: str) -> None:
    shape = list(f.info(key)[1])
    want = list(full_shape(param))
    if shape != want:
        raise ValueError(f"from_pretrained: {key} has shape {shape} in the file, the model has {want}")
    if not is_partitioned(param):
        param.data.copy_(f.read_tensor(key))
        return
    st = partition_state(param)
    lo = min(st.rank * st.shard_numel, st.numel)
    hi = min(lo + st.shard_numel, st.numel)
    values = torch.zeros(st.shard_numel, dtype=st.shard.dtype)
    values[: hi - lo] = _read_range(f, key, lo, hi).to(st.shard.dtype)
    write_shard(param, values)


def load_pretrained_into_partitions(
    model: torch.nn.Module, path: str, strict: bool = True, *, stats: dict[str, int] | None = None
) -> list[str]:
    """Fill ``model`` (built inside ``zero.Init`` or not) from the safetensors weights in ``path``;
    each rank reads only its partition of every partitioned parameter. Returns the file keys
    that were not used. With ``strict``, a parameter missing from the files is an error.
    ``stats``, when given, receives ``bytes_read`` (tensor bytes this rank read from the files)
    and ``files`` (how many it opened). See [Note: from_pretrained into partitions]."""
    files = _weight_files(path)
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    handles: dict[str, Any] = {}
    used: set[str] = set()
    missing: list[str] = []
    try:
        targets = [(n, p) for n, p in model.named_parameters()]
        targets += [(n, b) for n, b in model.named_buffers() if _persistent(model, n)]
        for name, tensor in targets:
            aliases = names.get(id(tensor), [name])
            key = next((k for k in _candidates(name, aliases, prefix) if k in files), None)
            if key is None:
                if isinstance(tensor, torch.nn.Parameter):
                    missing.append(name)
                continue
            if files[key] not in handles:
                handles[files[key]] = TensorFile(files[key])
            if isinstance(tensor, torch.nn.Parameter):
                _load_param(tensor, handles[files[key]], key)
            else:
                tensor.copy_(handles[files[key]].read_tensor(key))
            used.add(key)
    finally:
        for h in handles.values():
            h.close()
        if stats is not None:
            stats["bytes_read"] = sum(h.bytes_read for h in handles.values())
            stats["files"] = len(handles)
    if strict and missing:
        raise KeyError(f"from_pretrained: {len(missing)} parameters are not in {path}: {missing[:8]}")
    return sorted(set(files) - used)


def _persistent(model: torch.nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return leaf not in getattr(module, "_non_persistent_buffers_set", set())


def from_pretrained(
    model_class: Any,
    path: str | os.PathLike[str],
    config_dict_or_path: Any = None,
    *,
    dtype: torch.dtype | None = None,
    strict: bool = True,
    remote_device: str | None = None,
    stats: dict[str, int] | None = None,
    **config_overrides: Any,
) -> torch.nn.Module:
    """``model_class`` (a transformers model class, or an ``AutoModel*`` class) with the
    pretrained weights in the local directory ``path``, built inside :class:`zero.Init` with the
    zero config ``config_dict_or_path`` (its fp16/bf16 section picks the dtype unless ``dtype``
    is given, its ``offload_param.device`` where the shards live unless ``remote_device`` is
    given) and loaded with each rank reading only its partitions. Collective: call on every
    rank. ``config_overrides`` update the model config (``attn_implementation="eager"`` ...);
    ``stats`` is :func:`load_pretrained_into_partitions`' (bytes this rank read).
    See [Note: from_pretrained into partitions]."""
    from zero_core.integrations.hf_extra import require_hf
    from zero_core.zero.stage3.init_context import Init

    AutoConfig = require_hf("zero_core.integrations.from_pretrained").AutoConfig

    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"from_pretrained: {path!r} has no config.json (a save_pretrained directory)")
    hf_config = AutoConfig.from_pretrained(path, **config_overrides)
    if remote_device is None:
        remote_device = _offload_device(config_dict_or_path)
    with Init(config_dict_or_path=config_dict_or_path, dtype=dtype, remote_device=remote_device):
        if hasattr(model_class, "from_config"):  # AutoModel* classes
            model = model_class.from_config(hf_config)
        else:
            model = model_class(hf_config)
    load_pretrained_into_partitions(model, path, strict=strict, stats=stats)
    return model


def _offload_device(config_dict_or_path: Any) -> str | None:
    """``zero_optimization.offload_param.device`` of the config when it is "cpu" or "nvme"."""
    from zero_core.zero.stage3.init_context import _load_cfg

    cfg = _load_cfg(config_dict_or_path, None)
    op = getattr(getattr(cfg, "zero_optimization", None), "offload_param", None)
    device = getattr(op, "device", None)
    return device if device in ("cpu", "nvme") else None
