"""Counting executed operators and attributing them to the modules that ran them.

[Note: attribution by executed operator]
FLOPs are counted by a ``TorchDispatchMode`` that sees every ATen operator after autograd and
Python-level decomposition, so ``F.linear``, ``x @ w``, ``torch.einsum`` and SDPA inside a module's
``forward`` are counted no matter how they were spelled, and nothing that did not execute is
counted (unlike patching ``torch.nn.functional``, which misses ``@`` and tensor methods).

Attribution is inclusive: while a module's ``forward`` runs it sits on ``fwd_stack``, and every
counted operator is added to every module on the stack, so a parent's count is its children's
plus its own functional calls. Totals are kept separately from per-module counts, so a module
called twice is counted twice (the work ran twice) while a shared parameter is counted once.

Each operator falls in one phase:

* forward: a module is on ``fwd_stack`` and autograd is not executing a node;
* recompute: autograd is executing a node *and* a module forward runs (activation
  checkpointing replays the forward inside backward);
* backward: autograd is executing a node and some module is in ``bwd_active``;
* outside: anything else (loss functions, optimizer steps, data preparation). Not part of
  the model's totals.

Backward attribution follows the hooks ``torch.utils.module_tracker`` uses: a module becomes
active when the gradient of any of its outputs is computed and inactive when the gradient of
any of its inputs is. A module whose inputs need no gradient (the first embedding) never gets
the second signal, so when a module enters backward, active modules that are not its
forward-time ancestors are retired: backward of a sequential model runs one module at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zero_profiler.flop_formulas import FORMULAS

_current_autograd_node = torch._C._current_autograd_node


@dataclass
class ModuleStats:
    """Counters of one module, accumulated over every call while profiling."""

    fwd_flops: int = 0
    fwd_macs: int = 0
    bwd_flops: int = 0
    bwd_macs: int = 0
    recompute_flops: int = 0
    recompute_macs: int = 0
    fwd_duration: float = 0.0  # seconds, summed over forward calls (replays excluded)
    calls: int = 0


@dataclass
class Totals:
    """Whole-model counters; ``outside_*`` is work seen while profiling but not in the model."""

    fwd_flops: int = 0
    fwd_macs: int = 0
    bwd_flops: int = 0
    bwd_macs: int = 0
    recompute_flops: int = 0
    recompute_macs: int = 0
    outside_flops: int = 0
    outside_macs: int = 0
    bwd_first_op: float | None = None
    bwd_last_op: float | None = None
    # FLOPs per ATen overload packet, over every phase (outside included).
    by_op: dict[Any, int] = field(default_factory=dict)


class _CountingMode(TorchDispatchMode):
    """Runs each operator, then hands its cost to the tracker. See [Note: attribution by executed operator]."""

    def __init__(self, tracker: ModuleTracker) -> None:
        super().__init__()
        self._tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tracker = self._tracker
        if tracker.track_backward and _current_autograd_node() is not None:
            now = time.perf_counter()
            totals = tracker.totals
            if totals.bwd_first_op is None:
                totals.bwd_first_op = now
            totals.bwd_last_op = now
        formula = FORMULAS.get(func.overloadpacket)
        if formula is not None:
            flops, macs = formula(args, kwargs, out)
            if flops or macs:
                tracker.record(int(flops), int(macs), func.overloadpacket)
        return out


class ModuleTracker:
    """Hooks on every module of ``model`` plus the dispatch mode that counts operators."""

    def __init__(self, model: torch.nn.Module, ignore_types: tuple[type, ...] = (), track_backward=False):
        self.model = model
        self.ignore_types = ignore_types
        self.track_backward = track_backward
        self.stats: dict[torch.nn.Module, ModuleStats] = {}
        self.totals = Totals()
        self.fwd_stack: list[torch.nn.Module] = []
        self.bwd_active: dict[torch.nn.Module, frozenset[int]] = {}
        self._starts: list[tuple[float, bool]] = []
        self._suppress = 0
        self._handles: list[Any] = []
        self._mode: _CountingMode | None = None
        self.reset()

    # -- lifecycle --------------------------------------------------------------------------------

    def reset(self) -> None:
        self.stats = {m: ModuleStats() for m in self.model.modules()}
        self.totals = Totals()
        self.bwd_active = {}

    def attach_hooks(self) -> None:
        if self._handles:
            return
        for module in self.model.modules():
            if self.ignore_types and isinstance(module, self.ignore_types):
                self._handles.append(module.register_forward_pre_hook(self._ignored_pre))
                self._handles.append(module.register_forward_hook(self._ignored_post, always_call=True))
            else:
                self._handles.append(module.register_forward_pre_hook(self._pre))
                # always_call: a forward that raises (non-reentrant checkpointing stops its
                # replay early by raising) must still leave the stack.
                self._handles.append(module.register_forward_hook(self._post, always_call=True))

    def detach_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def start_counting(self) -> None:
        if self._mode is None:
            self._mode = _CountingMode(self)
            self._mode.__enter__()
            # The first operator dispatched to a Python mode in a process pays a one-time setup
            # cost (~1 s); pay it here, outside any module, so it is not billed as latency.
            torch.zeros(1).add_(1)

    def stop_counting(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    @property
    def counting(self) -> bool:
        return self._mode is not None

    # -- recording --------------------------------------------------------------------------------

    def record(self, flops: int, macs: int, packet: Any = None) -> None:
        if self._suppress:
            return
        totals = self.totals
        totals.by_op[packet] = totals.by_op.get(packet, 0) + flops
        in_backward = _current_autograd_node() is not None
        if in_backward and self.fwd_stack:
            totals.recompute_flops += flops
            totals.recompute_macs += macs
            for module in self.fwd_stack:
                s = self.stats[module]
                s.recompute_flops += flops
                s.recompute_macs += macs
        elif in_backward and self.bwd_active:
            totals.bwd_flops += flops
            totals.bwd_macs += macs
            for module in self.bwd_active:
                s = self.stats[module]
                s.bwd_flops += flops
                s.bwd_macs += macs
        elif not in_backward and self.fwd_stack:
            totals.fwd_flops += flops
            totals.fwd_macs += macs
            for module in self.fwd_stack:
                s = self.stats[module]
                s.fwd_flops += flops
                s.fwd_macs += macs
        else:
            totals.outside_flops += flops
            totals.outside_macs += macs

    # -- forward hooks ----------------------------------------------------------------------------

    def _ignored_pre(self, module, args):
        self._suppress += 1

    def _ignored_post(self, module, args, output):
        self._suppress -= 1

    def _pre(self, module, args):
        if module not in self.stats:  # a module added to the model after profiling started
            self.stats[module] = ModuleStats()
        self.fwd_stack.append(module)
        replay = _current_autograd_node() is not None
        self._starts.append((time.perf_counter(), replay))
        if self.track_backward and not replay and torch.is_grad_enabled():
            inputs = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad]
            if inputs:
                register_multi_grad_hook(inputs, lambda _g, m=module: self._bwd_end(m), mode="any")

    def _post(self, module, args, output):
        start, replay = self._starts.pop()
        self.fwd_stack.pop()
        if replay:
            return
        stats = self.stats[module]
        stats.fwd_duration += time.perf_counter() - start
        stats.calls += 1
        if self.track_backward and torch.is_grad_enabled():
            outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                ancestors = frozenset(id(m) for m in self.fwd_stack) | {id(module)}
                register_multi_grad_hook(
                    outputs, lambda _g, m=module, a=ancestors: self._bwd_begin(m, a), mode="any"
                )

    # -- backward hooks ---------------------------------------------------------------------------

    def _bwd_begin(self, module: torch.nn.Module, ancestors: frozenset[int]) -> None:
        # Retire modules that cannot still be running: neither forward-time ancestors nor
        # descendants of this one (a parent and its last child share an output).
        for other in [
            m for m, anc in self.bwd_active.items() if id(m) not in ancestors and id(module) not in anc
        ]:
            del self.bwd_active[other]
        self.bwd_active[module] = ancestors

    def _bwd_end(self, module: torch.nn.Module) -> None:
        self.bwd_active.pop(module, None)
