"""``from_deepspeed(ds_dir, out_dir)``: a DeepSpeed checkpoint folder as a zero checkpoint.

[Note: importing a DeepSpeed checkpoint]
A run started under DeepSpeed (0.14-0.19, ZeRO stages 0-3, fp32/bf16/fp16) continues under
zero from its checkpoint folder: the converter writes a zero checkpoint ([Note: checkpoint
format]) holding the same weights, fp32 masters, optimizer states (Adam's moments and step
counts), loss scaler, LR scheduler state, counters and client state. zero checkpoints are
fragments of named parameters, so the result loads at any world size and ZeRO stage through
zero's own resharding loader; the converter does not need to know the world size it will
be loaded at.

* Safety: DeepSpeed's files are pickles, read with an allow-list and no code from them run
  ([Note: reading DeepSpeed pickles safely]).
* Layout: one zero rank file per DeepSpeed data-parallel rank file, holding the fragments that
  rank's partition covers ([Note: DeepSpeed flat partitions]; stage 0: [Note: DeepSpeed stage 0
  optimizer groups]); rank 0's also holds the module weights (16-bit runs) and buffers. The
  fragments are checked to cover every parameter before the tag is published.
* Memory: one DeepSpeed file is read at a time (rank 0: its model-states file as well), its
  tensors memory-mapped (``torch.load(mmap=True)``), and each zero rank file is written tensor
  by tensor; so the peak is about one DeepSpeed rank file, whatever the number of ranks.
* Crash safety: the tag is written into a staging directory and published by zero's own
  commit (``saver.commit_tag``): checksums, sealed ``checkpoint.json``, ``latest`` last.
* Loss scale (fp16): ``cur_scale``, ``cur_iter``, ``last_overflow_iter`` and ``cur_hysteresis``
  are carried as saved (the stage 0 fp16 optimizer saves no hysteresis: the config's is used).
  Two DeepSpeed 0.19.8 behaviours zero does not copy, so an fp16 run matches DeepSpeed's
  losses only until the first loss-scale growth after the load: DeepSpeed unscales a growth
  step's gradients with the grown scale (halving them), and grows the scale one step later
  than zero's (and its own older) ``(cur_iter - last_overflow_iter) % window == 0`` rule. Its
  stage 0 fp16 optimizer also updates differently from zero's fp16 stage 0: from the same
  initial weights the losses differ from the first update, and the Adam moments it saves are
  about 1/130 of those the same run holds at ZeRO-2. The state it saves is imported exactly;
  the losses that follow differ.
* Versions: the layout is DeepSpeed's from 0.14 to 0.19 (absent newer keys such as
  ``param_alignment_paddings`` read as zeros, FusedAdam's per-group and CPU Adam's integer step
  counts read as Adam's tensor ``step``); the committed fixtures are DeepSpeed 0.19.8's.
* What is not carried: RNG states (DeepSpeed saves none; zero's loader then leaves each rank's
  generators as they are) and DeepSpeed's data sampler / random-LTD states (zero has no
  equivalent; a warning names them when present).

``engine.load_checkpoint(ds_dir)`` does not convert on the fly: pointed at a DeepSpeed folder it
raises an error telling to run this converter once (``tools/from_deepspeed.py DS_DIR OUT_DIR``)
and to load ``OUT_DIR``, so that the conversion (minutes for large models) runs once, not on
every rank at every start.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from zero_core.checkpoint.atomic import atomic_write_bytes
from zero_core.checkpoint.deepspeed_import.engine_state import engine_record, loss_scaler_state
from zero_core.checkpoint.deepspeed_import.layout import DeepSpeedFolder, find_checkpoint
from zero_core.checkpoint.deepspeed_import.partitions import (
    frozen_shard_fragments,
    shape_groups,
    zero3_fragments,
    zero12_fragments,
)
from zero_core.checkpoint.deepspeed_import.safe_pickle import load_deepspeed_file
from zero_core.checkpoint.deepspeed_import.stage0 import stage0_fragments
from zero_core.checkpoint.deepspeed_import.states import hyperparameters
from zero_core.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    CheckpointError,
    dumps,
    rank_json_name,
    rank_tensor_name,
    staging_dir_name,
    validate_tag,
)
from zero_core.checkpoint.fragments import BUFFER, FP32, PARAM, Fragment
from zero_core.checkpoint.integrity import CHECKSUM_ALGORITHM
from zero_core.checkpoint.saver import commit_tag
from zero_core.checkpoint.tensor_file import TensorEntry, write_tensor_file

Progress = Callable[[str], None]


@dataclass
class _Model:
    """What the model-states file says about the module (rank 0's file)."""

    stage: int
    shapes: dict[str, tuple[int, ...]]  # every parameter (tied aliases left out), module order
    aliases: list[list[str]]  # [alias, owner] of tied parameters
    buffers: list[str]
    groups: list[list[tuple[str, tuple[int, ...]]]] = field(default_factory=list)  # stages 1-3
    trained: set[str] = field(default_factory=set)


def _tied(module: dict[str, torch.Tensor], names: list[str]) -> dict[str, str]:
    """``{alias: owner}`` of entries sharing storage (how ``torch.save`` keeps a tied weight)."""
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    out = {}
    for n in names:
        t = module[n]
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.numel() and key in seen:
            out[n] = seen[key]
        else:
            seen.setdefault(key, n)
    return out


def _model_layout(states: dict[str, Any], stage: int, where: str) -> _Model:
    module = states.get("module")
    if not isinstance(module, dict):
        raise CheckpointError(f"{where}: 'module' is not a state dict")
    buffers = [b for b in states.get("buffer_names") or [] if b in module]
    names = [n for n in module if n not in set(buffers)]
    shared = states.get("shared_params")
    aliases = dict(shared) if isinstance(shared, dict) and stage > 0 else _tied(module, names)
    groups = shape_groups(states.get("param_shapes"), where) if stage > 0 else []
    if stage == 3:  # the module holds empty placeholders: shapes come from the layout records
        known = {n: s for g in groups for n, s in g}
        known.update(
            {n: tuple(int(d) for d in s) for n, s in (states.get("frozen_param_shapes") or {}).items()}
        )
        shapes = {n: known[n] for n in names if n not in aliases and n in known}
    else:
        shapes = {n: tuple(module[n].shape) for n in names if n not in aliases}
    trained = {n for g in groups for n, _ in g}
    missing = sorted(trained - set(shapes))
    if missing:
        raise CheckpointError(
            f"{where}: the optimizer's parameters {missing} are not in the module state dict"
        )
    return _Model(stage, shapes, [[a, o] for a, o in aliases.items()], buffers, groups, trained)


def _stage_of(folder: DeepSpeedFolder, states: dict[str, Any]) -> int:
    if not folder.optim_files:
        return 0
    if folder.partitioned_weights:
        return 3
    config = states.get("ds_config")
    zo = config.get("zero_optimization") if isinstance(config, dict) else None
    stage = zo.get("stage", 1) if isinstance(zo, dict) else 1
    return 2 if stage == 2 else 1


def _module_fragments(states: dict[str, Any], model: _Model) -> list[Fragment]:
    """Rank 0's module weights the masters do not give exactly, and the buffers."""
    module = states["module"]
    out = []
    for name, shape in model.shapes.items():
        t = module[name]
        if model.stage == 3 or t.numel() != math.prod(shape):  # stage 3: frozen shards come per rank
            continue
        if t.dtype != torch.float32 or name not in model.trained:
            out.append(Fragment(name, PARAM, shape, 0, t.numel(), t.detach().reshape(-1)))
    for name in model.buffers:
        t = module[name].detach()
        out.append(Fragment(name, BUFFER, tuple(t.shape), 0, t.numel(), t.reshape(-1)))
    return out


def _write_rank(stage_dir: str, rank: int, world: int, fragments: list[Fragment]) -> None:
    entries = [
        TensorEntry(f.key, (f.end - f.start,), f.tensor.dtype, (lambda t=f.tensor: t)) for f in fragments
    ]
    name = rank_tensor_name(rank)
    record = write_tensor_file(os.path.join(stage_dir, name), entries)
    table = {
        "rank": rank,
        "world_size": world,
        "file": name,
        "file_record": record,
        "fragments": [f.record() for f in fragments],
        "rng": {},  # DeepSpeed saves no RNG states
        "rng_tensors": [],
    }
    atomic_write_bytes(os.path.join(stage_dir, rank_json_name(rank)), dumps(table), sync_dir=False)


class _Coverage:
    """Elements of each (parameter, kind) the written fragments hold, to check nothing is missing."""

    def __init__(self) -> None:
        self.count: dict[tuple[str, str], int] = {}

    def add(self, fragments: list[Fragment]) -> None:
        for f in fragments:
            if f.kind in (PARAM, FP32):
                self.count[(f.name, f.kind)] = self.count.get((f.name, f.kind), 0) + f.end - f.start

    def check(self, model: _Model, where: str) -> None:
        for name, shape in model.shapes.items():
            # stages 1-3 train from the fp32 partitions; elsewhere the whole weight is enough
            kinds = (FP32,) if model.stage > 0 and name in model.trained else (FP32, PARAM)
            got, want = max(self.count.get((name, k), 0) for k in kinds), math.prod(shape)
            kind = "/".join(kinds)
            if got != want:
                raise CheckpointError(
                    f"{where}: the rank files hold {got} of the {want} elements of {name!r} ({kind}); the checkpoint "
                    "is incomplete or its partitions do not match its recorded layout"
                )


def _out_location(folder: DeepSpeedFolder, out_dir: Any, out_tag: Any) -> tuple[str, str]:
    if not isinstance(out_dir, (str, os.PathLike)):
        raise TypeError(f"from_deepspeed: out_dir must be a path, got {type(out_dir).__name__}")
    out_dir = os.fspath(out_dir)
    tag = validate_tag(folder.tag if out_tag is None else out_tag)
    src = os.path.realpath(os.path.dirname(folder.tag_dir))
    if os.path.realpath(out_dir) in (src, os.path.realpath(folder.tag_dir)):
        raise CheckpointError(
            f"from_deepspeed: out_dir {out_dir} is the DeepSpeed checkpoint's own directory; write the zero "
            "checkpoint into another directory (the DeepSpeed files are left as they are)"
        )
    return out_dir, tag


def _rank_fragments(
    folder: DeepSpeedFolder, model: _Model, rank: int, progress: Progress
) -> tuple[list[Fragment], Any, list[dict[str, Any]]]:
    """Rank ``rank``'s optimizer file (and stage 3 model file) as fragments; with its optimizer dict."""
    path = folder.optim_files[rank]
    progress(f"reading {os.path.basename(path)} ({os.path.getsize(path) / 2**20:.1f} MiB)")
    loaded = load_deepspeed_file(path)
    osd = loaded.get("optimizer_state_dict") if isinstance(loaded, dict) else None
    if not isinstance(osd, dict):
        raise CheckpointError(f"{path} holds no optimizer_state_dict: not a DeepSpeed ZeRO optimizer file")
    try:
        return _partition_fragments(folder, model, rank, path, osd)
    except ValueError as e:  # a range outside its tensor: the file does not match its recorded layout
        raise CheckpointError(f"{path}: {e}") from None


def _partition_fragments(
    folder: DeepSpeedFolder, model: _Model, rank: int, path: str, osd: dict[str, Any]
) -> tuple[list[Fragment], Any, list[dict[str, Any]]]:
    world = len(folder.optim_files)
    if model.stage == 3:
        frags, hyper = zero3_fragments(osd, model.groups, rank, world, path)
        if rank > 0:  # rank 0's model-states file was read by the caller
            states = load_deepspeed_file(folder.model_files[rank])
            frozen = {
                n: tuple(int(d) for d in s) for n, s in (states.get("frozen_param_shapes") or {}).items()
            }
            frags += frozen_shard_fragments(
                frozen, states.get("frozen_param_fragments") or {}, rank, world, path
            )
    else:
        frags, hyper = zero12_fragments(osd, model.groups, rank, world, path)
    return frags, osd, hyper


def _meta(
    model: _Model,
    states: dict[str, Any],
    world: int,
    tag: str,
    folder: DeepSpeedFolder,
    extra: dict[str, Any],
) -> dict[str, Any]:
    record = engine_record(states, folder.model_files[0])
    config = states.get("ds_config") if isinstance(states.get("ds_config"), dict) else {}
    opt_type = (
        (config.get("optimizer") or {}).get("type", "unknown")
        if isinstance(config.get("optimizer"), dict)
        else "unknown"
    )
    for key in ("data_sampler", "random_ltd"):
        if states.get(key) is not None:
            warnings.warn(
                f"from_deepspeed: the checkpoint's {key} state has no zero equivalent; not imported",
                stacklevel=3,
            )
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "checksum": CHECKSUM_ALGORITHM,
        "tag": tag,
        "world_size": world,
        "zero_stage": model.stage,
        "exclude_frozen_parameters": model.stage >= 2 and states.get("frozen_param_shapes") is None,
        **record,
        "optimizer": {"class": str(opt_type), "param_groups": extra["param_groups"]},
        "loss_scaler": extra["loss_scaler"],
        "parameters": [[n, n in model.trained, list(s)] for n, s in model.shapes.items()],
        "shared_parameters": model.aliases,
        "imported_from": {"deepspeed_version": str(states.get("ds_version")), "tag_dir": folder.tag_dir},
    }


