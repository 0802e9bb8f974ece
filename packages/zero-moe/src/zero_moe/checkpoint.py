"""Saving and loading MoE models with one file per global expert (safetensors + JSON).

[Note: per-expert checkpoint layout]
A checkpoint directory holds:

* ``layer_<L>_expert_<G>.safetensors``: the state of global expert ``G`` of the ``L``-th MoE
  layer (in ``model.modules()`` order), keyed by names inside the expert module. Written by
  the expert-data-parallel rank 0 holding it, so each file is written exactly once;
* ``non_expert.safetensors``: every other entry of ``model.state_dict()`` (global rank 0);
* ``moe_index.json``: format version, the layers' module names and expert counts, the
  ``ep_size`` used when saving (informational), the state-dict name of each layer's expert list
  (``expert_names``: global expert ``G``'s tensors are ``<expert_names>.<G>.<key>`` in the model
  built with ``ep_size=1``; ``zero_to_fp32`` and ``inspect_checkpoint`` read the directory by it).

Nothing in the layout depends on ``ep_size``: a rank loads its local experts by global index,
so a checkpoint saved with one expert-parallel size loads with any other. The directory is
written as a whole through zero-core's one checkpoint writer (see [Note: one checkpoint writer]
in ``zero_core/checkpoint/staged.py``): staged beside it, every file checksummed,
``moe_index.json`` (the root record, listing every file's size and checksum) sealed and
written last, then renamed into place; a crash leaves the previous checkpoint whole. A load
checks the index's seal and verifies every file before reading it. Checkpoints of format 1
(no checksums) are refused with an error saying so.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from zero_core.checkpoint.format import CheckpointError
from zero_core.checkpoint.metadata import read_sealed
from zero_core.checkpoint.staged import StagedSave, read_tensors

from zero_moe import groups
from zero_moe.layer import MoE

FORMAT_VERSION = 2  # 2: written through zero-core's checkpoint writer (staged, checksummed, sealed)
INDEX_FILE = "moe_index.json"
NON_EXPERT_FILE = "non_expert.safetensors"


def expert_file_name(layer_id: int, global_expert_id: int) -> str:
    return f"layer_{layer_id}_expert_{global_expert_id}.safetensors"


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """The MoE layers of ``model`` with their module names, in ``model.modules()`` order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def _expert_list_name(name: str) -> str:
    """State-dict name of the expert list of the MoE layer named ``name`` (its experts are ``<this>.<i>.``)."""
    return f"{name}.zero_moe.experts.zero_experts" if name else "zero_moe.experts.zero_experts"


def _expert_prefixes(model: nn.Module) -> list[tuple[int, MoE, list[str]]]:
    """For each MoE layer: its id, the layer, and the state-dict prefix of each local expert."""
    out = []
    for layer_id, (name, layer) in enumerate(moe_layers(model)):
        prefixes = [f"{_expert_list_name(name)}.{i}." for i in range(layer.num_local_experts)]
        out.append((layer_id, layer, prefixes))
    return out


def save_moe_checkpoint(model: nn.Module, directory: str | os.PathLike[str]) -> None:
    """Save ``model`` to ``directory`` (collective: every rank calls it). See [Note: per-expert checkpoint layout].

    ``directory`` is written as a whole (its name must be a valid checkpoint tag); a non-empty
    directory that is not a zero-moe checkpoint is refused rather than replaced.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_moe_checkpoint: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"save_moe_checkpoint: directory must be a path, got {type(directory).__name__}")
    path = Path(os.path.abspath(os.fspath(directory)))
    if path.is_dir() and any(path.iterdir()) and not (path / INDEX_FILE).is_file():
        raise ValueError(
            f"save_moe_checkpoint: {path} is a non-empty directory that is not a zero-moe checkpoint; it "
            "would be replaced as a whole, so pass a new or empty directory"
        )
    try:
        staged = StagedSave(str(path.parent), path.name)
    except ValueError as e:
        raise ValueError(f"save_moe_checkpoint: the directory name of {path} is not usable: {e}") from None
    staged.begin()
    state = model.state_dict()
    expert_keys: set[str] = set()
    for layer_id, layer, prefixes in _expert_prefixes(model):
        writer = groups.get_expert_data_parallel_rank(layer.expert_group_name) == 0
        offset = layer.global_expert_offset
        for i, prefix in enumerate(prefixes):
            tensors = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            expert_keys.update(prefix + k for k in tensors)
            if writer:
                staged.write_tensors(expert_file_name(layer_id, offset + i), tensors)
    if staged.rank == 0:
        staged.write_tensors(NON_EXPERT_FILE, {k: v for k, v in state.items() if k not in expert_keys})
    index = {
        "format": "zero-moe-checkpoint",
        "format_version": FORMAT_VERSION,
        "layers": [
            {
                "module": name,
                "num_experts": layer.num_experts,
                "saved_ep_size": layer.ep_size,
                "expert_names": _expert_list_name(name),  # global expert G is <expert_names>.<G>.<key>
            }
            for name, layer in moe_layers(model)
        ],
    }
    staged.commit(INDEX_FILE, index, save_latest=False)


def _read_index(index_path: Path) -> dict:
    if not index_path.is_file():
        raise FileNotFoundError(f"load_moe_checkpoint: {index_path} not found; not a zero-moe checkpoint")
    index = read_sealed(str(index_path), required=False)
    if index.get("format_version") != FORMAT_VERSION or "seal" not in index:
        raise CheckpointError(
            f"load_moe_checkpoint: {index_path} has format_version {index.get('format_version')!r}; this "
            f"zero-moe reads {FORMAT_VERSION} (version 1, from before checksums, cannot be verified: re-save "
            "it with that zero-moe release)"
        )
    if not isinstance(index.get("layers"), list) or not isinstance(index.get("files"), dict):
        raise CheckpointError(f"load_moe_checkpoint: {index_path} lists no layers or files (corrupted)")
    return index


def load_moe_checkpoint(model: nn.Module, directory: str | os.PathLike[str], strict: bool = True) -> None:
    """Load a checkpoint written by :func:`save_moe_checkpoint`, with any ``ep_size``.

    Each rank reads the non-expert file and the files of its own global experts, each verified
    against the index first. With ``strict`` every key of the model must be found and every
    file key must be used.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_moe_checkpoint: model must be a torch.nn.Module, got {type(model).__name__}")
    path = Path(directory)
    index = _read_index(path / INDEX_FILE)
    layers = _expert_prefixes(model)
    if len(index["layers"]) != len(layers):
        raise ValueError(
            f"load_moe_checkpoint: checkpoint has {len(index['layers'])} MoE layers, the model has {len(layers)}"
        )
    state: dict[str, torch.Tensor] = read_tensors(str(path), index, NON_EXPERT_FILE)
    for (layer_id, layer, prefixes), saved in zip(layers, index["layers"]):
        if saved["num_experts"] != layer.num_experts:
            raise ValueError(
                f"load_moe_checkpoint: MoE layer {layer_id} ({saved['module']!r}) was saved with "
                f"{saved['num_experts']} experts, the model has {layer.num_experts}"
            )
        offset = layer.global_expert_offset
        for i, prefix in enumerate(prefixes):
            for k, v in read_tensors(str(path), index, expert_file_name(layer_id, offset + i)).items():
                state[prefix + k] = v
    missing, unexpected = model.load_state_dict(state, strict=False)
    if strict and (missing or unexpected):
        raise KeyError(f"load_moe_checkpoint: missing keys {missing}, unexpected keys {unexpected}")
