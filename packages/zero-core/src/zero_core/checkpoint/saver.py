"""``engine.save_checkpoint``: every rank writes its fragments in parallel, rank 0 commits.

Order (see [Note: checkpoint format]): validate everything that can be validated before a
byte is written (tag, client_state); rank 0 prepares an empty staging directory; agreement;
every rank writes ``rank_<r>.safetensors`` then ``rank_<r>.json`` (atomically); agreement;
rank 0 checksums the rank tables, writes ``checkpoint.json`` and the conversion script,
renames the staging directory to the tag, and only then replaces ``latest``; agreement. Each
agreement is where a failure on any rank becomes the same error on every rank (see [Note:
collective save outcome] in ``outcome.py``).

The commit itself (renames, ``latest`` last) is shared with every checkpoint writer: see
[Note: one checkpoint writer] and [Note: replacing a tag] in ``staged.py``; the root record
is sealed ([Note: sealed metadata] in ``metadata.py``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

import torch

from zero_core import comm
from zero_core.checkpoint import outcome, rng
from zero_core.checkpoint.atomic import atomic_write_bytes
from zero_core.checkpoint.experts import global_expert_names
from zero_core.checkpoint.format import (
    COMMIT_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    SCRIPT_FILE,
    CheckpointError,
    check_json_compatible,
    dtype_name,
    dumps,
    rank_json_name,
    rank_tensor_name,
    staging_dir_name,
    validate_tag,
)
from zero_core.checkpoint.fragments import BUFFER, CheckpointableStrategy, Fragment
from zero_core.checkpoint.integrity import CHECKSUM_ALGORITHM, file_crc32c, file_record
from zero_core.checkpoint.metadata import sealed_bytes
from zero_core.checkpoint.outcome import attempt
from zero_core.checkpoint.replicated import checkpoint_names
from zero_core.checkpoint.staged import publish_tag
from zero_core.checkpoint.tensor_file import TensorEntry, write_tensor_file


def buffer_fragments(module: torch.nn.Module) -> list[Fragment]:
    """Whole ``buffer`` fragments of the module's persistent buffers (replicated on every rank)."""
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    out = []
    for name, t in module.state_dict(keep_vars=True).items():
        if name in params or not torch.is_tensor(t):
            continue
        t = t.detach()
        out.append(Fragment(name, BUFFER, tuple(t.shape), 0, t.numel(), t.reshape(-1)))
    return out


def shared_parameters(module: torch.nn.Module, names: dict[str, str]) -> list[list[str]]:
    """``[alias, owner]`` for every second name of a tied parameter (GPT-2's ``lm_head.weight``).

    Fragments are stored once, under the first name ``named_parameters`` gives; the aliases let
    ``zero_to_fp32`` return a state dict that a fresh model loads strictly, as DeepSpeed's does.
    """
    first: dict[int, str] = {}
    out = []
    for n, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.append([names.get(n, n), first[id(p)]])
        else:
            first[id(p)] = names.get(n, n)
    return out


def param_group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's JSON-compatible hyper-parameters (``params`` and tensor values left out)."""
    out = []
    for i, g in enumerate(optimizer.param_groups):
        hp = {}
        for k, v in g.items():
            if k == "params":
                continue
            try:
                check_json_compatible(v, f"optimizer.param_groups[{i}][{k!r}]")
            except TypeError:
                continue  # e.g. a tensor lr: the scheduler state restores it
            hp[k] = list(v) if isinstance(v, tuple) else v
        out.append(hp)
    return out