def from_deepspeed(
    ds_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    out_tag: str | None = None,
    param_groups: list[list[str]] | None = None,
    progress: Progress | None = None,
) -> str:
    """Convert the DeepSpeed checkpoint in ``ds_dir`` into a zero checkpoint in ``out_dir``.

    See [Note: importing a DeepSpeed checkpoint]. ``tag`` picks the DeepSpeed tag (default: the
    one ``ds_dir/latest`` names; ``ds_dir`` may also be a tag directory); the zero checkpoint is
    written under ``out_tag`` (default: the same tag) and ``out_dir/latest`` names it.
    ``param_groups`` (names of each optimizer param group) is needed only for stage 0
    checkpoints whose groups cannot be told from shapes ([Note: DeepSpeed stage 0 optimizer
    groups]). ``progress`` receives one line per file. Returns the tag directory written.
    Load it with ``engine.load_checkpoint(out_dir)`` at any world size and ZeRO stage.
    """
    say = progress or (lambda _msg: None)
    folder = find_checkpoint(ds_dir, tag)
    out_dir, out_tag = _out_location(folder, out_dir, out_tag)
    say(f"reading {os.path.basename(folder.model_files[0])}")
    states = load_deepspeed_file(folder.model_files[0])
    if not isinstance(states, dict):
        raise CheckpointError(f"{folder.model_files[0]} does not hold a DeepSpeed model-states dict")
    model = _model_layout(states, _stage_of(folder, states), folder.model_files[0])
    world = max(1, len(folder.optim_files))
    stage_dir = os.path.join(out_dir, staging_dir_name(out_tag))
    os.makedirs(out_dir, exist_ok=True)
    shutil.rmtree(stage_dir, ignore_errors=True)
    os.makedirs(stage_dir)
    try:
        extra = _write_ranks(folder, model, states, stage_dir, world, param_groups, say)
        commit_tag(
            out_dir, stage_dir, out_tag, world, _meta(model, states, world, out_tag, folder, extra), True
        )
    except BaseException:
        shutil.rmtree(stage_dir, ignore_errors=True)
        raise
    say(f"wrote {os.path.join(out_dir, out_tag)} (world size {world}, ZeRO stage {model.stage})")
    return os.path.join(out_dir, out_tag)


