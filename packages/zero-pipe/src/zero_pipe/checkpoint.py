"""Universal pipeline checkpoints: zero-core's named fragments, loadable in any pipeline layout.

[Note: universal pipeline checkpoints]
``PipelineEngine.save_checkpoint`` writes a zero-core checkpoint (see [Note: checkpoint format]
in ``zero_core/checkpoint/format.py``) through zero-core's saver, over the whole world:
``<tag>/checkpoint.json`` and ``rank_<r>.{json,safetensors}`` for every global rank ``r`` (all
stages, all data-parallel replicas), atomic, checksummed and sealed like any zero checkpoint.

* Names. Fragments are named by the ``PipelineModule``'s parameter names, which depend only on
  global layer indices (``layers.<idx>.<name>``, ``tied_modules.<key>.<name>``; see [Note: model
  chunks] in ``module.py``), never on the number of stages or chunks.
* What each rank writes. Its stage's ZeRO strategy gives its fragments as for a ``ZeroEngine``:
  stage 0 writes whole weights, fp32 masters and optimizer states from data-parallel rank 0,
  stage 1 each replica's partition of the masters and optimizer states (and the 16-bit weights
  from replica 0). Module buffers come from replica 0 of each stage.
* Tied layers. A tied module lives on every stage using its key; its tied weights are equal on
  all of them, and so are their optimizer states (the gradient is summed over the owners
  before every owner takes the same step). Only the first owning stage writes the module; on
  load every owner reads that one copy, whatever stages own it now. (Parameters of a tied
  module outside ``tied_weight_attr`` are not synchronised between the owners, as in DeepSpeed,
  and are saved from the first owner, as they would be at one stage.)
* Root record. Through the saver's ``extra_meta``, ``checkpoint.json`` lists the parameters of
  every stage (gathered from the ranks; ``zero_to_fp32`` and ``inspect_checkpoint`` read it
  like any checkpoint) and a ``pipeline`` section: the layout saved (stages, chunks,
  data-parallel size, stage boundaries), the number of layers, the tied keys with their owning
  stages, and every stage's optimizer hyper-parameters.

Loading goes through zero-core's loader with the world as the group: each rank's strategy reads
exactly the ranges it owns now (``CheckpointReader``), so a checkpoint of ``p`` stages x ``d``
replicas at ZeRO stage ``s`` loads at ``p'`` x ``d'`` at ``s'`` (0 or 1), with any chunks and
stage boundaries, and training continues as if uninterrupted. Engine state (``restore``): the
step, sample and skipped-step counters, the loss scaler and the LR scheduler are the same on
every rank and come from the record; the optimizer hyper-parameters of the same stage index
when the number of stages is the same, of stage 0 otherwise; RNG states rank by rank only in
the same layout (stages and replicas), as zero-core keeps a resharded run's own generators.
The data iterator's position is not saved (as in DeepSpeed): a resumed run feeds its data
from where the caller points it.

Strictness (``load_module_strict``): every parameter and buffer a stage holds must be in the
checkpoint, every saved name under one of the stage's layers must be one of its own, a name
under no layer of the module is an error, and the record's number of layers must be the
module's.

Engine checkpoints of format 2 (layer files and per-rank optimizer files, before this) still
load: see [Note: format-2 pipeline checkpoints] in ``legacy_checkpoint.py``.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import TYPE_CHECKING, Any

import torch
from zero_core.checkpoint import rng
from zero_core.checkpoint.format import COMMIT_FILE, CheckpointError, read_json
from zero_core.checkpoint.fragments import BUFFER, FP32, PARAM, CheckpointReader, Fragment
from zero_core.checkpoint.loader import (
    load_checkpoint,
    open_checkpoint,
    resolve_tag,
    restore_param_groups,
    tag_directory,
)
from zero_core.checkpoint.metadata import check_hyperparameters, check_int, check_seal
from zero_core.checkpoint.replicated import checkpoint_names
from zero_core.checkpoint.saver import (
    buffer_fragments,
    param_group_hyperparameters,
    save_checkpoint,
    shared_parameters,
)
from zero_core.utils.param_groups import is_expert_param

from zero_pipe import _dist
from zero_pipe.layer_files import LAYERS_INDEX, load_layer_files, read_root
from zero_pipe.layer_spec import TiedLayerSpec, first_tied_index

if TYPE_CHECKING:  # PipelineModule.load_state_dir calls in here: the class is only a type for this file
    from zero_pipe.engine import PipelineEngine
    from zero_pipe.module import PipelineModule

PIPELINE_SECTION = "pipeline"
SECTION_VERSION = 1
_LAYER_RE = re.compile(r"^(layers\.(\d+)|tied_modules\.([^.]+))\.")


def _layer_prefix(name: str) -> str | None:
    """``"layers.<idx>"`` / ``"tied_modules.<key>"`` for a name under a layer, else None."""
    m = _LAYER_RE.match(name)
    return m.group(1) if m else None


def _not_written_here(module: PipelineModule, stage: int) -> tuple[str, ...]:
    """Name prefixes of the tied modules this stage holds but does not write (another stage owns them first)."""
    owners = module.tied_owner_stages()
    return tuple(f"tied_modules.{k}." for k in module.tied_modules if owners.get(k, [stage])[0] != stage)


class _StageFragments:
    """The stage's ZeRO strategy as zero-core's saver and loader see it: the pipeline's rules on top.

    See [Note: universal pipeline checkpoints].
    """

    def __init__(self, engine: PipelineEngine, strict: bool = True) -> None:
        self.inner = engine.strategy
        self.module: PipelineModule = engine.module
        self.grid = engine.grid
        # load_module_strict, checked here per stage (zero-core's loader is given False: its whole-model
        # check of names and buffers would see the other stages' layers as unexpected)
        self.strict = strict

    def checkpoint_fragments(self, exclude_frozen_parameters: bool = False) -> list[Fragment]:
        skip = _not_written_here(self.module, self.grid.stage_id)
        out = [
            f
            for f in self.inner.checkpoint_fragments(exclude_frozen_parameters=exclude_frozen_parameters)
            if not f.name.startswith(skip)
        ]
        # global rank 0 gets its buffers from the saver; replica 0 of every other stage adds its own
        if self.grid.data_parallel_id == 0 and _dist.get_rank() != 0:
            out += [f for f in buffer_fragments(self.module) if not f.name.startswith(skip)]
        return out

    def load_checkpoint_fragments(
        self,
        reader: CheckpointReader,
        *,
        load_optimizer_states: bool = True,
        load_module_only: bool = False,
        strict: bool = True,
    ) -> None:
        check_names(reader, self.module, strict=self.strict)
        self.inner.load_checkpoint_fragments(
            reader,
            load_optimizer_states=load_optimizer_states,
            load_module_only=load_module_only,
            strict=False,  # checked above, for this stage's share of the names
        )

    def after_checkpoint_load(self) -> None:
        finish = getattr(self.inner, "after_checkpoint_load", None)
        if finish is not None:
            finish()


class _EngineView:
    """What zero-core's saver and loader read from an engine, for a ``PipelineEngine``.

    The group is the world (``dp_group`` None): every stage writes its own rank files.
    """

    dp_group = None

    def __init__(self, engine: PipelineEngine, strict: bool = True) -> None:
        self.engine = engine
        self.module = engine.module
        self.config = engine.config
        self.strategy = _StageFragments(engine, strict)
        self.compute_dtype = engine.compute_dtype
        self.loss_scaler = engine.loss_scaler
        self.lr_scheduler = engine.lr_scheduler
        self.optimizer = engine.optimizer
        self.global_steps = engine.global_steps
        self.global_samples = engine.global_samples
        self.skipped_steps = engine.stage_optimizer.skipped_steps
        # the pipeline counts batches; micro-steps are informational in the record
        self.micro_steps = engine.global_steps * engine.micro_batches


def _layer_order(module: PipelineModule, name: str) -> int:
    """Global index of the (first) layer ``name`` belongs to; -1 for names outside the layers."""
    m = _LAYER_RE.match(name)
    if m is None:
        return -1
    return (
        int(m.group(2))
        if m.group(2) is not None
        else first_tied_index(module.layer_specs).get(m.group(3), -1)
    )


def _rank_record(engine: PipelineEngine) -> dict[str, Any]:
    """What one rank contributes to the root record (gathered to rank 0)."""
    module, grid = engine.module, engine.grid
    names = checkpoint_names(module)
    # replica 0 of each stage lists its parameters; the other replicas only the experts they hold
    params = [
        [names[n], bool(p.requires_grad), list(p.shape), _layer_order(module, names[n])]
        for n, p in module.named_parameters()
        if grid.data_parallel_id == 0 or is_expert_param(p)
    ]
    return {
        "stage": grid.stage_id,
        "data_parallel_rank": grid.data_parallel_id,
        "parameters": params,
        "shared_parameters": shared_parameters(module, names),
        "param_groups": param_group_hyperparameters(engine.optimizer),
    }


def _extra_meta(engine: PipelineEngine) -> dict[str, Any]:
    """The root record's ``parameters`` of every stage and its ``pipeline`` section (collective)."""
    records: list[Any] = [None] * _dist.get_world_size()
    _dist.all_gather_object(records, _rank_record(engine))
    params: dict[str, list[Any]] = {}
    shared: list[list[str]] = []
    groups: dict[int, Any] = {}
    for rec in records:
        for name, requires_grad, shape, order in rec["parameters"]:
            params.setdefault(name, [order, name, requires_grad, shape])
        shared += [pair for pair in rec["shared_parameters"] if pair not in shared]
        groups.setdefault(rec["stage"], rec["param_groups"])
    ordered = sorted(params.values(), key=lambda e: e[0])  # stable: a layer's own order within it
    module = engine.module
    return {
        "parameters": [[name, rg, shape] for _, name, rg, shape in ordered],
        "shared_parameters": shared,
        PIPELINE_SECTION: {
            "version": SECTION_VERSION,
            "num_stages": engine.num_stages,
            "num_chunks": engine.num_chunks,
            "data_parallel_size": engine.dp_size,
            "parts": list(module.parts),
            "num_layers": len(module.layer_specs),
            "tied_owner_stages": module.tied_owner_stages(),
            "stage_param_groups": [groups[s] for s in range(engine.num_stages)],
        },
    }


