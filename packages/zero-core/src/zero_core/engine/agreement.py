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

[Note: one-sided calls]
``save_checkpoint`` or ``load_checkpoint`` called on some ranks while the others train on used
to be found only at the watchdog's timeout, and by the peer as "no record: not started or dead"
or "a backend or network failure?". Both start with the store-based meeting above
(``load_checkpoint`` agrees on the tag it resolved, so ranks whose ``latest`` files differ are
named too). While a rank waits there it looks, once a second, at the ranks that have not come:
one that recorded a failure (see [Note: failed ranks]) is named with its error
(``PeerFailedError``), and one that waits in a collective with this rank that this rank never
issued (its watchdog publishes which, see ``comm/peer_state.py``) is training on or on another
code path: :class:`RankMismatchError` names it and that collective at once. A rank that is just
slower (computing, or in a collective among other ranks) is waited for until the collective
timeout. A call that fails withdraws itself, so the ranks' next calls still pair up; if the
caller goes on training, its peers, which never left their collective, meet it there.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from zero_core import comm
from zero_core.checkpoint.format import CheckpointError
from zero_core.checkpoint.tag_validation import parse_mode
from zero_core.comm import failures, peer_state
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

    what = "save_checkpoint"
    key = "zero_save"
    # Engines are built in the same order on every rank: the n-th engine's keys are its own.
    _instances = itertools.count()

    def __init__(self) -> None:
        self.calls = 0
        self.instance = next(SaveAgreement._instances)

    def agree(self, tag: str, mode: str, group: dist.ProcessGroup | None) -> str:
        """Wait (bounded) until every rank of ``group`` called ``save_checkpoint``; returns the tag to use.

        ``mode`` is ``checkpoint.tag_validation``: See [Note: checkpoint tag agreement]."""
        mode = parse_mode(mode)
        tags = self.meet(tag, group)
        if tags is None or len(set(tags)) == 1:
            return tag
        ranks = comm.group_ranks(group)
        msg = f"save_checkpoint: ranks passed different tags: {_by_value(tags, ranks)}"
        if mode == "fail":
            raise TagMismatchError(msg + ' (checkpoint.tag_validation is "Fail")')
        if mode == "warn":
            warnings.warn(f"{msg}; saving under rank {ranks[0]}'s tag {tags[0]!r}", stacklevel=3)
        return tags[0]

    def meet(self, value: str, group: Any) -> list[str] | None:
        """Publish this rank's ``value`` for this call and wait for every rank's (see [Note:
        one-sided calls]); their values in group order, or None without a group to meet."""
        store = _store()
        if store is None or not comm.is_initialized() or comm.get_world_size(group) == 1:
            return None
        self.calls += 1
        ranks, me = comm.group_ranks(group), comm.get_rank()
        wd = _watchdog.get_watchdog()
        if wd is not None:
            wd.note(f"{self.what} call #{self.calls} (tag {value!r})")
        key = f"{self.key}/{_group_key(ranks)}/{self.instance}/{self.calls}"
        store.set(f"{key}/{me}", value)
        keys = [f"{key}/{r}" for r in ranks]
        try:
            self._wait(store, keys, ranks, me, value)
        except BaseException:
            # withdraw this call, so that the next call of every rank has the same number
            self.calls -= 1
            with contextlib.suppress(Exception):
                store.delete_key(f"{key}/{me}")
            raise
        return [store.get(k).decode() for k in keys]

    def _wait(self, store: Any, keys: list[str], ranks: tuple[int, ...], me: int, value: str) -> None:
        """Until every key is set; raises early for a rank that failed or waits in a collective."""
        timeout = _watchdog.collective_timeout()
        deadline = time.monotonic() + timeout
        pause, next_look = 0.005, time.monotonic() + 1.0
        while not store.check(keys):
            now = time.monotonic()
            if now < next_look and now < deadline:
                time.sleep(pause)
                pause = min(2 * pause, 0.1)
                continue
            next_look = now + 1.0
            absent = [r for r, k in zip(ranks, keys) if not store.check([k])]
            self._look_at(store, absent, me, value)
            if now >= deadline:
                raise RankMismatchError(
                    f"{self.what}: rank(s) {absent} did not call {self.what} within {timeout:g} s "
                    f"({self._mine(me, value)}); {self.what} is collective: call it on every rank of the "
                    "data-parallel group"
                ) from None

    def _mine(self, me: int, value: str) -> str:
        return f"rank {me} called it with tag {value!r}, its call #{self.calls}"

    def _look_at(self, store: Any, absent: list[int], me: int, value: str) -> None:
        """Raise when an absent rank failed (see [Note: failed ranks]) or waits in a collective
        with this rank (it is training on, or on another code path)."""
        failed = failures.root_failure(list(failures.read_ranks(store, absent).values()))
        if failed is not None:
            raise _watchdog.PeerFailedError(
                f"{self.what}: rank {failed.rank} will not call {self.what}: {failed.describe()}",
                failed.cause if failed.cause is not None else failed.rank,
            )
        wd = _watchdog.get_watchdog()
        waiting = peer_state.waiting_on(store, me, wd.issued() if wd is not None else {}, absent)
        if waiting:
            others = sorted({w[0] for w in waiting})
            raise RankMismatchError(
                f"{self.what}: rank(s) {others} did not call {self.what} ({self._mine(me, value)}): "
                f"{peer_state.describe_waiting(waiting)}, which this rank never issued; {self.what} is "
                "collective: call it on every rank of the data-parallel group"
            )


class LoadAgreement(SaveAgreement):
    """The same check for ``load_checkpoint``: every rank calls it and resolves the same tag."""

    what = "load_checkpoint"
    key = "zero_load"

    def agree_tag(self, tag: str | None, group: Any) -> None:
        """Raise :class:`RankMismatchError` on every rank unless all resolved the same tag."""
        tags = self.meet("" if tag is None else tag, group)
        if tags is None or len(set(tags)) == 1:
            return
        shown = [t or "(no tag: no 'latest' file)" for t in tags]
        raise RankMismatchError(
            f"load_checkpoint: ranks would load different tags: {_by_value(shown, comm.group_ranks(group))} "
            "(their 'latest' files differ, or they passed different tags)"
        )


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:
        return None


def _group_key(ranks: tuple[int, ...]) -> str:
    return ",".join(map(str, ranks))
