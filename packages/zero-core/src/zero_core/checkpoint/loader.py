"""``engine.load_checkpoint``: open a tag, verify it, let the strategy take its ranges.

The reader (``fragments.py``) makes the saved world size and stage irrelevant: the engine's
strategy reads exactly the ranges it owns now. Engine-level state (counters, loss scaler, LR
scheduler, optimizer hyper-parameters, buffers, RNG) is restored here.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from zero_core import comm
from zero_core.checkpoint import outcome, rng
from zero_core.checkpoint.experts import global_expert_names
from zero_core.checkpoint.format import (
    COMMIT_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST_FILE,
    CheckpointError,
    read_json,
    validate_tag,
)
from zero_core.checkpoint.fragments import BUFFER, CheckpointableStrategy, CheckpointReader
from zero_core.checkpoint.integrity import verify_file
from zero_core.checkpoint.metadata import check_engine_meta, check_seal
from zero_core.checkpoint.outcome import attempt


def resolve_tag(load_dir: str, tag: Any) -> str | None:
    """``tag`` validated, or the one ``latest`` names (None when there is no ``latest``)."""
    if tag is not None:
        return validate_tag(tag)
    latest = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(latest):
        return None
    with open(latest, encoding="utf-8") as f:
        name = f.read().strip()
    try:
        return validate_tag(name)
    except ValueError:
        raise CheckpointError(
            f"{latest} names {name!r}, which is not a valid tag (corrupted file?)"
        ) from None


def tag_directory(load_dir: str, tag: str) -> str:
    """``load_dir/tag``, or the complete copy a crash left set aside while replacing it.

    See [Note: replacing a tag] in ``staged.py``.
    """
    tag_dir = os.path.join(load_dir, tag)
    aside = os.path.join(load_dir, f".{tag}.old")
    if not os.path.isdir(tag_dir) and os.path.isfile(os.path.join(aside, COMMIT_FILE)):
        warnings.warn(
            f"checkpoint tag {tag_dir} is missing (a save replacing it was interrupted); loading the "
            f"previous copy {aside}",
            stacklevel=3,
        )
        return aside
    return tag_dir


def _format_version(meta: Any, commit: str) -> int:
    """The record's format version, read before its seal is checked (format 1-2 records have none)."""
    v = meta.get("format_version") if isinstance(meta, dict) else None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise CheckpointError(f"{commit} is not a zero checkpoint record (format_version {v!r})")
    return v


def _refuse_deepspeed(load_dir: str, tag_dir: str) -> None:
    """A DeepSpeed checkpoint is converted once, not on every load; see [Note: importing a DeepSpeed checkpoint]."""
    from zero_core.checkpoint.deepspeed_import.layout import is_deepspeed_checkpoint

    if is_deepspeed_checkpoint(tag_dir):
        raise CheckpointError(
            f"{tag_dir} is a DeepSpeed checkpoint, not a zero one. Convert it once: "
            f"`python tools/from_deepspeed.py {load_dir} OUT_DIR` (or "
            f"zero.checkpoint.from_deepspeed({load_dir!r}, OUT_DIR)), then load OUT_DIR: the converted "
            "checkpoint loads at any world size and ZeRO stage"
        )


