"""Counting executed operators and attributing them to the modules that ran them.

[Note: attribution by executed operator]
FLOPs are counted at the level of the ATen operators that execute, after autograd and
Python-level decomposition, so ``F.linear``, ``x @ w``, ``torch.einsum`` and SDPA inside a module's
``forward`` are counted no matter how they were spelled, and nothing that did not execute is
counted (unlike patching ``torch.nn.functional``, which misses ``@`` and tensor methods). A
``TorchDispatchMode`` (``_CountingMode``) sees every operator; by default most calls are counted
one level up, by a ``TorchFunctionMode`` whose rules give the same count as the operators the
function runs, and only calls without such a rule go through the dispatch mode: see [Note:
function-level fast path] in :mod:`zero_profiler.function_mode`.

Attribution is inclusive: while a module's ``forward`` runs it has a frame of counters on the
tracker's call stack (``_frames``); a counted operator is added to the innermost frame, and when
a call ends its frame is added to its module's counters and to the caller's frame, so a parent's
count is its children's plus its own functional calls (the same as adding every operator to
every module on the stack, at a constant cost per operator). Totals are kept separately from per-module counts,
so a module called twice is counted twice (the work ran twice) while a shared parameter is
counted once.

Each operator falls in one phase:

* forward: a module call is open (``_frames`` is not empty) and autograd is not executing a node;
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
profiler uses the unwrapped mode; otherwise ``_DynamoSafeCountingMode``, the wrapped one (also
as the ATen-level half of the fast path). A model compiled before or while profiling is still
counted exactly: see [Note: profiling compiled models] in :mod:`zero_profiler.dynamo_guard`.
Measured by ``tools/bench/bench_profiler.py`` ("tiny" rows: per-operator cost dominates).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zero_profiler.autograd_attribution import IGNORED, GraphClaims
from zero_profiler.dynamo_guard import keep_dynamo_out
from zero_profiler.flop_formulas import FORMULAS
from zero_profiler.function_mode import FunctionCountingMode
from zero_profiler.module_calls import unwrap_forwards, wrap_forwards
from zero_profiler.module_formulas import AT_ATEN_LEVEL

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch._ops import OpOverload, OpOverloadPacket

    from zero_profiler.function_formulas import Cost
    from zero_profiler.module_formulas import LeafRule

_current_autograd_node = torch._C._current_autograd_node
_WARMED_UP: list[bool] = []  # non-empty once a counting mode has dispatched an operator


@dataclass(slots=True)  # slots: these counters are updated on every module call
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


@dataclass(slots=True)
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
    # FLOPs per ATen overload packet, over every phase (outside included, ignored modules not),
    # kept as id(packet) -> [packet, flops]: OpOverloadPacket hashes in Python, too slow per op.
    op_flops: dict[int, list] = field(default_factory=dict)

    @property
    def by_op(self) -> dict[Any, int]:
        """FLOPs per ATen overload packet (``torch.ops.aten.mm`` ...)."""
        return {packet: flops for packet, flops in self.op_flops.values()}


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

    def _describe(self, func: OpOverload) -> tuple[Any, Any, Any]:
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


class _WarmUpMode(TorchDispatchMode):
    """An empty dispatch mode, to pay the process's one-time Python-mode setup cost up front."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _dynamo_has_compiled() -> bool:
    """Whether torch.compile has compiled any frame in this process (without importing dynamo)."""
    if "torch._dynamo" not in sys.modules:
        return False
    counters = sys.modules["torch._dynamo"].utils.counters
    return counters.get("frames", {}).get("total", 0) > 0


