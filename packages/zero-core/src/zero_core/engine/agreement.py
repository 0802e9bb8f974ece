"""Rank agreement: what every rank must agree on, checked before it can hang or corrupt.

[Note: rank agreement]
Ranks that disagree on the training setup do not fail cleanly on their own: a different ZeRO
stage per rank hangs in ``initialize`` or backward (the ranks issue different collectives), a
different micro-batch size trains with unequal sample weights, a different accumulation,
precision or model ends in a gloo size-mismatch abort or a hang. ``initialize`` therefore
starts with one small all-gather (before any other collective of the engine, so every rank is
sure to issue it) of a digest per field: ZeRO stage, precision, micro-batch size, gradient
accumulation, train batch size, the parameters' names/shapes/dtypes and the hash of the whole
config. On a difference it raises :class:`RankMismatchError` naming the first field that
differs and each rank's value; the fields are ordered so that the most specific cause is named
(a different stage also changes the config's hash). The readable values travel only on that
error path (one ``all_gather_object``).

``save_checkpoint`` is collective too, and a rank that calls it alone (or with another tag)
used to abort or hang the job. Its check runs over the process group's store, not a
collective: a rank that is elsewhere (in its next training step's collective, or gone) cannot
be confused with a partner, and the wait is bounded by the collective timeout (see [Note:
collective watchdog]). Different tags follow DeepSpeed's ``checkpoint.tag_validation``:
``Fail`` raises naming the ranks and tags; ``Warn`` (the default) warns and ``Ignore`` stays
silent, and both save under group rank 0's tag, so the ranks still write one consistent
checkpoint instead of crashing in each other's staging directories.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zero_core import comm
from zero_core.checkpoint.format import CheckpointError
from zero_core.checkpoint.tag_validation import parse_mode
from zero_core.comm import watchdog as _watchdog
from zero_core.config import ZeroConfig
from zero_core.zero.stage3.param_records import full_shape


class RankMismatchError(RuntimeError):
    """Ranks disagree on something they must agree on; the message names the field and the ranks."""


class TagMismatchError(RankMismatchError, CheckpointError):
    """``save_checkpoint`` got different tags on different ranks under ``tag_validation: "Fail"``:
    a rank disagreement and a checkpoint error (what DeepSpeed users catch around a save)."""


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _precision(cfg: ZeroConfig) -> str:
    return "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"


def _param_lines(model: torch.nn.Module) -> list[str]:
    lines = []
    for name, p in model.named_parameters():
        shape = full_shape(p)  # stage-3 zero.Init keeps the full shape in the parameter's record
        lines.append(f"{name} {list(shape)} {str(p.dtype).replace('torch.', '')}")
    return lines


def _config_text(cfg: ZeroConfig) -> str:
    return json.dumps(cfg.model_dump(mode="json"), sort_keys=True, default=str)


def initialize_fields(cfg: ZeroConfig, model: torch.nn.Module, *, pipeline: bool) -> list[tuple[str, Any]]:
    """``[(field, value)]`` every rank must agree on at ``initialize``, most specific first."""
    return [
        ("zero_optimization.stage", int(cfg.zero_optimization.stage)),
        ("precision", _precision(cfg)),
        ("train_micro_batch_size_per_gpu", cfg.train_micro_batch_size_per_gpu),
        ("gradient_accumulation_steps", cfg.gradient_accumulation_steps),
        ("train_batch_size", cfg.train_batch_size),
        # pipeline stages hold different layers by design
        ("model parameters (names, shapes, dtypes)", [] if pipeline else _param_lines(model)),
        ("config", json.loads(_config_text(cfg))),
    ]


def _device() -> torch.device:
    from zero_core.accelerator import get_accelerator

    acc = get_accelerator()
    return acc.device(acc.current_device())


def check_agreement(fields: list[tuple[str, Any]], group: dist.ProcessGroup | None, where: str) -> None:
    """All-gather one digest per field; raise :class:`RankMismatchError` on the first that differs."""
    if not comm.is_initialized() or comm.get_world_size(group) == 1:
        return
    world = comm.get_world_size(group)
    texts = [json.dumps(v, sort_keys=True, default=str) for _, v in fields]
    mine = torch.tensor([_digest(t) for t in texts], dtype=torch.int64, device=_device())
    every = torch.empty(world * len(fields), dtype=torch.int64, device=_device())
    comm.all_gather_into_tensor(every, mine, group=group)
    rows = every.view(world, len(fields))
    if bool((rows == mine).all()):
        return
    values: list[Any] = [None] * world
    comm.all_gather_object(values, [v for _, v in fields], group=group)  # only on the error path
    ranks = comm.group_ranks(group)
    for i, (name, _) in enumerate(fields):
        if len({int(x) for x in rows[:, i].tolist()}) > 1:
            raise RankMismatchError(
                f"{where}: ranks disagree on {name}: {_describe([v[i] for v in values], ranks)}"
            )


def _describe(values: list[Any], ranks: tuple[int, ...]) -> str:
    """Each distinct value with its ranks; for lists and dicts, the first entry that differs."""
    if all(isinstance(v, list) for v in values):
        n = max(len(v) for v in values)
        for j in range(n):
            col = [v[j] if j < len(v) else "(none)" for v in values]
            if len(set(map(str, col))) > 1:
                return f"entry {j}: " + _by_value(col, ranks)
        return _by_value([f"{len(v)} entries" for v in values], ranks)
    if all(isinstance(v, dict) for v in values):
        for key in sorted(set().union(*values)):
            col = [json.dumps(v.get(key, "(absent)"), sort_keys=True) for v in values]
            if len(set(col)) > 1:
                return f"key {key!r}: " + _by_value(col, ranks)
    return _by_value(values, ranks)


def _by_value(values: list[Any], ranks: tuple[int, ...]) -> str:
    groups: dict[str, list[int]] = {}
    for r, v in zip(ranks, values):
        groups.setdefault(str(v), []).append(r)
    return "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {v}" for v, rs in groups.items()
    )


class SaveAgreement:
    """The store-based check of ``save_checkpoint``'s call and tag (see [Note: rank agreement])."""

    # Engines are built in the same order on every rank: the n-th engine's keys are its own.
    _instances = itertools.count()

    def __init__(self) -> None:
        self.calls = 0
        self.instance = next(SaveAgreement._instances)

    def agree(self, tag: str, mode: str, group: dist.ProcessGroup | None) -> str:
        """Wait (bounded) until every rank of ``group`` called ``save_checkpoint``; returns the tag to use.

        ``mode`` is ``checkpoint.tag_validation``: See [Note: checkpoint tag agreement]."""
        mode = parse_mode(mode)
        store = _store()
        if store is None or not comm.is_initialized() or comm.get_world_size(group) == 1:
            return tag
        self.calls += 1
        ranks = comm.group_ranks(group)
        me = comm.get_rank()
        wd = _watchdog.get_watchdog()
        if wd is not None:
            wd.note(f"save_checkpoint call #{self.calls} (tag {tag!r})")
        key = f"zero_save/{_group_key(ranks)}/{self.instance}/{self.calls}"
        store.set(f"{key}/{me}", tag)
        timeout = _watchdog.collective_timeout()
        keys = [f"{key}/{r}" for r in ranks]
        try:
            store.wait(keys, timedelta(seconds=timeout))
        except Exception:
            absent = [r for r in ranks if not _has(store, f"{key}/{r}")]
            raise RankMismatchError(
                f"save_checkpoint: rank(s) {absent} did not call save_checkpoint within {timeout:g} s "
                f"(rank {me} called it with tag {tag!r}, its call #{self.calls}); save_checkpoint is "
                "collective: call it on every rank of the data-parallel group"
            ) from None
        tags = [store.get(k).decode() for k in keys]
        if len(set(tags)) == 1:
            return tag
        msg = f"save_checkpoint: ranks passed different tags: {_by_value(tags, ranks)}"
        if mode == "fail":
            raise TagMismatchError(msg + ' (checkpoint.tag_validation is "Fail")')
        if mode == "warn":
            warnings.warn(f"{msg}; saving under rank {ranks[0]}'s tag {tags[0]!r}", stacklevel=3)
        return tags[0]


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:
        return None


def _has(store: dist.Store | None, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False


def _group_key(ranks: tuple[int, ...]) -> str:
    return ",".join(map(str, ranks))
