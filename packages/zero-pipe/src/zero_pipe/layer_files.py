"""Module-only pipeline checkpoints: one safetensors file per layer (``save_state_dict``).

[Note: per-layer pipeline checkpoints]
``PipelineModule.save_state_dict(dir)`` (DeepSpeed's API, weights only) writes ``dir`` as:

* ``layer_<idx>-model_<mp repr>-model_states.safetensors``: the state dict of global layer
  ``idx`` (names inside that layer), written by data-parallel replica 0 of the stage holding it.
  A tied module is written once, under the first global index of its key, and every stage
  holding that key reads that file;
* ``pipe_layers.json``, the root record (written last, by global rank 0): format version,
  number of layers, the stages/chunks it was saved with (informational), ``layer_modules``
  (each layer's module name in the ``PipelineModule``, ``layers.<idx>`` or
  ``tied_modules.<key>``, so that ``zero_to_fp32`` can name the tensors of a file) and the size
  and checksum of every other file.

Everything is written through zero-core's one checkpoint writer (see [Note: one checkpoint
writer] in ``zero_core/checkpoint/staged.py``): into a staging directory, checksummed, the
root record sealed, renamed into place; a load checks the root record's seal and verifies every
file it reads. ``save_state_dict`` refuses to replace a non-empty directory that is not a
pipeline checkpoint. Checkpoints of format 1 (no checksums) are refused with an error saying so.

Layer files depend only on global layer indices, so they load with any number of stages (or
chunks): each stage reads the files of its own layers. The engine's checkpoints are no longer
written this way (see [Note: universal pipeline checkpoints] in ``checkpoint.py``), but those of
format 2 hold the same layer files and still load (``legacy_checkpoint.py``).
``load_state_dir`` reads the weights of either kind.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from zero_core.checkpoint.format import COMMIT_FILE, CheckpointError
from zero_core.checkpoint.metadata import check_int, read_sealed
from zero_core.checkpoint.staged import StagedSave, files_matching, read_tensors

from zero_pipe.layer_spec import LayerSpec, TiedLayerSpec, first_tied_index

if TYPE_CHECKING:  # the module's methods call in here: its class is only a type for this file
    from zero_pipe.module import PipelineModule

FORMAT_VERSION = 2  # 2: written through zero-core's checkpoint writer (staged, checksummed, sealed)
LAYERS_INDEX = "pipe_layers.json"


def layer_owner_index(module: PipelineModule, idx: int) -> int:
    """The global index whose file holds layer ``idx``'s state (tied layers share one)."""
    spec = module.layer_specs[idx]
    return first_tied_index(module.layer_specs)[spec.key] if isinstance(spec, TiedLayerSpec) else idx


def layer_module_names(module: PipelineModule) -> dict[str, str]:
    """``{str(idx): module name}`` of every layer holding a module (``layers.<idx>``, ``tied_modules.<key>``)."""
    out = {}
    for idx, spec in enumerate(module.layer_specs):
        if isinstance(spec, TiedLayerSpec):
            out[str(idx)] = f"tied_modules.{spec.key}"
        elif isinstance(spec, (LayerSpec, torch.nn.Module)):
            out[str(idx)] = f"layers.{idx}"
    return out


def write_layers(module: PipelineModule, staged: StagedSave) -> None:
    """This stage's layer files, from data-parallel replica 0 (tied layers once)."""
    grid = module.grid()
    if grid is None or grid.data_parallel_id == 0:
        modules = module.layer_modules()
        for local, idx in enumerate(module.local_layer_indices()):
            if idx not in modules or layer_owner_index(module, idx) != idx:
                continue
            state = modules[idx].state_dict()
            if state:
                staged.write_tensors(os.path.basename(module.ckpt_layer_path(staged.stage_dir, local)), state)