def save_engine_checkpoint(
    engine: PipelineEngine,
    save_dir: str,
    tag: str | int | None = None,
    client_state: dict | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
) -> str:
    """Save the engine's whole training state (collective: every rank of every stage calls it).

    See [Note: universal pipeline checkpoints]; returns the tag directory.
    """
    if not isinstance(save_dir, (str, os.PathLike)):
        raise TypeError(f"save_checkpoint: save_dir must be a path, got {type(save_dir).__name__}")
    if client_state is not None and not isinstance(client_state, dict):
        raise TypeError(f"save_checkpoint: client_state must be a dict, got {type(client_state)}")
    from zero_core.checkpoint.format import validate_tag

    tag = validate_tag(f"global_step{engine.global_steps}" if tag is None else tag)  # before any collective
    extra = _extra_meta(engine)
    save_checkpoint(
        _EngineView(engine),
        save_dir,
        tag,
        client_state if client_state is not None else {},
        save_latest,
        exclude_frozen_parameters,
        extra_meta=extra,
    )
    return os.path.join(os.fspath(save_dir), tag)


def _pipeline_section(meta: dict[str, Any], where: str) -> dict[str, Any]:
    """The record's pipeline section, checked; an error for a checkpoint of another engine."""
    section = meta.get(PIPELINE_SECTION)
    if not isinstance(section, dict):
        raise CheckpointError(
            f"{where} is a zero checkpoint without a pipeline section: it was saved by a ZeroEngine, whose "
            "parameter names are not a PipelineModule's; load it with that engine (or convert it with "
            "zero_to_fp32 and load the weights into the layers yourself)"
        )
    if section.get("version") != SECTION_VERSION:
        raise CheckpointError(
            f"{where}: pipeline section version {section.get('version')!r}; this zero-pipe reads {SECTION_VERSION}"
        )
    for key in ("num_stages", "num_chunks", "data_parallel_size", "num_layers"):
        check_int(section, key, f"{where}: pipeline", lo=1)
    groups = section.get("stage_param_groups")
    if not isinstance(groups, list) or len(groups) != section["num_stages"]:
        raise CheckpointError(
            f"{where}: pipeline.stage_param_groups is not a list per stage (corrupted record)"
        )
    for s, g in enumerate(groups):
        check_hyperparameters(g, f"{where}: pipeline.stage_param_groups[{s}]")
    return section


