"""Bracketing every module call of the profiled model: an instance-level ``forward`` wrapper.

[Note: module calls by forward wrappers]
The tracker must know when each module's ``forward`` starts and ends (attribution stack,
latency, backward claims). Forward hooks do that, but any hook sends ``Module._call_impl`` down
its slow path (a closure, a set and a try block per call, hook dictionaries walked twice): on
the benchmark's tiny GPT that path alone cost more than a fifth of DeepSpeed's whole profiling
overhead. So while profiling, each module's instance attribute ``forward`` is a
:class:`TrackedForward` that runs the original ``forward`` between the tracker's
``begin_call`` and ``end_call`` (``try``/``finally``, so a forward that raises still leaves the
stack, as non-reentrant checkpointing's early stop needs); ``_call_impl`` stays on its fast
path. The wrapper is that one ``try``/``finally`` and nothing else, and Dynamo does not trace
it (see [Note: profiling compiled models] in :mod:`zero_profiler.dynamo_guard`).

Details that keep this invisible to the model:

* the original is whatever ``module.forward`` resolved to (a bound class method, or an instance
  attribute someone else installed), and is put back on removal; when another wrapper was
  installed on top of ours meanwhile, ours is only switched off (it then just forwards), so
  neither clobbers the other;
* ``inspect.signature(module.forward)`` sees the original's signature (``__wrapped__``);
* ``copy.deepcopy`` and pickling of a module while it is profiled give the copy the original
  ``forward``, never a wrapper bound to the profiled instance;
* user forward hooks still run (around our bracket, so work a user hook does is credited to the
  caller, as a hook registered before ours did);
* calling ``module.forward(x)`` directly is a module call too (hooks missed it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, SupportsIndex

import torch

from zero_profiler.dynamo_guard import disable_inlining
from zero_profiler.module_formulas import leaf_rule

if TYPE_CHECKING:
    from zero_profiler.module_formulas import LeafRule
    from zero_profiler.tracking import ModuleTracker


class TrackedForward:
    """Runs the original forward between ``tracker.begin_call`` and ``tracker.end_call``
    (``begin_ignored``/``end_ignored`` for ignored modules).

    See [Note: module calls by forward wrappers]. ``begin_*`` returns the call's frame, whose
    slot 7 is what to run (the original forward, or a runner that counts it at ATen level) and
    slot 9 says whether it returned; ``end_*`` gets the frame back.
    """

    def __init__(
        self,
        tracker: ModuleTracker,
        module: torch.nn.Module,
        original: Callable[..., Any],
        ignored: bool,
        leaf: LeafRule | None = None,
    ) -> None:
        self.original = original
        self.active = True
        self._begin = tracker.begin_ignored if ignored else tracker.begin_call
        self._end = tracker.end_ignored if ignored else tracker.end_call
        self._module = module
        self._leaf = leaf  # the module's leaf rule, if any: see [Note: leaf modules]
        # What functools.update_wrapper would copy, without its generic (slower) machinery.
        self.__wrapped__ = original
        self.__name__ = getattr(original, "__name__", "forward")
        self.__qualname__ = getattr(original, "__qualname__", self.__name__)
        self.__doc__ = getattr(original, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return self.original(*args, **kwargs)
        # One try/finally and no other block: Dynamo is kept out of this method (see [Note:
        # profiling compiled models]), and nested exception blocks are what it fails on if not.
        frame = self._begin(self._module, self._leaf, self.original, args, kwargs)
        try:
            out = frame[7](*args, **kwargs)
            frame[9] = True
            return out
        finally:
            self._end(frame)

    # A copy of the module gets the original forward, not this wrapper (bound to the original).
    def __deepcopy__(self, memo: dict) -> Any:
        import copy

        return copy.deepcopy(self.original, memo)

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        return self.original.__reduce_ex__(protocol)


disable_inlining(TrackedForward.__call__)  # See [Note: profiling compiled models]


def wrap_forwards(
    model: torch.nn.Module, tracker: ModuleTracker, ignore_types: tuple[type, ...]
) -> list[tuple[torch.nn.Module, TrackedForward, bool]]:
    """Install a :class:`TrackedForward` on every module of ``model``.

    Returns what :func:`unwrap_forwards` needs: ``(module, wrapper, had_instance_forward)``.
    """
    installed = []
    for module in model.modules():
        own = module.__dict__.get("forward")
        original = own if own is not None else module.forward
        ignored = bool(ignore_types) and isinstance(module, ignore_types)
        wrapper = TrackedForward(tracker, module, original, ignored, leaf_rule(module))
        module.__dict__["forward"] = wrapper
        installed.append((module, wrapper, own is not None))
    return installed


def unwrap_forwards(installed: list[tuple[torch.nn.Module, TrackedForward, bool]]) -> None:
    """Undo :func:`wrap_forwards`: restore each original, or switch ours off if it is buried."""
    for module, wrapper, had_own in reversed(installed):
        wrapper.active = False
        if module.__dict__.get("forward") is wrapper:
            if had_own:
                module.__dict__["forward"] = wrapper.original
            else:
                del module.__dict__["forward"]