def _layers_meta(module: PipelineModule) -> dict[str, Any]:
    return {
        "format": "zero-pipe-checkpoint",
        "format_version": FORMAT_VERSION,
        "num_layers": len(module.layer_specs),
        "saved_num_stages": module.num_stages,
        "saved_num_chunks": module.num_chunks,
        "layer_modules": layer_module_names(module),
    }


def save_module_layers(module: PipelineModule, save_dir: str) -> None:
    """Write this stage's layer files to ``save_dir`` (collective when distributed).

    See [Note: per-layer pipeline checkpoints]: ``save_dir`` is written as a whole, through a
    staging directory beside it.
    """
    if not isinstance(save_dir, (str, os.PathLike)):
        raise TypeError(f"save_module_layers: save_dir must be a path, got {type(save_dir).__name__}")
    path = os.path.abspath(os.fspath(save_dir))
    if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, LAYERS_INDEX)):
        raise ValueError(
            f"save_module_layers: {path} is a non-empty directory that is not a pipeline checkpoint; "
            "it would be replaced as a whole, so pass a new or empty directory"
        )
    try:
        staged = StagedSave(os.path.dirname(path), os.path.basename(path))
    except ValueError as e:
        raise ValueError(f"save_module_layers: the directory name of {path} is not usable: {e}") from None
    staged.begin()
    write_layers(module, staged)
    staged.commit(LAYERS_INDEX, _layers_meta(module), save_latest=False)


def read_root(path: str) -> dict[str, Any]:
    """The sealed ``pipe_layers.json`` at ``path``, checked (format 2 only)."""
    meta = read_sealed(path, required=False)
    if meta.get("format_version") != FORMAT_VERSION or "seal" not in meta:
        raise CheckpointError(
            f"{path} has format_version {meta.get('format_version')!r}; this zero-pipe reads version "
            f"{FORMAT_VERSION} (checkpoints of version 1, from before checksums, cannot be verified: "
            "re-save them with that zero-pipe release)"
        )
    check_int(meta, "num_layers", path, lo=1)
    if not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{path} lists no files (corrupted record)")
    return meta


def load_layer_files(module: PipelineModule, load_dir: str, strict: bool = True) -> None:
    """Load this stage's layers from a directory of :func:`save_module_layers`, saved with any
    number of stages (an engine checkpoint's tag directory: ``checkpoint.load_module_state``)."""
    index_path = os.path.join(load_dir, LAYERS_INDEX)
    if not os.path.isfile(index_path):
        raise FileNotFoundError(
            f"load_module_layers: neither {index_path} nor {COMMIT_FILE} found; is {load_dir!r} a "
            "pipeline checkpoint (a save_state_dict directory or an engine checkpoint's tag directory)?"
        )
    load_layers(module, load_dir, read_root(index_path), strict)


def load_layers(module: PipelineModule, load_dir: str, meta: dict[str, Any], strict: bool) -> None:
    """Load this stage's layers from the layer files of a verified record ``meta``."""
    if meta["num_layers"] != len(module.layer_specs):
        raise ValueError(
            f"load_module_layers: the checkpoint has {meta['num_layers']} layers, the module "
            f"{len(module.layer_specs)}; the layer lists must be the same"
        )
    modules = module.layer_modules()
    with torch.no_grad():
        for idx in module.local_layer_indices():
            if idx not in modules or not modules[idx].state_dict():
                continue
            owner = layer_owner_index(module, idx)
            names = files_matching(load_dir, meta, f"layer_{owner:02d}-*model_states.safetensors")
            if not names:
                raise FileNotFoundError(f"load_module_layers: no file for layer {owner} in {load_dir}")
            name = f"layer_{owner:02d}-model_{module._rank_repr()}-model_states.safetensors"
            if name not in names:
                if len(names) != 1:
                    raise FileNotFoundError(f"load_module_layers: {name} not found among {names}")
                name = names[0]
            modules[idx].load_state_dict(read_tensors(load_dir, meta, name), strict=strict)