def _check_layer_count(module: PipelineModule, section: dict[str, Any], where: str) -> None:
    if section["num_layers"] != len(module.layer_specs):
        raise CheckpointError(
            f"{where}: the checkpoint's PipelineModule has {section['num_layers']} layers, this one "
            f"{len(module.layer_specs)}; the layer lists must be the same"
        )


def check_names(reader: CheckpointReader, module: PipelineModule, *, strict: bool) -> None:
    """With ``strict``: the names of this stage's layers match the checkpoint's exactly, and every saved
    name belongs to a layer of ``module`` (see [Note: universal pipeline checkpoints])."""
    if not strict:
        return
    names = checkpoint_names(module)
    params = {names[n]: p for n, p in module.named_parameters()}
    params_set = {names.get(n, n) for n, _ in module.named_parameters(remove_duplicate=False)}
    persistent = module.state_dict(keep_vars=True)
    buffers = {n for n, _ in module.named_buffers() if n in persistent}
    saved_params = set(reader.names(PARAM)) | set(reader.names(FP32))
    saved_buffers = set(reader.names(BUFFER))
    missing = [
        n
        for n, p in params.items()
        if n not in saved_params and not (reader.exclude_frozen and not p.requires_grad)
    ]
    missing += sorted(buffers - saved_buffers)
    every_layer = {f"layers.{i}" for i in range(len(module.layer_specs))} | {
        f"tied_modules.{s.key}" for s in module.layer_specs if isinstance(s, TiedLayerSpec)
    }
    own = params_set | buffers
    mine = {_layer_prefix(n) for n in own} - {None}
    experts = any(is_expert_param(p) for p in module.parameters())
    unexpected = []
    for n in sorted(saved_params | saved_buffers):
        prefix = _layer_prefix(n)
        if prefix is not None and prefix not in every_layer:
            unexpected.append(n)
        elif (prefix in mine or prefix is None) and n not in own and not experts:
            unexpected.append(n)  # (an expert-parallel stage holds only its own experts)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {reader.tag_dir} does not match this pipeline stage's layers (load_module_strict=True): "
            f"missing {missing}, unexpected {unexpected}"
        )