def open_checkpoint(load_dir: str, tag: str) -> tuple[dict[str, Any], CheckpointReader]:
    """Read and verify ``checkpoint.json`` and every rank table of ``load_dir/tag``."""
    tag_dir = tag_directory(load_dir, tag)
    commit = os.path.join(tag_dir, COMMIT_FILE)
    if not os.path.isdir(tag_dir):
        raise CheckpointError(f"checkpoint tag directory {tag_dir} does not exist")
    if not os.path.isfile(commit):
        _refuse_deepspeed(load_dir, tag_dir)
        raise CheckpointError(f"{commit} is missing: {tag_dir} is not a complete zero checkpoint")
    meta = read_json(commit)
    version = _format_version(meta, commit)
    check_seal(meta, commit, required=version >= 3)  # see [Note: sealed metadata]
    if meta.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{commit} is not a zero checkpoint record (format {meta.get('format')!r})")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{commit} has format version {version}; this zero_core reads up to {FORMAT_VERSION}"
        )
    check_engine_meta(meta, commit)
    world = meta["world_size"]
    tables = []
    for r in range(world):
        name = f"rank_{r:05d}.json"
        path = os.path.join(tag_dir, name)
        if name not in meta["files"]:
            raise CheckpointError(f"{commit} has no record of {name}")
        verify_file(path, meta["files"][name])
        tables.append(read_json(path))
        if not isinstance(tables[-1], dict) or tables[-1].get("world_size") != world:
            raise CheckpointError(
                f"{commit} records world size {world}, but {path} says it was saved at world size "
                f"{tables[-1].get('world_size') if isinstance(tables[-1], dict) else '?'}: the record is wrong"
            )
    extra = os.path.join(tag_dir, f"rank_{world:05d}.json")
    if os.path.exists(extra):
        raise CheckpointError(
            f"{commit} records world size {world}, but {tag_dir} also holds {os.path.basename(extra)}: "
            "it was saved at a larger world size and its record is wrong (edited or corrupted)"
        )
    reader = CheckpointReader(tag_dir, tables)
    reader.exclude_frozen = bool(meta.get("exclude_frozen_parameters", False))
    return meta, reader


@torch.no_grad()
def _load_buffers(reader: CheckpointReader, module: torch.nn.Module, strict: bool) -> None:
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    sd = module.state_dict(keep_vars=True)
    mine = {n: t for n, t in sd.items() if n not in params and torch.is_tensor(t)}
    saved = set(reader.names(BUFFER))
    if strict and (set(mine) != saved):
        raise CheckpointError(
            f"checkpoint {reader.tag_dir} buffers do not match the model (load_module_strict=True): "
            f"missing {sorted(set(mine) - saved)}, unexpected {sorted(saved - set(mine))}"
        )
    for name, t in mine.items():
        if name in saved:
            if math.prod(reader.shape(name, BUFFER)) != t.numel():
                raise CheckpointError(
                    f"checkpoint {reader.tag_dir}: buffer {name!r} has shape {reader.shape(name, BUFFER)}, the "
                    f"model's {tuple(t.shape)}"
                )
            # in place; converts where the dtypes differ (see [Note: reading into place])
            reader.read_into(t, name, BUFFER)


def full_module_state_dict(reader: CheckpointReader, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The saved module weights and buffers as a whole state dict (what ``custom_load_fn`` gets)."""
    from zero_core.checkpoint.replicated import checkpoint_names

    names = checkpoint_names(module)
    out = {}
    for local, p in module.named_parameters():
        name = names[local]  # keyed by the module's own names; read under the checkpoint's
        if reader.has(name, "param") or reader.has(name, "fp32"):
            out[local] = reader.read_module_value(name, p.dtype).view(
                reader.shape(name, "param" if reader.has(name, "param") else "fp32")
            )
    for name in reader.names(BUFFER):
        out[name] = reader.read_full(name, BUFFER)
    return out


def restore_param_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]], where: str) -> None:
    """Set each param group's saved hyper-parameters (lr, betas ...); the group counts must match."""
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{where}: the checkpoint has {len(saved)} optimizer param groups, this optimizer has "
            f"{len(optimizer.param_groups)}; pass load_optimizer_states=False to load the weights only"
        )
    for group, hp in zip(optimizer.param_groups, saved):
        for k, v in hp.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v


def _require_optimizer_states(
    engine: Any, meta: dict[str, Any], reader: CheckpointReader, load_opt: bool
) -> None:
    """Refuse, before any state is touched, to load optimizer states a checkpoint does not hold
    (one saved by an engine without an optimizer: See [Note: engine without an optimizer])."""
    if load_opt and engine.optimizer is not None and meta["optimizer"].get("class") is None:
        reader.close()
        raise CheckpointError(
            f"load_checkpoint: {reader.tag_dir} was saved by an engine without an optimizer, so it "
            "holds no optimizer states; pass load_optimizer_states=False (or load_module_only=True) "
            "to load its module into this engine"
        )


def _check_arguments(load_dir: Any, custom_load_fn: Any) -> str:
    """``load_dir`` as a str, or a clear error for a bad argument."""
    if not isinstance(load_dir, (str, os.PathLike)):
        raise TypeError(f"load_checkpoint: load_dir must be a path, got {type(load_dir).__name__}")
    if custom_load_fn is not None and not callable(custom_load_fn):
        raise TypeError(
            "load_checkpoint: custom_load_fn must be callable (called as custom_load_fn(src=..., dst=...))"
        )
    return os.fspath(load_dir)


