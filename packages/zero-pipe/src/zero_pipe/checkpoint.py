"""Pipeline checkpoints: one safetensors file per layer, plus per-rank optimizer state.

[Note: per-layer pipeline checkpoints]
A checkpoint directory (``<save_dir>/<tag>``) holds:

* ``layer_<idx>-model_<mp repr>-model_states.safetensors``: the state dict of global layer
  ``idx`` (names inside that layer), written by data-parallel replica 0 of the stage holding it.
  A tied module is written once, under the first global index of its key, and every stage
  holding that key reads that file;
* ``pipe_layers.json``: format version, number of layers, the stages/chunks it was saved with
  (informational) and the layer files (written by global rank 0 after a barrier);
* with the engine: ``optim_states-pp_<stage>-dp_<dp>.{safetensors,json}`` per rank (the ZeRO
  strategy state, scheduler, loss scaler, step counters, client state; see
  [Note: state files without pickle]) and ``pipe_engine.json``; ``<save_dir>/latest`` names
  the last tag.

Layer files depend only on global layer indices, so a checkpoint saved with ``p`` stages loads
with any number of stages (or chunks): each stage reads the files of its own layers. Optimizer
state is partitioned by stage and data-parallel rank and only loads into the same layout (same
stage boundaries too); the scheduler state, counters and client state, alike on every rank, load
into any layout (from stage 0, replica 0's file), as DeepSpeed restores them without the optimizer.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
from safetensors.torch import load_file

from zero_pipe import _dist
from zero_pipe.module import PipelineModule, TiedLayerSpec
from zero_pipe.state_io import atomic_write_json, atomic_write_safetensors, load_state, save_state

FORMAT_VERSION = 1
LAYERS_INDEX = "pipe_layers.json"
ENGINE_INDEX = "pipe_engine.json"


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


def _barrier(module: PipelineModule) -> None:
    if module.grid() is not None:
        _dist.barrier()


def save_module_layers(module: PipelineModule, save_dir: str) -> None:
    """Write this stage's layer files (collective when distributed). See [Note: per-layer pipeline checkpoints]."""
    if not isinstance(module, PipelineModule):
        raise TypeError(f"save_module_layers: module must be a PipelineModule, got {type(module)}")
    os.makedirs(save_dir, exist_ok=True)
    grid = module.grid()
    if grid is None or grid.data_parallel_id == 0:
        modules = module.layer_modules()
        for local, idx in enumerate(module.local_layer_indices()):
            if idx not in modules or _layer_owner_index(module, idx) != idx:
                continue
            state = modules[idx].state_dict()
            if state:
                atomic_write_safetensors(state, module.ckpt_layer_path(save_dir, local))
    _barrier(module)
    if grid is None or _dist.get_rank() == 0:
        files = sorted(
            os.path.basename(f) for f in glob.glob(os.path.join(save_dir, "layer_*model_states.safetensors"))
        )
        index = {
            "format_version": FORMAT_VERSION,
            "num_layers": len(module.layer_specs),
            "saved_num_stages": module.num_stages,
            "saved_num_chunks": module.num_chunks,
            "files": files,
        }
        atomic_write_json(index, os.path.join(save_dir, LAYERS_INDEX))
    _barrier(module)


def load_module_layers(module: PipelineModule, load_dir: str, strict: bool = True) -> None:
    """Load this stage's layers from a directory written by :func:`save_module_layers`
    (with any number of stages)."""
    if not isinstance(module, PipelineModule):
        raise TypeError(f"load_module_layers: module must be a PipelineModule, got {type(module)}")
    index_path = os.path.join(load_dir, LAYERS_INDEX)
    if not os.path.isfile(index_path):
        raise FileNotFoundError(
            f"load_module_layers: {index_path} not found; is {load_dir!r} a pipeline checkpoint?"
        )
    with open(index_path) as fh:
        index = json.load(fh)
    if index.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"load_module_layers: unknown format_version {index.get('format_version')!r} in {index_path}"
        )
    if index["num_layers"] != len(module.layer_specs):
        raise ValueError(
            f"load_module_layers: the checkpoint has {index['num_layers']} layers, the module "
            f"{len(module.layer_specs)}; the layer lists must be the same"
        )
    modules = module.layer_modules()
    with torch.no_grad():
        for _local, idx in enumerate(module.local_layer_indices()):
            if idx not in modules:
                continue
            owner = _layer_owner_index(module, idx)
            layer = modules[idx]
            if not layer.state_dict():
                continue
            paths = sorted(glob.glob(os.path.join(load_dir, f"layer_{owner:02d}-*model_states.safetensors")))
            if not paths:
                raise FileNotFoundError(f"load_module_layers: no file for layer {owner} in {load_dir}")
            path = os.path.join(
                load_dir, f"layer_{owner:02d}-model_{module._rank_repr()}-model_states.safetensors"
            )
            if not os.path.isfile(path):
                if len(paths) != 1:
                    raise FileNotFoundError(f"load_module_layers: {path} not found among {paths}")
                path = paths[0]
            layer.load_state_dict(load_file(path), strict=strict)


