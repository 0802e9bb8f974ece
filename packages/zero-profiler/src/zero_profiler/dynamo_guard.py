"""Keeping ``torch.compile`` (Dynamo) out of the profiler's own frames.

[Note: profiling compiled models]
While profiling, the profiler's Python runs inside the model's calls: the module-call wrappers,
the function mode, the rules. When the model (or part of it) is compiled, Dynamo would trace
that code like user code, and it cannot: it fails on the wrappers' graph breaks inside
exception blocks and on the counters' bookkeeping, and whatever it did trace would run once per
compilation instead of once per call. So the profiler marks, once per process:

* every code object of this package "skip" for Dynamo's frame evaluation
  (``set_code_exec_strategy``, a C-level flag that needs no import of ``torch._dynamo``): such a
  frame runs uncompiled, while the frames it calls (the user's ``forward``) are still compiled;
* the two entry points Dynamo could inline from user code (``TrackedForward.__call__`` and
  ``FunctionCountingMode.__torch_function__``) with ``_torchdynamo_disable``, the attribute
  ``torch.compiler.disable`` sets: Dynamo breaks the graph at such a call instead of inlining it;
* and, when ``torch._dynamo`` is already imported, this package's files as skipped
  (``trace_rules.add``).

A frame compiled before profiling started is recompiled under the profiler's mode (Dynamo guards
on the torch-function mode stack), so its calls are seen too. ``test_compiled_module_is_counted``
and ``test_profiler_compile.py`` cover a model compiled before, and first compiled during, a
profile.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])

_DONE: list[bool] = []  # non-empty once this process's marking is done
_TRACE_RULES_DONE: list[bool] = []

_MODULES = (
    "zero_profiler.autograd_attribution",
    "zero_profiler.flop_formulas",
    "zero_profiler.function_formulas",
    "zero_profiler.function_mode",
    "zero_profiler.module_calls",
    "zero_profiler.module_formulas",
    "zero_profiler.tracking",
)


def disable_inlining(fn: _F) -> _F:
    """Mark ``fn`` the way ``torch.compiler.disable`` does, for Dynamo's inliner only (no wrapper)."""
    fn._torchdynamo_disable = True
    fn._torchdynamo_disable_msg = "zero_profiler runs uncompiled; see [Note: profiling compiled models]"
    return fn


def _codes(obj: object, seen: set[int]) -> Iterator[types.CodeType]:
    """Every code object reachable from a module, class or function (nested ones included)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, types.CodeType):
        yield obj
        for const in obj.co_consts:
            if isinstance(const, types.CodeType):
                yield from _codes(const, seen)
    elif isinstance(obj, (staticmethod, classmethod)):
        yield from _codes(obj.__func__, seen)
    elif isinstance(obj, property):
        for accessor in (obj.fget, obj.fset, obj.fdel):
            if accessor is not None:
                yield from _codes(accessor, seen)
    elif isinstance(obj, types.FunctionType):
        yield from _codes(obj.__code__, seen)
    elif isinstance(obj, (types.ModuleType, type)):
        home = obj.__name__ if isinstance(obj, types.ModuleType) else obj.__module__
        for value in vars(obj).values():
            if isinstance(value, type) and value.__module__ != home:
                continue  # an imported class: not ours
            if isinstance(value, types.FunctionType) and value.__module__ != home:
                continue
            if isinstance(value, (types.FunctionType, type, staticmethod, classmethod, property)):
                yield from _codes(value, seen)  # closures' code: constants of their factory's code


def keep_dynamo_out() -> None:
    """Mark this package's code for Dynamo: see [Note: profiling compiled models]."""
    if not _DONE:
        _DONE.append(True)
        try:
            from torch._C._dynamo.eval_frame import (
                _FrameAction,
                _FrameExecStrategy,
                set_code_exec_strategy,
            )
        except ImportError:  # a torch without these hooks: the file-level skip below still applies
            pass
        else:
            skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT)
            seen: set[int] = set()
            for name in _MODULES:
                for code in _codes(importlib.import_module(name), seen):
                    set_code_exec_strategy(code, skip)
    if not _TRACE_RULES_DONE and "torch._dynamo" in sys.modules:
        _TRACE_RULES_DONE.append(True)
        importlib.import_module("torch._dynamo.trace_rules").add("zero_profiler")
