"""Two stage-3 engines in one process own their state: trained interleaved, each equals its own
single-engine run and plain PyTorch, and one dropped leaves nothing of itself behind.

See [Note: stage 3 parameter records] (``zero_core/zero/stage3/param_records.py``) and
[Note: parameter owners] (``zero_core/zero/param_owners.py``): the strategy (and ``zero.Init``
until ``initialize``) owns its records; a parameter reaches them through an attribute; no
module holds a process-wide table of per-parameter state. The set-up is an RLHF run's: a policy
(built under ``zero.Init``) and a reference model (partitioned by ``initialize``), stepped in
turn in one process.
"""

from __future__ import annotations

import collections
import gc
import importlib
import pkgutil
import types
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary
from zero_core.testing import run_multirank

MICRO = 4
LR = 0.1  # SGD with momentum: Adam would turn summation-order noise of zero gradients into steps
STEPS_TOGETHER = 3  # both engines, interleaved
STEPS_AFTER = 2  # the policy alone, after the reference engine was dropped


def _policy() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def _reference() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 3))


def _batch(which: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * which + 100 * step + rank)
    return torch.randn(MICRO, 8, generator=g), torch.randn(MICRO, 3, generator=g)


def _plain(build, which: int, steps: int, world: int) -> list[torch.Tensor]:  # noqa: ANN001
    """Plain single-process PyTorch over every rank's batch of each step."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for s in range(steps):
        xs, ys = zip(*(_batch(which, s, r) for r in range(world)))
        loss = (model(torch.cat(xs)) - torch.cat(ys)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _engine(model: nn.Module):  # noqa: ANN202
    import zero_core

    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10**6,
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": 3,
            "param_persistence_threshold": 0,
            "reduce_bucket_size": 64,
            "prefetch_bucket_size": 64,
        },
    }
    return zero_core.initialize(
        model=model, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9), config=cfg
    )[0]


def _build(which: int):  # noqa: ANN202
    """The policy under zero.Init (its records handed over at initialize), the reference not."""
    import zero_core

    if which == 0:
        init = zero_core.Init()
        with init:
            model = _policy()
        engine = _engine(model)
        assert not init.records, "zero.Init kept records an engine took"
        return engine, model
    model = _reference()
    return _engine(model), model


def _step(engine, which: int, step: int) -> None:  # noqa: ANN001
    from zero_core import comm

    x, y = _batch(which, step, comm.get_rank())
    loss = (engine(x) - y).pow(2).mean()
    engine.backward(loss)
    engine.step()


def _full(model: nn.Module) -> list[torch.Tensor]:
    from zero_core.zero.stage3 import GatheredParameters

    params = list(model.parameters())
    with GatheredParameters(params):
        return [p.detach().clone() for p in params]


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [t.shape for t in a] == [t.shape for t in b]
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)) for x, y in zip(a, b))


def _alone(which: int, steps: int) -> list[torch.Tensor]:
    engine, model = _build(which)
    for s in range(steps):
        _step(engine, which, s)
    out = _full(model)
    engine.destroy()
    return out


def _gone(refs: dict[str, list[weakref.ref]]) -> dict[str, int]:
    gc.collect()
    return {k: sum(r() is not None for r in v) for k, v in refs.items()}


def _two_engines() -> dict:
    from zero_core import comm
    from zero_core.zero.stage3.param_records import partition_state
    from zero_core.zero.stage3.runtime_context import stage3_context

    world = comm.get_world_size()
    single = {0: _alone(0, STEPS_TOGETHER + STEPS_AFTER), 1: _alone(1, STEPS_TOGETHER)}
    policy, policy_model = _build(0)
    ref, ref_model = _build(1)
    for s in range(STEPS_TOGETHER):
        _step(policy, 0, s)
        _step(ref, 1, s)
    ref_full = _full(ref_model)
    ctx = stage3_context()
    res = {
        "owners": [
            all(partition_state(p).owner_of() is e.strategy for p in m.parameters())
            for e, m in ((policy, policy_model), (ref, ref_model))
        ],
        "disjoint": not {id(st) for st in policy.strategy.records} & {id(st) for st in ref.strategy.records},
        "process_stacks_empty": ctx.active_hooks == [] and ctx.on_access_outside_forward == [],
        "ref_vs_single": _rel(ref_full, single[1]),
        "ref_vs_plain": _rel(ref_full, _plain(_reference, 1, STEPS_TOGETHER, world)),
    }
    params = list(ref_model.parameters())
    refs = {
        "engine": [weakref.ref(ref)],
        "strategy": [weakref.ref(ref.strategy)],
        "optimizer": [weakref.ref(ref.optimizer)],
        "model": [weakref.ref(ref_model)],
        "params": [weakref.ref(p) for p in params],
        "records": [weakref.ref(partition_state(p)) for p in params],
    }
    del ref, ref_model, params  # dropped as a user drops one, without destroy()
    res["alive_after_drop"] = _gone(refs)
    for s in range(STEPS_TOGETHER, STEPS_TOGETHER + STEPS_AFTER):
        _step(policy, 0, s)
    policy_full = _full(policy_model)
    res["policy_vs_single"] = _rel(policy_full, single[0])
    res["policy_vs_plain"] = _rel(policy_full, _plain(_policy, 0, STEPS_TOGETHER + STEPS_AFTER, world))
    keep = {
        "strategy": [weakref.ref(policy.strategy)],
        "records": [weakref.ref(st) for st in policy.strategy.records],
    }
    policy.destroy()
    del policy, policy_model
    res["policy_alive_after_destroy"] = _gone(keep)
    return res


@pytest.mark.parametrize("world", [1, 2])
def test_two_stage3_engines_train_interleaved_and_one_dropped_leaves_nothing(world: int) -> None:
    for rank, r in enumerate(run_multirank(_two_engines, world, timeout=300)):
        where = (world, rank)
        assert r["owners"] == [True, True] and r["disjoint"], (where, r)
        assert r["process_stacks_empty"], where
        for key in ("ref_vs_single", "ref_vs_plain", "policy_vs_single", "policy_vs_plain"):
            assert r[key] <= 1e-5, (where, key, r[key])
        assert r["alive_after_drop"] == dict.fromkeys(r["alive_after_drop"], 0), (
            where,
            r["alive_after_drop"],
        )
        assert r["policy_alive_after_destroy"] == {"strategy": 0, "records": 0}, (where, r)


# -- structure: no module-level table of per-parameter state --------------------------------------

_MUTABLE = (
    dict,
    list,
    set,
    bytearray,
    collections.deque,
    weakref.WeakKeyDictionary,
    weakref.WeakValueDictionary,
    weakref.WeakSet,
    WeakIdKeyDictionary,
)

# The module-level mutable containers zero_core.zero may hold, none of them per-parameter:
ALLOWED = {
    # the names of the collective kinds in agreement headers: a constant table, never written
    "zero_core.zero.stage3.collective_agreement.KINDS",
    # the process's stack of forward runtimes (weak references; empty between forwards) and the
    # gather-on-access callbacks of open zero.Init contexts: See [Note: stage 3 runtime context]
    "zero_core.zero.stage3.runtime_context._CONTEXT.active_hooks",
    "zero_core.zero.stage3.runtime_context._CONTEXT.on_access_outside_forward",
}


def _module_level_containers() -> set[str]:
    """Every mutable container held by a module of ``zero_core.zero`` at module level, directly
    or as an attribute of a module-level object of the project (a singleton like ``_CONTEXT``)."""
    import zero_core.zero

    found = set()
    for info in pkgutil.walk_packages(zero_core.zero.__path__, "zero_core.zero."):
        mod = importlib.import_module(info.name)
        for name, value in vars(mod).items():
            if name.startswith("__") or isinstance(value, (types.ModuleType, type, types.FunctionType)):
                continue
            if isinstance(value, _MUTABLE):
                found.add(f"{info.name}.{name}")
            elif type(value).__module__.startswith("zero_core"):
                slots = getattr(type(value), "__slots__", ())
                attrs = dict(getattr(value, "__dict__", {}))
                attrs.update((s, getattr(value, s)) for s in slots if hasattr(value, s))
                found.update(f"{info.name}.{name}.{a}" for a, x in attrs.items() if isinstance(x, _MUTABLE))
    return found


def test_no_module_holds_a_table_of_per_parameter_state() -> None:
    found = _module_level_containers()
    assert "zero_core.zero.stage3.collective_agreement.KINDS" in found  # the scan sees dict constants
    assert found == ALLOWED, (
        f"new module-level mutable state: {sorted(found - ALLOWED)} (per-parameter state belongs to "
        "its owner: See [Note: stage 3 parameter records]); gone from the allow-list: "
        f"{sorted(ALLOWED - found)}"
    )
    from zero_core.zero.stage3 import param_records, runtime_context

    # the tables this replaced stay gone
    for gone in ("PARTITION_RECORDS", "RECORDS_BY_ID", "PartitionRecords"):
        assert not hasattr(param_records, gone), gone
    ctx = runtime_context.stage3_context()
    assert not hasattr(ctx, "records") and not hasattr(ctx, "param_names")