def _write_ranks(
    folder: DeepSpeedFolder,
    model: _Model,
    states: dict[str, Any],
    stage_dir: str,
    world: int,
    param_groups: Any,
    say: Progress,
) -> dict[str, Any]:
    """Write every zero rank file; returns the param groups and loss scaler for the record."""
    coverage = _Coverage()
    where = folder.model_files[0]
    if model.stage == 0:
        frags, hyper, fields, model.trained = stage0_fragments(
            states["module"], model.shapes, states.get("optimizer"), param_groups, where
        )
        frags += [f for f in _module_fragments(states, model) if f.kind == BUFFER]
        osd: Any = None
    else:
        if param_groups is not None:
            raise CheckpointError(
                f"{where}: param_groups is for stage 0 checkpoints; this one records its groups"
            )
        frags, osd, hyper = _rank_fragments(folder, model, 0, say)
        frags += _module_fragments(states, model)
        frozen = {n: tuple(int(d) for d in s) for n, s in (states.get("frozen_param_shapes") or {}).items()}
        if model.stage == 3:
            frags += frozen_shard_fragments(
                frozen, states.get("frozen_param_fragments") or {}, 0, world, where
            )
        fields = {}
    extra = {
        "param_groups": hyperparameters(hyper, where),
        "loss_scaler": loss_scaler_state(osd, fields, states.get("ds_config")),
    }
    coverage.add(frags)
    _write_rank(stage_dir, 0, world, frags)
    say(f"[1/{world}] wrote {rank_tensor_name(0)} ({len(frags)} fragments)")
    del frags, osd
    for rank in range(1, world):
        frags, _, _ = _rank_fragments(folder, model, rank, say)
        coverage.add(frags)
        _write_rank(stage_dir, rank, world, frags)
        say(f"[{rank + 1}/{world}] wrote {rank_tensor_name(rank)} ({len(frags)} fragments)")
        del frags
    coverage.check(model, folder.tag_dir)
    states.pop("module", None)  # the module's tensors are written: let their pages go
    return extra