def load_checkpoint(
    engine: Any,
    load_dir: str | os.PathLike[str],
    tag: Any = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    custom_load_fn: Callable[..., Any] | None = None,
    *,
    restore_engine: Callable[..., None] | None = None,
) -> tuple[str | None, dict[str, Any] | None]:
    """Load a checkpoint into ``engine``; returns ``(load_path, client_state)``, ``(None, None)`` if none.

    ``restore_engine(engine, meta, reader, load_opt, load_sched)`` replaces ``_restore_engine``
    (counters, loss scaler, hyper-parameters, scheduler, RNG) for engines keeping them otherwise (zero-pipe).
    [Note: shared verification]
    Before anything is read, ``open_checkpoint`` verifies ``checkpoint.json`` and every rank
    table (CRC-32C), and ``CheckpointReader.begin_single_pass`` checks that every rank tensor
    file exists with its recorded size, so a missing, truncated or padded file fails the
    load with the live state untouched. The tensor files' checksums are verified in the
    same pass that copies their bytes into place (see [Note: single-pass load] in
    ``single_pass.py``): each file is read whole and checksummed by exactly one loading rank
    (saved rank f's by rank ``f % M``), the other ranks read only their ranges of it, and one
    all-reduce in ``finish_single_pass`` gives every rank the lowest-numbered bad file, so all
    of them raise an error naming it; a rank that did not verify that file says another rank
    found it bad. (Before the single pass the ranks also split the files between them, but
    verified them completely before anything was copied: one disk pass, but the copies had to
    wait for it, so a cold load cost disk time plus copy time.)
    A file that fails after bytes were copied leaves the engine refusing to train or save
    until a load succeeds. Any other failure of a rank's own part (opening the tag, planning
    its reads) is agreed on before the single pass, so every rank raises it (see [Note:
    collective save outcome]).
    """
    load_dir = _check_arguments(load_dir, custom_load_fn)
    tag = resolve_tag(load_dir, tag)
    if tag is None:
        warnings.warn(
            f"load_checkpoint: no 'latest' file in {load_dir} and no tag given; nothing loaded", stacklevel=3
        )
        return None, None
    strategy = engine.strategy
    if not isinstance(strategy, CheckpointableStrategy):
        raise CheckpointError(
            f"load_checkpoint: the {type(strategy).__name__} strategy cannot load checkpoints"
        )
    group = getattr(engine, "dp_group", None)
    load_opt = load_optimizer_states and not load_module_only
    opened: list[Any] = []  # [meta, reader] once open
    prepare = functools.partial(
        _prepare, engine, load_dir, tag, opened, load_opt, load_module_only, load_module_strict
    )
    error = attempt(prepare)
    meta, reader = opened if opened else (None, None)
    try:
        outcome.agree(group, error, f"load_checkpoint of tag {tag!r} from {load_dir}", "Nothing was loaded")
        restore_fn = restore_engine or _restore_engine

        def restore(e: Any, m: dict[str, Any], r: CheckpointReader) -> None:
            restore_fn(e, m, r, load_optimizer_states, load_lr_scheduler_states)

        _complete(engine, meta, reader, custom_load_fn, restore, load_module_only, load_module_strict)
    except BaseException as e:
        if reader is not None and reader.touched_state and hasattr(engine, "invalidate_state"):
            engine.invalidate_state(
                f"the last load_checkpoint from {reader.tag_dir} failed after overwriting part of the "
                f"model/optimizer state: {e}; load a good checkpoint before training",
                optimizer=load_opt,
            )
        raise
    finally:
        if reader is not None:
            reader.close()
    if hasattr(engine, "state_restored"):
        engine.state_restored(optimizer=load_opt)
    return reader.tag_dir, meta.get("client_state", {})