def _restore(
    view: _EngineView, meta: dict[str, Any], reader: CheckpointReader, load_opt: bool, load_sched: bool
) -> None:
    """The engine-level state of a universal checkpoint (zero-core's loader calls it after the weights)."""
    engine = view.engine
    section = meta[PIPELINE_SECTION]
    engine.global_steps = int(meta["global_steps"])
    engine.global_samples = int(meta["global_samples"])
    engine.stage_optimizer.skipped_steps = int(meta["skipped_steps"])
    engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    if load_opt:
        same_stages = section["num_stages"] == engine.num_stages
        groups = section["stage_param_groups"][engine.stage_id if same_stages else 0]
        restore_param_groups(engine.optimizer, groups, reader.tag_dir)
    if load_sched and engine.lr_scheduler is not None and meta.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    if (section["num_stages"], section["data_parallel_size"]) == (engine.num_stages, engine.dp_size):
        rank = _dist.get_rank()
        table = reader.rank_table(rank)
        f = reader.tensor_file(rank)
        rng.restore({k: f.read_tensor(k) for k in table.get("rng_tensors", [])}, table.get("rng", {}))


def load_engine_checkpoint(
    engine: PipelineEngine,
    load_dir: str,
    tag: str | int | None = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str | None, dict | None]:
    """Load an engine checkpoint in any layout; returns ``(tag directory, client_state)``.

    See [Note: universal pipeline checkpoints]; a format-2 tag loads as [Note: format-2 pipeline
    checkpoints] says. With no tag given and no ``latest`` file, nothing is loaded and
    ``(None, None)`` returned with a warning, as DeepSpeed does.
    """
    if not isinstance(load_dir, (str, os.PathLike)):
        raise TypeError(f"load_checkpoint: load_dir must be a path, got {type(load_dir).__name__}")
    load_dir = os.fspath(load_dir)
    name = resolve_tag(load_dir, tag)
    if name is None:
        warnings.warn(
            f"load_checkpoint: no 'latest' file in {load_dir} and no tag given; nothing loaded", stacklevel=3
        )
        return None, None
    tag_dir = tag_directory(load_dir, name)
    if not os.path.isfile(os.path.join(tag_dir, COMMIT_FILE)) and os.path.isfile(
        os.path.join(tag_dir, LAYERS_INDEX)
    ):
        from zero_pipe.legacy_checkpoint import load_format2_checkpoint

        return load_format2_checkpoint(
            engine,
            tag_dir,
            read_root(os.path.join(tag_dir, LAYERS_INDEX)),
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )
    commit = os.path.join(tag_dir, COMMIT_FILE)
    if not os.path.isfile(commit):
        what = "does not exist" if not os.path.isdir(tag_dir) else f"has no {COMMIT_FILE}"
        raise CheckpointError(f"checkpoint tag directory {tag_dir} {what}: not a complete checkpoint")
    # checked before anything is read into place (zero-core's loader verifies the rest)
    section = _pipeline_section(check_seal(read_json(commit), commit, required=False), commit)
    _check_layer_count(engine.module, section, commit)
    return load_checkpoint(
        _EngineView(engine, strict=load_module_strict),
        load_dir,
        name,
        load_module_strict=False,  # checked per stage: see _StageFragments
        load_optimizer_states=load_optimizer_states,
        load_lr_scheduler_states=load_lr_scheduler_states,
        load_module_only=load_module_only,
        restore_engine=_restore,
    )


