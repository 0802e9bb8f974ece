"""The root record of a checkpoint (``checkpoint.json`` and its pipe/MoE peers): sealed and range-checked.

[Note: sealed metadata]
Every file of a checkpoint is checksummed by the record that names it, but the root record
names itself: nothing caught an edited learning rate, step counter or a negative loss scale
in ``checkpoint.json`` (issue 25, item 8). So the root record carries its own checksum,
``"seal"``: the CRC-32C of the record serialised by ``format.dumps`` without the ``seal`` key
(``dumps`` sorts keys and round-trips every value exactly, so the reader recomputes it from
what it parsed). A record whose content no longer matches its seal is refused, naming the
file. The seal guards against corruption and hand edits, not against someone who recomputes
it. The values are then range-checked (:func:`check_engine_meta`), so even a record that was
resealed cannot make the engine load a negative loss scale, a non-finite learning rate or a
world size that disagrees with the rank files it lists. Records of format 1-2 have no seal
and load as before (range checks still apply). The standalone ``zero_to_fp32.py`` checks the
seal with its own copy of this rule.
"""

from __future__ import annotations

import math
from typing import Any

import crc32c

from zero_core.checkpoint.format import CheckpointError, dumps, read_json

SEAL_KEY = "seal"


def _seal_of(meta: dict[str, Any]) -> int:
    return crc32c.crc32c(dumps({k: v for k, v in meta.items() if k != SEAL_KEY}))


def sealed_bytes(meta: dict[str, Any]) -> bytes:
    """``meta`` serialised with its seal (see [Note: sealed metadata])."""
    return dumps({**meta, SEAL_KEY: _seal_of(meta)})


def read_sealed(path: str, *, required: bool) -> dict[str, Any]:
    """The record at ``path`` after checking its seal; a missing seal is an error when ``required``."""
    return check_seal(read_json(path), path, required=required)


def check_seal(meta: Any, path: str, *, required: bool) -> dict[str, Any]:
    """``meta`` (parsed from ``path``) if its seal matches; see :func:`read_sealed`."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is not a checkpoint record (a JSON object)")
    if SEAL_KEY not in meta:
        if required:
            raise CheckpointError(f"{path} has no seal (its checksum): it was truncated or edited")
        return meta
    if meta[SEAL_KEY] != _seal_of(meta):
        raise CheckpointError(
            f"{path} fails its checksum (seal): it is corrupted or was edited by hand; restore it, or load "
            "another tag"
        )
    return meta


def _fail(where: str, key: str, value: Any, allowed: str) -> CheckpointError:
    return CheckpointError(f"{where}: {key} is {value!r}, expected {allowed} (corrupted or edited record)")


def check_int(meta: dict[str, Any], key: str, where: str, lo: int = 0, hi: int | None = None) -> int:
    """``meta[key]`` as an int in ``[lo, hi]``; an error naming the key otherwise."""
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise _fail(where, key, v, f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""))
    return v


def check_number(value: Any, key: str, where: str, *, positive: bool = False) -> None:
    """A finite real number, > 0 with ``positive`` and >= 0 otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise _fail(where, key, value, "a finite number " + ("> 0" if positive else ">= 0"))


def check_hyperparameters(groups: Any, where: str) -> None:
    """Saved optimizer param groups: a list of objects with finite, non-negative lr, eps > 0, betas in [0, 1)."""
    if not isinstance(groups, list):
        raise _fail(where, "optimizer.param_groups", groups, "a list")
    for i, g in enumerate(groups):
        if not isinstance(g, dict):
            raise _fail(where, f"optimizer.param_groups[{i}]", g, "an object")
        for k in ("lr", "weight_decay", "momentum", "initial_lr"):
            if k in g:
                check_number(g[k], f"optimizer.param_groups[{i}].{k}", where)
        if "eps" in g:
            check_number(g["eps"], f"optimizer.param_groups[{i}].eps", where, positive=True)
        betas = g.get("betas")
        if betas is not None and (
            not isinstance(betas, list) or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)
        ):
            raise _fail(where, f"optimizer.param_groups[{i}].betas", betas, "numbers in [0, 1)")


def check_loss_scaler(state: Any, where: str) -> None:
    """The saved loss-scaler state: a positive finite scale and non-negative counters."""
    if not isinstance(state, dict):
        raise _fail(where, "loss_scaler", state, "an object")
    check_number(state.get("cur_scale"), "loss_scaler.cur_scale", where, positive=True)
    for k in ("cur_iter", "overflows", "cur_hysteresis"):
        if k in state:
            check_int(state, k, f"{where}: loss_scaler")
    if "last_overflow_iter" in state:
        check_int(state, "last_overflow_iter", f"{where}: loss_scaler", lo=-1)


def check_engine_meta(meta: dict[str, Any], where: str) -> None:
    """Range-check the engine state in a ``checkpoint.json`` (see [Note: sealed metadata])."""
    check_int(meta, "world_size", where, lo=1)
    check_int(meta, "zero_stage", where, lo=0, hi=3)
    for k in ("global_steps", "global_samples", "skipped_steps", "micro_steps"):
        check_int(meta, k, where)
    if meta["skipped_steps"] > meta["global_steps"]:
        raise _fail(
            where, "skipped_steps", meta["skipped_steps"], f"at most global_steps ({meta['global_steps']})"
        )
    check_loss_scaler(meta.get("loss_scaler"), where)
    optimizer = meta.get("optimizer")
    if not isinstance(optimizer, dict):
        raise _fail(where, "optimizer", optimizer, "an object")
    check_hyperparameters(optimizer.get("param_groups"), where)
    sched = meta.get("lr_scheduler")
    if isinstance(sched, dict):
        for k in ("base_lrs", "_last_lr"):
            for i, v in enumerate(sched.get(k) or []):
                check_number(v, f"lr_scheduler.{k}[{i}]", where)
    if not isinstance(meta.get("files"), dict):
        raise _fail(where, "files", meta.get("files"), "an object naming every rank file")
