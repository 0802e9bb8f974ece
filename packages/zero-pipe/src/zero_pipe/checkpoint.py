"""Pipeline checkpoints: one safetensors file per layer, plus per-rank optimizer state.

[Note: per-layer pipeline checkpoints]
A checkpoint directory (``<save_dir>/<tag>``) holds:

* ``layer_<idx>-model_<mp repr>-model_states.safetensors``: the state dict of global layer
  ``idx`` (names inside that layer), written by data-parallel replica 0 of the stage holding it.
  A tied module is written once, under the first global index of its key, and every stage
  holding that key reads that file;
* with the engine: ``optim_states-pp_<stage>-dp_<dp>.{safetensors,json}`` per rank (the ZeRO
  strategy state, scheduler, loss scaler, step counters, client state; see
  [Note: state files without pickle]);
* ``pipe_layers.json``, the root record (written last, by global rank 0): format version,
  number of layers, the stages/chunks it was saved with (informational), with the engine its
  layout and counters under ``"engine"``, and the size and checksum of every other file;
  ``<save_dir>/latest`` names the last tag.

Everything is written through zero-core's one checkpoint writer (see [Note: one checkpoint
writer] in ``zero_core/checkpoint/staged.py``): into a staging directory, checksummed, the
root record sealed, renamed into place, ``latest`` replaced last; a load validates the tag,
checks the root record's seal and verifies every file it reads. ``save_state_dict(dir)``
(module only) writes the same way, with ``dir`` as the tag directory; it refuses to replace a
non-empty directory that is not a pipeline checkpoint. Checkpoints of format 1 (no checksums)
are refused with an error saying so.

Layer files depend only on global layer indices, so a checkpoint saved with ``p`` stages loads
with any number of stages (or chunks): each stage reads the files of its own layers. Optimizer
state is partitioned by stage and data-parallel rank and only loads into the same layout (same
stage boundaries too); the scheduler state, counters and client state, alike on every rank, load
into any layout (from stage 0, replica 0's file), as DeepSpeed restores them without the optimizer.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from zero_core.checkpoint.format import CheckpointError
from zero_core.checkpoint.metadata import check_int, check_loss_scaler, read_sealed
from zero_core.checkpoint.staged import StagedSave, files_matching, open_tag, read_tensors

from zero_pipe.module import PipelineModule, TiedLayerSpec
from zero_pipe.state_io import load_state, save_state

FORMAT_VERSION = 2  # 2: written through zero-core's checkpoint writer (staged, checksummed, sealed)
LAYERS_INDEX = "pipe_layers.json"


def _first_tied_index(module: PipelineModule) -> dict[str, int]:
    first: dict[str, int] = {}
    for idx, spec in enumerate(module.layer_specs):
        if isinstance(spec, TiedLayerSpec):
            first.setdefault(spec.key, idx)
    return first


def _layer_owner_index(module: PipelineModule, idx: int) -> int:
    """The global index whose file holds layer ``idx``'s state (tied layers share one)."""
    spec = module.layer_specs[idx]
    return _first_tied_index(module)[spec.key] if isinstance(spec, TiedLayerSpec) else idx


def _write_layers(module: PipelineModule, staged: StagedSave) -> None:
    """This stage's layer files, from data-parallel replica 0 (tied layers once)."""
    grid = module.grid()
    if grid is None or grid.data_parallel_id == 0:
        modules = module.layer_modules()
        for local, idx in enumerate(module.local_layer_indices()):
            if idx not in modules or _layer_owner_index(module, idx) != idx:
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
    }


def _directory_as_tag(path: str, what: str) -> StagedSave:
    try:
        return StagedSave(os.path.dirname(path), os.path.basename(path))
    except ValueError as e:
        raise ValueError(f"{what}: the directory name of {path} is not usable: {e}") from None


def save_module_layers(module: PipelineModule, save_dir: str) -> None:
    """Write this stage's layer files to ``save_dir`` (collective when distributed).

    See [Note: per-layer pipeline checkpoints]: ``save_dir`` is written as a whole, through a
    staging directory beside it.
    """
    if not isinstance(module, PipelineModule):
        raise TypeError(f"save_module_layers: module must be a PipelineModule, got {type(module)}")
    if not isinstance(save_dir, (str, os.PathLike)):
        raise TypeError(f"save_module_layers: save_dir must be a path, got {type(save_dir).__name__}")
    path = os.path.abspath(os.fspath(save_dir))
    if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, LAYERS_INDEX)):
        raise ValueError(
            f"save_module_layers: {path} is a non-empty directory that is not a pipeline checkpoint; "
            "it would be replaced as a whole, so pass a new or empty directory"
        )
    staged = _directory_as_tag(path, "save_module_layers")
    staged.begin()
    _write_layers(module, staged)
    staged.commit(LAYERS_INDEX, _layers_meta(module), save_latest=False)


def _read_root(path: str) -> dict[str, Any]:
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


def load_module_layers(module: PipelineModule, load_dir: str, strict: bool = True) -> None:
    """Load this stage's layers from a directory written by :func:`save_module_layers` or an
    engine checkpoint's tag directory (saved with any number of stages)."""
    if not isinstance(module, PipelineModule):
        raise TypeError(f"load_module_layers: module must be a PipelineModule, got {type(module)}")
    index_path = os.path.join(load_dir, LAYERS_INDEX)
    if not os.path.isfile(index_path):
        raise FileNotFoundError(
            f"load_module_layers: {index_path} not found; is {load_dir!r} a pipeline checkpoint?"
        )
    _load_layers(module, load_dir, _read_root(index_path), strict)


