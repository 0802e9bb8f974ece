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
* backward: autograd is executing a node that a module's forward created (modules whose
  forward is listed in ``ignore_list`` drop it);
* outside: anything else (loss functions, optimizer steps, data preparation). Not part of
  the model's totals.

Backward work is credited to the module whose forward created the autograd node that is
running: see [Note: exact backward attribution] in :mod:`zero_profiler.autograd_attribution`.

[Note: dispatch fast path]
Every ATen operator of the profiled run goes through ``_CountingMode.__torch_dispatch__``, so
its Python cost is the profiler's overhead. The formula of each ``OpOverload`` is looked up
once and cached together with the callable behind it (``OpOverload._op``, one Python frame
less per operator); operators without a formula (most of a forward: views, copies) return right
after running, and only counted operators touch the tracker.

TorchDispatchMode wraps ``__torch_dispatch__`` in ``torch._disable_dynamo`` so that Dynamo never
traces into a mode; the wrapper costs about 2.5 us per operator here. When nothing has been
compiled in the process (``torch._dynamo`` counts no compiled frame) when profiling starts, the
profiler uses the unwrapped mode; otherwise ``_DynamoSafeCountingMode``, the wrapped one. A
model first compiled while profiling is still counted exactly: Dynamo breaks the graph at the
mode and runs it eagerly (test_compiled_module_is_counted covers both cases).
Measured by ``tools/bench/bench_profiler.py`` ("tiny" rows: per-operator cost dominates).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zero_profiler.autograd_attribution import IGNORED, GraphClaims
from zero_profiler.flop_formulas import FORMULAS

_current_autograd_node = torch._C._current_autograd_node
_WARMED_UP: list[bool] = []  # non-empty once a counting mode has dispatched an operator


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
    # FLOPs per ATen overload packet, over every phase (outside included, ignored modules not).
    by_op: dict[Any, int] = field(default_factory=dict)


class _CountingMode(TorchDispatchMode):
    """Runs each operator, then hands its cost to the tracker.

    See [Note: attribution by executed operator] and [Note: dispatch fast path].
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # No torch._disable_dynamo wrapper (about 2.5 us per operator): see [Note: dispatch fast path].
        return False

    def __init__(self, tracker: ModuleTracker) -> None:
        super().__init__()
        self._tracker = tracker
        self._time_backward = tracker.track_backward
        # OpOverload -> (callable, formula or None, overload packet)
        self._ops: dict[Any, tuple[Any, Any, Any]] = {}

    def _describe(self, func: Any) -> tuple[Any, Any, Any]:
        packet = func.overloadpacket
        # OpOverload.__call__ only forwards to ._op; calling it directly saves a Python frame.
        call = getattr(func, "_op", func)
        entry = self._ops[func] = (call, FORMULAS.get(packet), packet)
        return entry

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        entry = self._ops.get(func)
        if entry is None:
            entry = self._describe(func)
        call, formula, packet = entry
        out = call(*args, **kwargs) if kwargs else call(*args)
        if self._time_backward and _current_autograd_node() is not None:
            self._tracker.mark_backward_op()
        if formula is None:
            return out
        flops, macs = formula(args, kwargs or {}, out)
        if flops or macs:
            self._tracker.record(int(flops), int(macs), packet)
        return out


class _DynamoSafeCountingMode(_CountingMode):
    """The same mode behind TorchDispatchMode's default ``torch._disable_dynamo`` wrapper."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return True

    __torch_dispatch__ = _CountingMode.__torch_dispatch__  # wrapped by __init_subclass__


def _dynamo_has_compiled() -> bool:
    """Whether torch.compile has compiled any frame in this process (without importing dynamo)."""
    if "torch._dynamo" not in sys.modules:
        return False
    counters = sys.modules["torch._dynamo"].utils.counters
    return counters.get("frames", {}).get("total", 0) > 0