def _rank_stem(ckpt_dir: str, stage: int, dp: int) -> str:
    return os.path.join(ckpt_dir, f"optim_states-pp_{stage:02d}-dp_{dp:02d}")


def save_engine_checkpoint(
    engine: Any, save_dir: str, tag: Any = None, client_state: dict | None = None, save_latest: bool = True
) -> str:
    """Save module layers, optimizer/scheduler/loss-scaler state and counters (collective)."""
    if not isinstance(save_dir, (str, os.PathLike)):
        raise TypeError(f"save_checkpoint: save_dir must be a path, got {type(save_dir)}")
    if client_state is not None and not isinstance(client_state, dict):
        raise TypeError(f"save_checkpoint: client_state must be a dict, got {type(client_state)}")
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    if not tag or os.sep in tag:
        raise ValueError(f"save_checkpoint: tag must be a non-empty name without {os.sep!r}, got {tag!r}")
    ckpt_dir = engine.module.ckpt_prefix(str(save_dir), tag)
    os.makedirs(ckpt_dir, exist_ok=True)
    save_module_layers(engine.module, ckpt_dir)
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
    grid = engine.grid
    save_state(state, _rank_stem(ckpt_dir, grid.stage_id, grid.data_parallel_id))
    _dist.barrier()
    if _dist.get_rank() == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "num_stages": engine.num_stages,
            "num_chunks": engine.num_chunks,
            "data_parallel_size": engine.dp_size,
            "zero_stage": int(engine.config.zero_optimization.stage),
            "global_steps": engine.global_steps,
            "parts": list(engine.module.parts),
        }
        atomic_write_json(meta, os.path.join(ckpt_dir, ENGINE_INDEX))
        if save_latest:
            tmp = os.path.join(str(save_dir), f"latest.tmp{os.getpid()}")
            with open(tmp, "w") as fh:
                fh.write(tag)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, os.path.join(str(save_dir), "latest"))
    _dist.barrier()
    return ckpt_dir


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
    otherwise). The scheduler state, counters and client state load in either case.
    """
    if tag is None:
        latest = os.path.join(str(load_dir), "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"load_checkpoint: no tag given and no 'latest' file in {load_dir}")
        with open(latest) as fh:
            tag = fh.read().strip()
    ckpt_dir = engine.module.ckpt_prefix(str(load_dir), str(tag))
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"load_checkpoint: checkpoint directory {ckpt_dir} does not exist")
    load_module_layers(engine.module, ckpt_dir, strict=load_module_strict)
    if load_module_only:
        engine.stage_optimizer.refresh_masters_from_module()
        return ckpt_dir, {}
    with open(os.path.join(ckpt_dir, ENGINE_INDEX)) as fh:
        meta = json.load(fh)
    grid = engine.grid
    if load_optimizer_states:
        mine = (
            engine.num_stages,
            engine.num_chunks,
            engine.dp_size,
            int(engine.config.zero_optimization.stage),
        )
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
        state = load_state(_rank_stem(ckpt_dir, grid.stage_id, grid.data_parallel_id))
        engine.strategy.load_state_dict(state["strategy"])
        engine.loss_scaler.load_state_dict(state["loss_scaler"])
    else:
        # Scheduler, counters and client state are the same on every rank (as in DeepSpeed, they
        # load without the optimizer states): take rank (stage 0, replica 0)'s, whatever the layout.
        state = load_state(_rank_stem(ckpt_dir, 0, 0), skip=("strategy", "loss_scaler"))
        engine.stage_optimizer.refresh_masters_from_module()
    engine.global_steps = int(state["global_steps"])
    engine.global_samples = int(state["global_samples"])
    engine.stage_optimizer.skipped_steps = int(state["skipped_steps"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    return ckpt_dir, state["client_state"]