def _load_layers(module: PipelineModule, load_dir: str, meta: dict[str, Any], strict: bool) -> None:
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
            owner = _layer_owner_index(module, idx)
            names = files_matching(load_dir, meta, f"layer_{owner:02d}-*model_states.safetensors")
            if not names:
                raise FileNotFoundError(f"load_module_layers: no file for layer {owner} in {load_dir}")
            name = f"layer_{owner:02d}-model_{module._rank_repr()}-model_states.safetensors"
            if name not in names:
                if len(names) != 1:
                    raise FileNotFoundError(f"load_module_layers: {name} not found among {names}")
                name = names[0]
            modules[idx].load_state_dict(read_tensors(load_dir, meta, name), strict=strict)


def _rank_stem(stage: int, dp: int) -> str:
    return f"optim_states-pp_{stage:02d}-dp_{dp:02d}"


def save_engine_checkpoint(
    engine: Any, save_dir: str, tag: Any = None, client_state: dict | None = None, save_latest: bool = True
) -> str:
    """Save module layers, optimizer/scheduler/loss-scaler state and counters (collective).

    See [Note: per-layer pipeline checkpoints]; returns the tag directory.
    """
    if client_state is not None and not isinstance(client_state, dict):
        raise TypeError(f"save_checkpoint: client_state must be a dict, got {type(client_state)}")
    staged = StagedSave(save_dir, f"global_step{engine.global_steps}" if tag is None else tag)
    sched = engine.lr_scheduler
    state = {
        "strategy": engine.strategy.state_dict(),
        "lr_scheduler": sched.state_dict() if sched is not None else None,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.stage_optimizer.skipped_steps,
        "client_state": client_state or {},
    }
    staged.begin()
    _write_layers(engine.module, staged)
    grid = engine.grid
    save_state(state, staged, _rank_stem(grid.stage_id, grid.data_parallel_id))
    meta = _layers_meta(engine.module)
    meta["engine"] = {
        "num_stages": engine.num_stages,
        "num_chunks": engine.num_chunks,
        "data_parallel_size": engine.dp_size,
        "zero_stage": int(engine.config.zero_optimization.stage),
        "global_steps": engine.global_steps,
        "parts": list(engine.module.parts),
    }
    return staged.commit(LAYERS_INDEX, meta, save_latest=save_latest)


def _check_counters(state: dict[str, Any], where: str) -> None:
    for k in ("global_steps", "global_samples", "skipped_steps"):
        check_int(state, k, where)
    if state["skipped_steps"] > state["global_steps"]:
        raise CheckpointError(f"{where}: skipped_steps {state['skipped_steps']} > global_steps (edited?)")


def load_engine_checkpoint(
    engine: Any,
    load_dir: str,
    tag: Any = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str | None, dict]:
    """Load what :func:`save_engine_checkpoint` wrote; returns ``(checkpoint dir, client_state)``.

    Module layers load with any number of stages; optimizer states need the same stages,
    chunks, stage boundaries, data-parallel size and ZeRO stage (pass ``load_optimizer_states=False``
    otherwise). The scheduler state, counters and client state load in either case. The tag
    (given, or named by ``latest``) is validated and every file verified before it is used.
    """
    ckpt_dir, _ = open_tag(load_dir, tag, LAYERS_INDEX)
    meta = _read_root(os.path.join(ckpt_dir, LAYERS_INDEX))
    saved = meta.get("engine")
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"{ckpt_dir} holds module layers only (save_state_dict), not an engine checkpoint"
        )
    _load_layers(engine.module, ckpt_dir, meta, load_module_strict)
    if load_module_only:
        engine.stage_optimizer.refresh_masters_from_module()
        return ckpt_dir, {}
    grid = engine.grid
    if load_optimizer_states:
        _check_layout(engine, saved)
        state = load_state(ckpt_dir, meta, _rank_stem(grid.stage_id, grid.data_parallel_id))
        check_loss_scaler(state["loss_scaler"], ckpt_dir)
        _check_counters(state, ckpt_dir)
        engine.strategy.load_state_dict(state["strategy"])
        engine.loss_scaler.load_state_dict(state["loss_scaler"])
        if not engine.config.zero_optimization.load_from_fp32_weights:
            engine.stage_optimizer.refresh_masters_from_module()  # DeepSpeed's masters from the 16-bit weights
    else:
        # Scheduler, counters and client state are the same on every rank (as in DeepSpeed, they
        # load without the optimizer states): take rank (stage 0, replica 0)'s, whatever the layout.
        state = load_state(ckpt_dir, meta, _rank_stem(0, 0), skip=("strategy", "loss_scaler"))
        _check_counters(state, ckpt_dir)
        engine.stage_optimizer.refresh_masters_from_module()
    engine.global_steps = int(state["global_steps"])
    engine.global_samples = int(state["global_samples"])
    engine.stage_optimizer.skipped_steps = int(state["skipped_steps"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    return ckpt_dir, state["client_state"]


def _check_layout(engine: Any, meta: dict[str, Any]) -> None:
    """Optimizer states load only into the layout they were saved with."""
    mine = (engine.num_stages, engine.num_chunks, engine.dp_size, int(engine.config.zero_optimization.stage))
    saved = (meta["num_stages"], meta["num_chunks"], meta["data_parallel_size"], meta["zero_stage"])
    if mine != saved:
        raise ValueError(
            f"load_checkpoint: optimizer states were saved with (stages, chunks, dp, zero stage) = {saved}, "
            f"this engine has {mine}; load with load_optimizer_states=False to take only the model"
        )
    if "parts" in meta and list(meta["parts"]) != list(engine.module.parts):
        raise ValueError(
            f"load_checkpoint: optimizer states were saved with stage boundaries {meta['parts']}, this "
            f"module has {list(engine.module.parts)} (another partition_method?); load with "
            "load_optimizer_states=False to take only the model"
        )
