"""When parameters are gathered and released: trace, prefetch, persistence and live bounds.

[Note: stage 3 parameter coordinator]
An *iteration* runs from one forward of the root module to the next (training: forward plus
backward; eval: forward). Each time a module needs its parameters (forward or backward) the
coordinator logs an event ``(module, phase)``. The event list of the first iteration is the
*trace*, kept per mode ``(module.training, grad enabled)`` so that alternating train and eval
loops do not invalidate each other.

In later iterations, while events match the trace, the coordinator prefetches: it starts one
all-gather for the parameters of the next modules in the trace, up to ``prefetch_bucket_size``
elements and without taking the gathered total past ``max_live_parameters``. On release it
keeps a parameter whose next use in the trace is less than ``max_reuse_distance`` elements of
gathering away (again bounded by ``max_live_parameters``). On the first event that does not
match (dynamic control flow) the trace is dropped: the rest of the iteration gathers on
demand only and the next iteration records a new trace. Prefetched parameters that end up
unused are waited for and released at the end of the iteration. Every decision depends only on
the event sequence, so ranks that run the same modules issue the same collectives; ranks that
do not are caught by [Note: stage 3 collective agreement]. A module never runs with a released
parameter: ``fetch`` waits for every parameter of the module before returning.

Parameters no larger than ``param_persistence_threshold`` elements (in module order, while the
running total stays under ``model_persistence_threshold``) are *persistent*: gathered once,
never released, refreshed after each optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zero_core.zero.stage3.param_records import is_partitioned
from zero_core.zero.stage3.partitioned_param import (
    GatherHandle,
    ParamStatus,
    gather_params,
    param_name,
    release_param,
)

Event = tuple[int, str]


def module_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The partitioned parameters a module's forward needs: its own plus its external ones."""
    if getattr(module, "_z3_leaf", False):  # the whole subtree: See [Note: z3 leaf modules]
        own = list({id(p): p for p in module.parameters() if is_partitioned(p)}.values())
    else:
        own = [p for p in module._parameters.values() if p is not None and is_partitioned(p)]
    ext = getattr(module, "_zero_external_params", None)
    if ext:
        ids = {id(p) for p in own}
        own = own + [p for p in ext if id(p) not in ids]
    return own