class ModuleTracker:
    """Brackets every module call of ``model`` and runs the mode that counts operators."""

    def __init__(
        self,
        model: torch.nn.Module,
        ignore_types: tuple[type, ...] = (),
        track_backward: bool = False,
        fast_path: bool = True,
    ):
        self.model = model
        self.ignore_types = ignore_types
        self.track_backward = track_backward
        self.fast_path = fast_path  # See [Note: function-level fast path]
        self.stats: dict[torch.nn.Module, ModuleStats] = {}
        self.totals = Totals()
        self.claims = GraphClaims()
        self._frames: list[list] = []  # one per open module call, innermost last (see begin_call)
        self._suppress = 0
        self._installed: list[Any] = []  # see module_calls.wrap_forwards
        self._mode: _CountingMode | FunctionCountingMode | None = None
        self.reset()

    # -- lifecycle --------------------------------------------------------------------------------

    def reset(self) -> None:
        self.stats = {m: ModuleStats() for m in self.model.modules()}
        self.totals = Totals()
        self.claims.clear()
        for frame in self._frames:  # calls still running count only what follows the reset
            frame[0] = frame[1] = frame[2] = frame[3] = 0

    def attach(self) -> None:
        """Bracket every module call: see [Note: module calls by forward wrappers]."""
        if not self._installed:
            self._installed = wrap_forwards(self.model, self, self.ignore_types)

    def detach(self) -> None:
        unwrap_forwards(self._installed)
        self._installed = []

    def start_counting(self) -> None:
        if self._mode is None:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    "FlopsProfiler: start_profile was called inside torch.compile; profile the model "
                    "outside the compiled region"
                )
            if not _WARMED_UP:
                # The first operator dispatched to a Python mode in a process pays a one-time
                # setup cost (~1 s); pay it here, outside any module, so it is not billed as latency.
                with _WarmUpMode():
                    torch.zeros(1).add_(1)
                _WARMED_UP.append(True)
            keep_dynamo_out()  # See [Note: profiling compiled models]
            aten_mode = _DynamoSafeCountingMode(self) if _dynamo_has_compiled() else _CountingMode(self)
            self._mode = FunctionCountingMode(self, aten_mode) if self.fast_path else aten_mode
            self._mode.__enter__()

    def stop_counting(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    @property
    def counting(self) -> bool:
        return self._mode is not None

    # -- recording --------------------------------------------------------------------------------

    def mark_backward_op(self) -> None:
        now = perf_counter()
        totals = self.totals
        if totals.bwd_first_op is None:
            totals.bwd_first_op = now
        totals.bwd_last_op = now

    def record(self, flops: int, macs: int, packet: OpOverloadPacket | None = None) -> None:
        """Credit one operator's cost to the current phase and module call (its innermost frame)."""
        if self._suppress:
            return
        totals = self.totals
        if _current_autograd_node() is None:
            if self._frames:
                frame = self._frames[-1]
                frame[0] += flops
                frame[1] += macs
                totals.fwd_flops += flops
                totals.fwd_macs += macs
            else:
                totals.outside_flops += flops
                totals.outside_macs += macs
        elif self._frames:  # a forward replayed inside backward
            frame = self._frames[-1]
            frame[2] += flops
            frame[3] += macs
            totals.recompute_flops += flops
            totals.recompute_macs += macs
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
        entry = totals.op_flops.get(id(packet))
        if entry is None:
            totals.op_flops[id(packet)] = [packet, flops]
        else:
            entry[1] += flops

    # -- module calls (run by module_calls.TrackedForward) -----------------------------------------

    # A frame: [fwd_flops, fwd_macs, recompute_flops, recompute_macs, module, replayed in backward,
    # start time, callable to run, leaf cost (mode stepped aside) or None, forward finished].
    # See [Note: module calls by forward wrappers] for why a call is begin + run + end.

    def begin_ignored(
        self,
        module: torch.nn.Module,
        leaf: LeafRule | None,
        forward: Callable[..., object],
        args: tuple,
        kwargs: dict,
    ) -> list:
        """Start an ignored module's call: nothing in it is counted, forward or backward."""
        self._suppress += 1
        if self.track_backward:
            self.claims.enter()
        return [0, 0, 0, 0, module, False, 0.0, forward, None, False]

    def end_ignored(self, frame: list) -> None:
        if self.track_backward:
            self.claims.exit(IGNORED)
        self._suppress -= 1

    @property
    def fwd_stack(self) -> list[torch.nn.Module]:
        """The modules whose forward is running, outermost first."""
        return [frame[4] for frame in self._frames]

    def begin_call(
        self,
        module: torch.nn.Module,
        leaf: LeafRule | None,
        forward: Callable[..., object],
        args: tuple,
        kwargs: dict,
    ) -> list:
        """Open a module call's frame; returns it, with what to run in slot 7.

        ``leaf``: the module's rule from :mod:`zero_profiler.module_formulas` (or None); when it
        applies, the function mode is stepped aside and the cost waits in slot 8 for
        :meth:`end_call` (see [Note: leaf modules]).
        """
        if self.track_backward:
            self.claims.enter()
        frame = [0, 0, 0, 0, module, _current_autograd_node() is not None, 0.0, forward, None, False]
        self._frames.append(frame)
        if leaf is not None:
            mode = self._mode
            if mode.__class__ is FunctionCountingMode:
                if leaf is AT_ATEN_LEVEL:
                    frame[7] = lambda *a, **kw: mode.run_at_aten_level(forward, a, kw)
                elif len(args) == 1 and not kwargs:
                    frame[8] = self._leaf_cost(mode, leaf, module, args[0])
        frame[6] = perf_counter()
        return frame

    def end_call(self, frame: list) -> None:
        """Close the innermost call (also when its forward raised: non-reentrant checkpointing
        stops its replay early by raising) and credit its frame."""
        end = perf_counter()
        cost = frame[8]
        if cost is not None:
            self._mode.step_back()
            if frame[9] and (cost[0] or cost[1]):
                self.record(*cost)  # into this frame, still innermost
        fwd_flops, fwd_macs, rec_flops, rec_macs, module, replay, start, _, _, _ = frame
        if self.track_backward:
            self.claims.exit(self._claim_stack(replay))  # the stack still holds this call
        frames = self._frames
        frames.pop()
        stats = self.stats.get(module)
        if stats is None:  # a module added to the model after profiling started
            stats = self.stats[module] = ModuleStats()
        if fwd_flops or fwd_macs or rec_flops or rec_macs:
            stats.fwd_flops += fwd_flops
            stats.fwd_macs += fwd_macs
            stats.recompute_flops += rec_flops
            stats.recompute_macs += rec_macs
            if frames:  # the caller's count includes this call's
                parent = frames[-1]
                parent[0] += fwd_flops
                parent[1] += fwd_macs
                parent[2] += rec_flops
                parent[3] += rec_macs
        if not replay:
            stats.fwd_duration += end - start
            stats.calls += 1

    def _leaf_cost(
        self, mode: FunctionCountingMode, leaf: LeafRule, module: torch.nn.Module, x: object
    ) -> Cost | None:
        """The leaf rule's cost, leaving the function mode stepped aside; None (and the mode in
        place) when either declines. The rule runs with the mode aside: its own tensor queries
        must not go through the mode."""
        if torch._C._are_functorch_transforms_active() or not mode.step_aside():
            return None  # under vmap & co. the rules would see per-example shapes
        try:
            cost = leaf(module, x)
        except Exception:  # not an input the rule understands: the forward raises its own error
            cost = None
        if cost is None:
            mode.step_back()
        return cost

    def _claim_stack(self, replay: bool) -> tuple:
        """The modules a call's backward is credited to: the forward stack, this module included."""
        if self._suppress:
            return IGNORED  # inside an ignored module
        stack = tuple(frame[4] for frame in self._frames)
        if replay:
            # A forward replayed in backward (reentrant checkpointing backpropagates through the
            # replay): its ancestors are those of the node being run, not the (empty) stack.
            outer = self.claims.stack_of_current_node() or ()
            stack = outer + tuple(m for m in stack if m not in outer)
        return stack