def _optimizer_meta(optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The optimizer's class and hyper-parameters; ``class`` None for an engine without one.

    See [Note: engine without an optimizer]: its checkpoint holds the module only, and the
    placeholder's groups (lr 0) are not saved, so a training engine never loads them.
    """
    if optimizer is None:
        return {"class": None, "param_groups": []}
    return {"class": type(optimizer).__name__, "param_groups": param_group_hyperparameters(optimizer)}


def _zero_stage(engine: Any) -> int:
    return int(getattr(getattr(engine.config, "zero_optimization", None), "stage", 0) or 0)


def _engine_meta(
    engine: Any, tag: str, world: int, client_state: dict[str, Any], exclude: bool
) -> dict[str, Any]:
    cfg = engine.config
    names = checkpoint_names(engine.module)  # global names of expert parameters (see experts.py)
    sched = getattr(engine, "lr_scheduler", None)
    sched_state = None
    if sched is not None and hasattr(sched, "state_dict"):
        sched_state = sched.state_dict()
        check_json_compatible(sched_state, "lr_scheduler.state_dict()")
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "checksum": CHECKSUM_ALGORITHM,
        "tag": tag,
        "world_size": world,
        "zero_stage": _zero_stage(engine),
        "compute_dtype": dtype_name(engine.compute_dtype),
        "exclude_frozen_parameters": bool(exclude),
        "global_steps": int(engine.global_steps),
        "global_samples": int(engine.global_samples),
        "skipped_steps": int(engine.skipped_steps),
        "micro_steps": int(engine.micro_steps),
        "loss_scaler": engine.loss_scaler.state_dict(),
        "lr_scheduler": sched_state,
        "optimizer": _optimizer_meta(engine.optimizer),
        "parameters": [
            [names[n], bool(p.requires_grad), list(p.shape)] for n, p in engine.module.named_parameters()
        ],
        "shared_parameters": shared_parameters(engine.module, names),
        # See [Note: sparse gradients]
        "sparse_tensor_module_names": sorted(getattr(engine, "sparse_tensor_module_names", ())),
        "config": cfg.to_dict() if hasattr(cfg, "to_dict") else None,
        "client_state": client_state,
    }


def _write_rank(stage_dir: str, rank: int, world: int, fragments: list[Fragment]) -> None:
    rng_tensors, rng_meta = rng.capture()
    # a deferred fragment's values are read as it is written (See [Note: deferred fragments])
    entries = [
        TensorEntry(f.key, (f.end - f.start,), f.tensor.dtype, f.values, temporary=f.produce is not None)
        for f in fragments
    ]
    entries += [TensorEntry(k, tuple(t.shape), t.dtype, (lambda t=t: t)) for k, t in rng_tensors.items()]
    tensor_name = rank_tensor_name(rank)
    # Fragments are views of the live state (and the RNG tensors are held above) until this returns,
    # so they are checksummed while being written (see [Note: checksum overlapped with writing]);
    # deferred ones are temporaries, checksummed inline and dropped after their write.
    record = write_tensor_file(os.path.join(stage_dir, tensor_name), entries, live_tensors=True)
    table = {
        "rank": rank,
        "world_size": world,
        "file": tensor_name,
        "file_record": record,
        "fragments": [f.record() for f in fragments],
        "rng": rng_meta,
        "rng_tensors": sorted(rng_tensors),
    }
    atomic_write_bytes(os.path.join(stage_dir, rank_json_name(rank)), dumps(table), sync_dir=False)


def commit_tag(
    save_dir: str, stage_dir: str, tag: str, world: int, meta: dict[str, Any], save_latest: bool
) -> None:
    """Seal ``meta`` with every rank table's record as ``checkpoint.json`` and publish ``stage_dir`` as ``tag``.

    Rank 0 only, after every ``rank_<r>.json`` is in ``stage_dir`` (also the DeepSpeed importer's commit).
    """
    meta["files"] = {}
    for r in range(world):
        n, crcs = file_crc32c(os.path.join(stage_dir, rank_json_name(r)))
        meta["files"][rank_json_name(r)] = file_record(n, crc32c=crcs)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero_to_fp32.py")
    with open(script, "rb") as f:
        script_bytes = f.read()
    atomic_write_bytes(os.path.join(stage_dir, SCRIPT_FILE), script_bytes, sync_dir=False)
    atomic_write_bytes(os.path.join(stage_dir, COMMIT_FILE), sealed_bytes(meta), sync_dir=False)
    publish_tag(save_dir, stage_dir, tag, save_latest)  # see [Note: replacing a tag] in staged.py
    # Also next to ``latest``, where DeepSpeed users look for it (``python zero_to_fp32.py . out``).
    atomic_write_bytes(os.path.join(save_dir, SCRIPT_FILE), script_bytes)


def save_checkpoint(
    engine: Any,
    save_dir: str | os.PathLike[str],
    tag: Any = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    *,
    extra_meta: dict[str, Any] | None = None,
) -> bool:
    """Save ``engine``'s training state under ``save_dir/tag``; collective, call on every rank.

    ``extra_meta`` (JSON-compatible, used on rank 0) is merged into ``checkpoint.json`` over the
    engine's own entries: an engine whose ranks hold different parts of the model (zero-pipe's
    stages) gives the whole ``parameters`` list and its layout there. The process group is
    ``engine.dp_group`` (the world when the engine has none).
    """
    if not isinstance(save_dir, (str, os.PathLike)):
        raise TypeError(f"save_checkpoint: save_dir must be a path, got {type(save_dir).__name__}")
    save_dir = os.fspath(save_dir)
    tag = validate_tag(f"global_step{engine.global_steps}" if tag is None else tag)
    client_state = {} if client_state is None else client_state
    if not isinstance(client_state, dict):
        raise TypeError(f"save_checkpoint: client_state must be a dict, got {type(client_state).__name__}")
    check_json_compatible(client_state, "client_state")
    strategy = engine.strategy
    if not isinstance(strategy, CheckpointableStrategy):
        raise CheckpointError(
            f"save_checkpoint: the {type(strategy).__name__} strategy cannot be checkpointed "
            "(it has no checkpoint_fragments/load_checkpoint_fragments)"
        )
    group = getattr(engine, "dp_group", None)
    on = comm.is_initialized()
    rank = comm.get_rank(group) if on else 0
    world = comm.get_world_size(group) if on else 1
    # The ranks already agreed on ``tag`` (the engine's save agreement: See [Note: checkpoint tag agreement]).
    meta = _engine_meta(engine, tag, world, client_state, exclude_frozen_parameters) if rank == 0 else None
    exclude = exclude_frozen_parameters
    if extra_meta is not None:
        check_json_compatible(extra_meta, "extra_meta")
        if meta is not None:
            meta.update(extra_meta)

    stage_dir = os.path.join(save_dir, staging_dir_name(tag))
    what = f"save_checkpoint of tag {tag!r} in {save_dir}"
    kept = "Nothing was committed: the previous checkpoint and 'latest' are unchanged"
    # Every step below ends in an outcome agreement, not a barrier: See [Note: collective save outcome].
    error = attempt(lambda: _prepare_staging(save_dir, stage_dir)) if rank == 0 else None
    outcome.agree(group, error, f"{what}, preparing the staging directory", kept)
    error = attempt(lambda: _write_rank(stage_dir, rank, world, _fragments(engine, strategy, exclude, rank)))
    _agree_or_clean(group, error, f"{what}, writing the rank files", kept, stage_dir if rank == 0 else None)
    error = (
        attempt(lambda: commit_tag(save_dir, stage_dir, tag, world, meta, save_latest)) if rank == 0 else None
    )
    _agree_or_clean(group, error, f"{what}, committing", kept, stage_dir if rank == 0 else None)
    return True


def _prepare_staging(save_dir: str, stage_dir: str) -> None:
    os.makedirs(save_dir, exist_ok=True)
    shutil.rmtree(stage_dir, ignore_errors=True)  # leftovers of a crashed save of this tag
    os.makedirs(stage_dir)


def _fragments(engine: Any, strategy: Any, exclude: bool, rank: int) -> list[Fragment]:
    """This rank's fragments: the strategy's (expert parameters under their global names,
    see [Note: expert fragments]) and, on rank 0, the module's buffers."""
    fragments = strategy.checkpoint_fragments(exclude_frozen_parameters=exclude)
    renamed = global_expert_names(engine.module)
    if renamed:
        fragments = [dataclasses.replace(f, name=renamed.get(f.name, f.name)) for f in fragments]
    if rank == 0:
        fragments = fragments + buffer_fragments(engine.module)
    return fragments


def _agree_or_clean(
    group: Any, error: BaseException | None, what: str, kept: str, stage_dir: str | None
) -> None:
    """The outcome agreement; when it fails rank 0 (``stage_dir`` given) removes the staging
    directory, now that no rank writes into it (a rank that ended instead leaves it to the next
    save, as a kill -9 does: See [Note: collective save outcome])."""
    try:
        outcome.agree(group, error, what, kept)
    except BaseException as exc:
        if stage_dir is not None and outcome.all_done_writing(exc, error) and os.path.isdir(stage_dir):
            shutil.rmtree(stage_dir, ignore_errors=True)
        raise