class ParamCoordinator:
    """Gathers and releases partitioned parameters around module execution."""

    def __init__(
        self,
        modules: Iterable[torch.nn.Module],
        group: Any = None,
        *,
        prefetch_bucket_size: int = 50_000_000,
        max_live_parameters: int = 1_000_000_000,
        max_reuse_distance: int = 1_000_000_000,
    ) -> None:
        for name, v in (
            ("prefetch_bucket_size", prefetch_bucket_size),
            ("max_live_parameters", max_live_parameters),
            ("max_reuse_distance", max_reuse_distance),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"ParamCoordinator: {name} must be a non-negative int, got {v!r}")
        self.modules = list(modules)
        self.index = {id(m): i for i, m in enumerate(self.modules)}
        self.group = group
        self.prefetch_bucket_size = prefetch_bucket_size
        self.max_live_parameters = max_live_parameters
        self.max_reuse_distance = max_reuse_distance
        self.traces: dict[tuple[bool, bool], list[Event]] = {}
        self.recording: list[Event] = []
        self.mode: tuple[bool, bool] | None = None
        self.trace: list[Event] | None = None
        self.pos = 0
        # trace index -> (external parameters' ids, (params, their ids, their padded numel)):
        # see _trace_params
        self._trace_cache: dict[
            int, tuple[tuple[int, ...], tuple[list[torch.nn.Parameter], set[int], int]]
        ] = {}
        self.inflight: dict[int, GatherHandle] = {}
        self.gathered: dict[int, torch.nn.Parameter] = {}  # non-persistent params currently gathered
        self.live_numel = 0
        self.peak_bytes = 0
        self.extra_bytes = 0  # full-size gradients not yet reduced (reported by the strategy)
        self.fallbacks = 0
        self.prefetched = 0
        # ZeRO++ qwZ: forward gathers of trainable weights (and every gather of frozen ones, with
        # ``zero_quantized_nontrainable_weights``) travel int8-quantized; backward gathers and
        # on-demand ones stay full precision. See [Note: quantized weight all-gather (qwZ)].
        self.quantize_weights = False
        self.quantize_nontrainable = False

    def _quantize_for(self, phase: str) -> Any:
        """The ``quantize`` predicate of :func:`gather_params` for a gather of ``phase``."""
        qw = self.quantize_weights and phase == "forward"
        qf = self.quantize_nontrainable
        if not (qw or qf):
            return None
        # frozen shards are stored quantized (See [Note: quantized frozen shards]): send their blocks
        return lambda p: ("aligned" if qf else False) if not p.requires_grad else qw

    # -- iteration boundaries ----------------------------------------------------------
    def begin_iteration(self, mode: tuple[bool, bool]) -> None:
        self.end_iteration()
        self.mode = mode
        self.trace = self.traces.get(mode)
        self.pos = 0
        self.recording = []
        self._trace_cache.clear()

    def end_iteration(self) -> None:
        if self.mode is not None and self.recording:
            if self.trace is None or self.recording != self.trace:
                self.traces[self.mode] = self.recording
        self.mode = None
        self.recording = []
        self.release_all()

    def release_all(self, force: bool = False) -> None:
        """Wait for every in-flight gather and release every non-persistent parameter."""
        for h in list(self.inflight.values()):
            h.wait()
        self.inflight.clear()
        for p in list(self.gathered.values()):
            p._zero_record.active = 0
            self._release(p, force=force)

    # -- fetch / release -------------------------------------------------------------------
    def fetch(self, module: torch.nn.Module, phase: str) -> list[torch.nn.Parameter]:
        """Make every parameter of ``module`` available (and prefetch the next ones)."""
        params = module_params(module)
        event = (self.index.get(id(module), -1), phase)
        self._advance(event)
        self._ensure(params, f"{phase} of module {type(module).__name__}#{event[0]}", phase)
        for p in params:
            p._zero_record.active += 1
        self._prefetch()
        return params

    def ensure_available(self, params: list[torch.nn.Parameter], what: str) -> None:
        """Gather ``params`` now, outside the trace (on-demand access from model code)."""
        self._ensure(params, what)

    def _ensure(self, params: list[torch.nn.Parameter], what: str, phase: str = "") -> None:
        for p in params:
            h = self.inflight.get(p._zero_record.id)
            if h is not None:
                h.wait()
                for st in h.states:
                    self.inflight.pop(st.id, None)
        handle = gather_params(params, what=what, quantize=self._quantize_for(phase) if phase else None)
        if handle is not None:
            handle.wait()
            self._track(handle.params)

    def _track(self, params: list[torch.nn.Parameter]) -> None:
        for p in params:
            st = p._zero_record
            if not st.persistent and st.id not in self.gathered:
                self.gathered[st.id] = p
                self.live_numel += st.padded_numel
        self.peak_bytes = max(self.peak_bytes, self.live_bytes() + self.extra_bytes)

    def live_bytes(self) -> int:
        return sum(p._zero_record.full.untyped_storage().nbytes() for p in self.gathered.values())

    def release_module(
        self, module: torch.nn.Module, phase: str, keep: Iterable[torch.nn.Parameter] = ()
    ) -> None:
        """Called after a module's forward: release what is not reused soon."""
        keep_ids = {p._zero_record.id for p in keep}
        for p in module_params(module):
            st = p._zero_record
            st.active = max(st.active - 1, 0)
            if st.active > 0 or st.id in keep_ids or self._reused_soon(p):
                continue
            # after forward autograd's saved views must follow the in-place re-gather
            self._release(p, keep_outside_views=phase != "forward")

    def release_after_grad(self, param: torch.nn.Parameter) -> None:
        """A parameter whose gradient is complete is not needed again in this backward."""
        st = param._zero_record
        st.active = 0
        if not self._reused_soon(param):
            self._release(param)

    def _release(self, p: torch.nn.Parameter, force: bool = False, keep_outside_views: bool = True) -> None:
        """See [Note: tensors taken from a gathered parameter] for ``keep_outside_views``."""
        st = p._zero_record
        if st.id in self.inflight:
            return
        if release_param(p, force=force, keep_outside_views=keep_outside_views) or (
            st.status is ParamStatus.NOT_AVAILABLE
        ):
            if self.gathered.pop(st.id, None) is not None:
                self.live_numel -= st.padded_numel

    # -- trace following --------------------------------------------------------------------
    def _advance(self, event: Event) -> None:
        self.recording.append(event)
        if self.trace is None:
            return
        if self.pos < len(self.trace) and self.trace[self.pos] == event:
            self.pos += 1
        else:
            # Dynamic control flow: stop prefetching for this iteration, record a new trace.
            self.trace = None
            self.fallbacks += 1

    def _prefetch(self) -> None:
        if self.trace is None or self.prefetch_bucket_size == 0:
            return
        budget = self.prefetch_bucket_size
        # ``inflight`` maps every parameter of a handle to it: count each handle once
        handles = {id(h): h for h in self.inflight.values()}.values()
        room = (
            self.max_live_parameters
            - self.live_numel
            - sum(st.padded_numel for h in handles for st in h.states)
        )
        bucket: list[torch.nn.Parameter] = []
        seen: set[int] = set()
        first_phase = None
        for idx, phase in self.trace[self.pos :]:
            if idx < 0:
                continue
            if first_phase is None:
                first_phase = phase
            elif phase != first_phase and (self.quantize_weights or self.quantize_nontrainable):
                break  # forward (quantized) and backward (full precision) gathers never share a bucket
            for p in self._trace_params(idx)[0]:
                st = p._zero_record
                if st.status is not ParamStatus.NOT_AVAILABLE or st.id in seen:
                    continue
                if st.padded_numel > room or st.padded_numel > budget:
                    budget = 0
                    break
                seen.add(st.id)
                bucket.append(p)
                budget -= st.padded_numel
                room -= st.padded_numel
            if budget <= 0:
                break
        if not bucket:
            return
        handle = gather_params(bucket, what="prefetch", quantize=self._quantize_for(first_phase or ""))
        if handle is None:
            return
        self.prefetched += len(bucket)
        for st in handle.states:
            self.inflight[st.id] = handle
        self._track(handle.params)

    def _trace_params(self, idx: int) -> tuple[list[torch.nn.Parameter], set[int], int]:
        """:func:`module_params` of trace module ``idx``, their ids and padded numel, cached for the
        iteration: the prefetch and reuse scans walk the rest of the trace at every fetch and
        release, and rebuilding each module's list there cost stage 3 thousands of calls per step.
        An external parameter registered during the iteration invalidates the module's entry."""
        module = self.modules[idx]
        ext = module.__dict__.get("_zero_external_params")
        key = tuple(id(q) for q in ext) if ext else ()
        hit = self._trace_cache.get(idx)
        if hit is not None and hit[0] == key:
            return hit[1]
        params = module_params(module)
        entry = (
            params,
            {q._zero_record.id for q in params},
            sum(q._zero_record.padded_numel for q in params),
        )
        self._trace_cache[idx] = (key, entry)
        return entry

    def _reused_soon(self, p: torch.nn.Parameter) -> bool:
        if self.trace is None or self.max_reuse_distance == 0:
            return False
        if self.live_numel > self.max_live_parameters:
            return False
        distance = 0
        pid = p._zero_record.id
        for idx, _phase in self.trace[self.pos :]:
            if idx < 0:
                continue
            _, ids, numel = self._trace_params(idx)
            if pid in ids:
                return True
            distance += numel
            if distance >= self.max_reuse_distance:
                return False
        return False

    def describe(self, p: torch.nn.Parameter) -> str:
        return param_name(p)