def _prepare(
    engine: Any,
    load_dir: str,
    tag: str,
    opened: list[Any],
    load_opt: bool,
    module_only: bool,
    strict: bool,
) -> None:
    """This rank's part of a load, before any collective (see [Note: collective save outcome]):
    open and check the tag, plan the strategy's reads; ``opened`` receives ``[meta, reader]``.
    The single pass it begins is finished by the caller once every rank got here."""
    meta, reader = _open_for(engine, load_dir, tag)
    opened[:] = [meta, reader]
    _require_optimizer_states(engine, meta, reader, load_opt)
    # sizes of every rank file checked here, checksums in the single pass (see [Note: shared verification])
    reader.begin_single_pass(getattr(engine, "dp_group", None))
    engine.strategy.load_checkpoint_fragments(
        reader, load_optimizer_states=load_opt, load_module_only=module_only, strict=strict
    )
    _load_buffers(reader, engine.module, strict)


def _complete(
    engine: Any,
    meta: dict[str, Any],
    reader: CheckpointReader,
    custom_load_fn: Callable[..., Any] | None,
    restore: Callable[..., None],
    module_only: bool,
    strict: bool,
) -> None:
    """After every rank prepared its reads: the single pass, then the engine state."""
    reader.finish_single_pass()
    reader.end_single_pass()
    if custom_load_fn is not None:
        custom_load_fn(src=full_module_state_dict(reader, engine.module), dst=engine.module)
    if not module_only:
        restore(engine, meta, reader)
        _restore_sparse_names(engine, meta, strict)
    finish = getattr(engine.strategy, "after_checkpoint_load", None)
    if finish is not None:  # see [Note: rank-local optimizer state]
        finish()


def _open_for(engine: Any, load_dir: str, tag: str) -> tuple[dict[str, Any], CheckpointReader]:
    """``open_checkpoint`` with the reader set up for ``engine``: expert names, master source."""
    meta, reader = open_checkpoint(load_dir, tag)
    reader.aliases = global_expert_names(engine.module)  # see [Note: expert fragments]
    zc = getattr(getattr(engine, "config", None), "zero_optimization", None)
    # zero_optimization.load_from_fp32_weights: false builds the masters from the 16-bit weights
    reader.masters_from_weights = not bool(getattr(zc, "load_from_fp32_weights", True))
    return meta, reader


def _restore_sparse_names(engine: Any, meta: dict[str, Any], strict: bool) -> None:
    """DeepSpeed's ``sparse_tensor_module_names`` from the record (See [Note: sparse gradients])."""
    saved = meta.get("sparse_tensor_module_names")
    if saved is None or not hasattr(engine, "sparse_tensor_module_names"):
        return  # a record older than the field, or an engine without the bookkeeping
    from zero_core.utils.sparse_names import restored_names

    own_params = {n for n, _ in engine.module.named_parameters()}
    saved_params = {entry[0] for entry in meta.get("parameters", [])}
    engine.sparse_tensor_module_names = restored_names(
        engine.sparse_tensor_module_names, saved, own_params, saved_params, strict
    )


def _restore_engine(
    engine: Any, meta: dict[str, Any], reader: CheckpointReader, load_opt: bool, load_sched: bool
) -> None:
    engine.global_steps = int(meta["global_steps"])
    engine.global_samples = int(meta["global_samples"])
    engine.skipped_steps = int(meta["skipped_steps"])
    engine.micro_steps = int(meta["micro_steps"])
    engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    pld = getattr(engine, "progressive_layer_drop", None)
    if pld is not None:  # the schedule follows the restored counter: See [Note: progressive layer drop]
        pld.resume_at(engine.global_steps)
    if load_opt and engine.optimizer is not None:  # See [Note: engine without an optimizer]
        restore_param_groups(engine.optimizer, meta["optimizer"]["param_groups"], reader.tag_dir)
    sched = getattr(engine, "lr_scheduler", None)
    if load_sched and sched is not None and meta.get("lr_scheduler") is not None:
        sched.load_state_dict(meta["lr_scheduler"])
    group = getattr(engine, "dp_group", None)
    rank = comm.get_rank(group) if comm.is_initialized() else 0
    world = comm.get_world_size(group) if comm.is_initialized() else 1
    if world == reader.world_size:  # resharded runs keep their own generators: rank r has no saved twin
        table = reader.rank_table(rank)
        f = reader.tensor_file(rank)
        rng.restore({k: f.read_tensor(k) for k in table.get("rng_tensors", [])}, table.get("rng", {}))