class ModuleTracker:
    """Hooks on every module of ``model`` plus the dispatch mode that counts operators."""

    def __init__(self, model: torch.nn.Module, ignore_types: tuple[type, ...] = (), track_backward=False):
        self.model = model
        self.ignore_types = ignore_types
        self.track_backward = track_backward
        self.stats: dict[torch.nn.Module, ModuleStats] = {}
        self.totals = Totals()
        self.fwd_stack: list[torch.nn.Module] = []
        self.claims = GraphClaims()
        self._starts: list[tuple[float, bool]] = []
        self._suppress = 0
        self._handles: list[Any] = []
        self._mode: _CountingMode | None = None
        self.reset()

    # -- lifecycle --------------------------------------------------------------------------------

    def reset(self) -> None:
        self.stats = {m: ModuleStats() for m in self.model.modules()}
        self.totals = Totals()
        self.claims.clear()

    def attach_hooks(self) -> None:
        if self._handles:
            return
        for module in self.model.modules():
            if self.ignore_types and isinstance(module, self.ignore_types):
                pre, post = self._ignored_pre, self._ignored_post
            else:
                pre, post = self._pre, self._post
            self._handles.append(module.register_forward_pre_hook(pre))
            # always_call: a forward that raises (non-reentrant checkpointing stops its replay
            # early by raising) must still leave the stack.
            self._handles.append(module.register_forward_hook(post, always_call=True))

    def detach_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def start_counting(self) -> None:
        if self._mode is None:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    "FlopsProfiler: start_profile was called inside torch.compile; profile the model "
                    "outside the compiled region"
                )
            mode_cls = _DynamoSafeCountingMode if _dynamo_has_compiled() else _CountingMode
            self._mode = mode_cls(self)
            self._mode.__enter__()
            if not _WARMED_UP:
                # The first operator dispatched to a Python mode in a process pays a one-time
                # setup cost (~1 s); pay it here, outside any module, so it is not billed as latency.
                torch.zeros(1).add_(1)
                _WARMED_UP.append(True)

    def stop_counting(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    @property
    def counting(self) -> bool:
        return self._mode is not None

    # -- recording --------------------------------------------------------------------------------

    def mark_backward_op(self) -> None:
        now = time.perf_counter()
        totals = self.totals
        if totals.bwd_first_op is None:
            totals.bwd_first_op = now
        totals.bwd_last_op = now

    def record(self, flops: int, macs: int, packet: Any = None) -> None:
        """Credit one operator's cost to the current phase and modules."""
        if self._suppress:
            return
        totals = self.totals
        if _current_autograd_node() is None:
            if self.fwd_stack:
                totals.fwd_flops += flops
                totals.fwd_macs += macs
                for module in self.fwd_stack:
                    s = self.stats[module]
                    s.fwd_flops += flops
                    s.fwd_macs += macs
            else:
                totals.outside_flops += flops
                totals.outside_macs += macs
        elif self.fwd_stack:  # a forward replayed inside backward
            totals.recompute_flops += flops
            totals.recompute_macs += macs
            for module in self.fwd_stack:
                s = self.stats[module]
                s.recompute_flops += flops
                s.recompute_macs += macs
        else:
            stack = self.claims.stack_of_current_node()
            if stack is None:
                totals.outside_flops += flops
                totals.outside_macs += macs
            elif stack is IGNORED:
                return
            else:
                totals.bwd_flops += flops
                totals.bwd_macs += macs
                for module in stack:
                    s = self.stats[module]
                    s.bwd_flops += flops
                    s.bwd_macs += macs
        totals.by_op[packet] = totals.by_op.get(packet, 0) + flops

    # -- forward hooks ----------------------------------------------------------------------------

    def _ignored_pre(self, module, args):
        self._suppress += 1
        if self.track_backward:
            self.claims.enter()

    def _ignored_post(self, module, args, output):
        if self.track_backward:
            self.claims.exit(IGNORED)
        self._suppress -= 1

    def _pre(self, module, args):
        if module not in self.stats:  # a module added to the model after profiling started
            self.stats[module] = ModuleStats()
        self.fwd_stack.append(module)
        self._starts.append((time.perf_counter(), _current_autograd_node() is not None))
        if self.track_backward:
            self.claims.enter()

    def _post(self, module, args, output):
        start, replay = self._starts.pop()
        if self.track_backward:
            self.claims.exit(self._claim_stack(replay))
        self.fwd_stack.pop()
        if replay:
            return
        stats = self.stats[module]
        stats.fwd_duration += time.perf_counter() - start
        stats.calls += 1

    def _claim_stack(self, replay: bool) -> tuple:
        """The modules a call's backward is credited to: the forward stack, this module included."""
        if self._suppress:
            return IGNORED  # inside an ignored module
        stack = tuple(self.fwd_stack)
        if replay:
            # A forward replayed in backward (reentrant checkpointing backpropagates through the
            # replay): its ancestors are those of the node being run, not the (empty) stack.
            outer = self.claims.stack_of_current_node() or ()
            stack = outer + tuple(m for m in stack if m not in outer)
        return stack