@torch.no_grad()
def load_module_weights(module: PipelineModule, tag_dir: str, strict: bool = True) -> None:
    """The weights and buffers of this stage's layers from an engine checkpoint's tag directory
    (``PipelineModule.load_state_dir``); no optimizer state, no process group needed."""
    load_dir, tag = os.path.split(os.path.abspath(tag_dir))
    meta, reader = open_checkpoint(load_dir, tag)
    try:
        _check_layer_count(module, _pipeline_section(meta, tag_dir), tag_dir)
        check_names(reader, module, strict=strict)
        names = checkpoint_names(module)
        for local, p in module.named_parameters():
            name = names[local]
            if reader.has(name, PARAM) or reader.has(name, FP32):
                shape = reader.shape(name, PARAM if reader.has(name, PARAM) else FP32)
                if shape != tuple(p.shape):
                    raise CheckpointError(
                        f"{tag_dir}: parameter {name!r} has shape {shape}, the module's {tuple(p.shape)}"
                    )
                reader.read_module_value_into(p.detach(), name)
        for name, b in module.named_buffers():
            if reader.has(name, BUFFER):
                reader.read_into(b, name, BUFFER)
    finally:
        reader.close()


def load_module_state(module: PipelineModule, load_dir: str, strict: bool = True) -> None:
    """``PipelineModule.load_state_dir``: this stage's layers, saved with any number of stages,
    from an engine checkpoint's tag directory (either format) or a ``save_state_dict`` directory
    (see [Note: per-layer pipeline checkpoints] in ``layer_files.py``)."""
    if not isinstance(load_dir, (str, os.PathLike)):
        raise TypeError(f"load_module_layers: load_dir must be a path, got {type(load_dir).__name__}")
    load_dir = os.fspath(load_dir)
    if os.path.isfile(os.path.join(load_dir, COMMIT_FILE)):
        load_module_weights(module, load_dir, strict=strict)
    else:
        load_layer_files(module, load_dir, strict)
