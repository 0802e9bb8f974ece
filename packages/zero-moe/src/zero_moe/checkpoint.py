"""Saving and loading MoE models with one file per global expert (safetensors + JSON).

[Note: per-expert checkpoint layout]
A checkpoint directory holds:

* ``layer_<L>_expert_<G>.safetensors``: the state of global expert ``G`` of the ``L``-th MoE
  layer (in ``model.modules()`` order), keyed by names inside the expert module. Written by
  the expert-data-parallel rank 0 holding it, so each file is written exactly once;
* ``non_expert.safetensors``: every other entry of ``model.state_dict()`` (global rank 0);
* ``moe_index.json``: format version, the layers' module names and expert counts, the
  ``ep_size`` used when saving (informational).

Nothing in the layout depends on ``ep_size``: a rank loads its local experts by global index,
so a checkpoint saved with one expert-parallel size loads with any other. Files are written to
a temporary name, fsynced and renamed, so a crash never leaves a half-written file under the
final name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from zero_moe import _dist, groups
from zero_moe.layer import MoE

FORMAT_VERSION = 1
INDEX_FILE = "moe_index.json"
NON_EXPERT_FILE = "non_expert.safetensors"


def expert_file_name(layer_id: int, global_expert_id: int) -> str:
    return f"layer_{layer_id}_expert_{global_expert_id}.safetensors"


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """The MoE layers of ``model`` with their module names, in ``model.modules()`` order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(tmp))
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _atomic_write_json(obj: object, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _expert_prefixes(model: nn.Module) -> list[tuple[int, MoE, list[str]]]:
    """For each MoE layer: its id, the layer, and the state-dict prefix of each local expert."""
    out = []
    for layer_id, (name, layer) in enumerate(moe_layers(model)):
        base = f"{name}." if name else ""
        prefixes = [f"{base}zero_moe.experts.zero_experts.{i}." for i in range(layer.num_local_experts)]
        out.append((layer_id, layer, prefixes))
    return out


def _barrier() -> None:
    if _dist.is_initialized() and _dist.get_world_size() > 1:
        flag = torch.zeros(1)
        _dist.all_reduce(flag)


def save_moe_checkpoint(model: nn.Module, directory: str | os.PathLike[str]) -> None:
    """Save ``model`` to ``directory`` (collective: every rank calls it). See [Note: per-expert checkpoint layout]."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_moe_checkpoint: model must be a torch.nn.Module, got {type(model).__name__}")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    expert_keys: set[str] = set()
    for layer_id, layer, prefixes in _expert_prefixes(model):
        writer = groups.get_expert_data_parallel_rank(layer.expert_group_name) == 0
        offset = layer.global_expert_offset
        for i, prefix in enumerate(prefixes):
            tensors = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            expert_keys.update(prefix + k for k in tensors)
            if writer:
                _atomic_write_safetensors(tensors, path / expert_file_name(layer_id, offset + i))
    if _dist.get_rank() == 0:
        rest = {k: v for k, v in state.items() if k not in expert_keys}
        _atomic_write_safetensors(rest, path / NON_EXPERT_FILE)
        index = {
            "format_version": FORMAT_VERSION,
            "layers": [
                {"module": name, "num_experts": layer.num_experts, "saved_ep_size": layer.ep_size}
                for name, layer in moe_layers(model)
            ],
        }
        _atomic_write_json(index, path / INDEX_FILE)
    _barrier()


def load_moe_checkpoint(model: nn.Module, directory: str | os.PathLike[str], strict: bool = True) -> None:
    """Load a checkpoint written by :func:`save_moe_checkpoint`, with any ``ep_size``.

    Each rank reads the non-expert file and the files of its own global experts. With
    ``strict`` every key of the model must be found and every file key must be used.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_moe_checkpoint: model must be a torch.nn.Module, got {type(model).__name__}")
    path = Path(directory)
    index_path = path / INDEX_FILE
    if not index_path.is_file():
        raise FileNotFoundError(f"load_moe_checkpoint: {index_path} not found; not a zero-moe checkpoint")
    index = json.loads(index_path.read_text())
    if index.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"load_moe_checkpoint: unsupported format_version {index.get('format_version')!r} "
            f"(this zero-moe reads {FORMAT_VERSION})"
        )
    layers = _expert_prefixes(model)
    if len(index["layers"]) != len(layers):
        raise ValueError(
            f"load_moe_checkpoint: checkpoint has {len(index['layers'])} MoE layers, the model has {len(layers)}"
        )
    state: dict[str, torch.Tensor] = dict(load_file(str(path / NON_EXPERT_FILE)))
    for (layer_id, layer, prefixes), saved in zip(layers, index["layers"]):
        if saved["num_experts"] != layer.num_experts:
            raise ValueError(
                f"load_moe_checkpoint: MoE layer {layer_id} ({saved['module']!r}) was saved with "
                f"{saved['num_experts']} experts, the model has {layer.num_experts}"
            )
        offset = layer.global_expert_offset
        for i, prefix in enumerate(prefixes):
            for k, v in load_file(str(path / expert_file_name(layer_id, offset + i))).items():
                state[prefix + k] = v
    missing, unexpected = model.load_state_dict(state, strict=False)
    if strict and (missing or unexpected):
        raise KeyError(f"load_moe_checkpoint: missing keys {missing}, unexpected keys {unexpected}")