def main(argv: list[str] | None = None) -> int:
    """``tools/from_deepspeed.py DS_DIR OUT_DIR [--tag T] [--out-tag T] [--param-groups FILE]``."""
    import argparse
    import json

    parser = argparse.ArgumentParser(
        description="Convert a DeepSpeed checkpoint folder (ZeRO stages 0-3) into a zero checkpoint."
    )
    parser.add_argument(
        "ds_dir", help="the save_dir DeepSpeed's save_checkpoint wrote (or one tag directory)"
    )
    parser.add_argument("out_dir", help="directory to write the zero checkpoint into")
    parser.add_argument("--tag", help="DeepSpeed tag to convert (default: the one 'latest' names)")
    parser.add_argument("--out-tag", help="tag of the zero checkpoint (default: the DeepSpeed tag)")
    parser.add_argument(
        "--param-groups",
        help="JSON file [[names of group 0], ...]: stage 0 checkpoints whose param groups cannot be told from shapes",
    )
    args = parser.parse_args(argv)
    try:
        groups = None
        if args.param_groups:
            with open(args.param_groups, encoding="utf-8") as f:
                groups = json.load(f)
        from_deepspeed(
            args.ds_dir,
            args.out_dir,
            tag=args.tag,
            out_tag=args.out_tag,
            param_groups=groups,
            progress=lambda msg: print(f"from_deepspeed: {msg}", file=sys.stderr, flush=True),
        )
    except (CheckpointError, OSError, ValueError, TypeError) as e:
        print(f"from_deepspeed: error: {e}", file=sys.stderr)
        return 1
    return 0
