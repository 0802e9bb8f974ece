"""The fast path: count known torch functions at function level, everything else at ATen level.

[Note: function-level fast path]
Counting every ATen operator with a ``TorchDispatchMode`` is exact but has a floor: on this
project's benchmark GPT an *empty* dispatch mode alone costs more than DeepSpeed's whole
profiler. An empty ``TorchFunctionMode`` costs a fraction of that (measurements in
tools/bench/results/bench_profiler.md): it sees one call per torch function (``F.linear``,
``x + y``, ``x.view``) instead of one per operator after decomposition, and the kernels run with
no Python dispatch key.

So the profiler pushes a ``TorchFunctionMode`` (:class:`FunctionCountingMode`). For each call it
looks the function up in :data:`zero_profiler.function_formulas.FUNCTION_RULES`:

* ``PASS`` (views, metadata, copies, factories): the call just runs.
* a ``Pointwise`` rule, or a ``Rule`` whose ``count`` accepts the call: the function runs
  directly and its cost, which by construction equals the cost of the ATen operators it runs,
  is recorded with that operator's packet (so ``get_flops_by_op`` is unchanged).
* anything else (no rule, a rule that declines, a tensor subclass with its own
  ``__torch_function__``, a call inside a ``torch.func`` transform such as ``vmap``, where
  rules would see per-example shapes): the call runs with the ATen-level counting mode of
  :mod:`zero_profiler.tracking` pushed around it, so its operators are counted exactly as
  before. ``Tensor.backward``, ``torch.autograd.backward`` and ``torch.autograd.grad`` are such
  calls, which is how backward (train mode) and the forward replayed by activation
  checkpointing inside it are counted at ATen level.

Inside ``__torch_function__`` PyTorch has popped the mode, so the functions a counted call runs
internally (``F.layer_norm`` calling ``torch.layer_norm``) are not seen twice.

[Note: leaf modules]
The common built-in layers (``nn.Linear``, ``nn.LayerNorm``, ``nn.Embedding``, ``nn.Dropout``,
``nn.GELU``, ``nn.ReLU``, ``nn.SiLU``) are leaves that run exactly one functional. When the
tracker brackets such a call (see [Note: module calls by forward wrappers] in
:mod:`zero_profiler.module_calls`) and :mod:`zero_profiler.module_formulas` has a rule that
applies, it records the functional's cost itself and runs the layer's forward with this mode
popped from the torch-function stack (:meth:`FunctionCountingMode.step_aside`), so the
functional does not make a round trip through ``__torch_function__`` (for ``F.layer_norm`` and
``F.embedding`` that includes torch's Python-level ``handle_torch_function``). The mode only
steps aside when it is the innermost torch-function mode, so modes pushed after it still see
the call, and never while it is itself handling a call (then it is not on the stack).

TorchScript runs its operators without torch functions: a ``torch.jit.ScriptModule`` in the
model is therefore run at ATen level as a whole (the tracker sees it when it brackets the call).

What this gives up, and the escape hatch: operators run from a place that is not a torch
function and not a module of the model (a scripted free function, a pybind C++ extension
calling ATen directly, code under ``torch._C.DisableTorchFunction``, backward started from a
``GradientEdge``) are not seen.
``FlopsProfiler(..., fast_path=False)`` counts with the ATen-level mode alone, as before.
Compiled models: see [Note: profiling compiled models] in :mod:`zero_profiler.dynamo_guard`.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from zero_profiler.dynamo_guard import disable_inlining
from zero_profiler.function_formulas import FUNCTION_RULES, PASS, Pointwise

if TYPE_CHECKING:
    from torch.utils._python_dispatch import TorchDispatchMode

    from zero_profiler.tracking import ModuleTracker

_Tensor = torch.Tensor
_stack_len = torch._C._len_torch_function_stack
_functorch_active = torch._C._are_functorch_transforms_active
_pop_mode, _push_mode = torch._C._pop_torch_function_stack, torch._C._push_on_torch_function_stack
_PLAIN_TYPES = ((), (_Tensor,))  # what __torch_function__ gets as ``types`` for plain tensors
_NO_KWARGS: dict = {}  # shared, never written


class FunctionCountingMode(TorchFunctionMode):
    """Counts known functions by rule and runs the rest under ``aten_mode``.

    See [Note: function-level fast path]. ``tracker`` is the :class:`ModuleTracker` that
    receives the counts; ``aten_mode`` the (not yet entered) ATen-level counting mode.
    """

    def __init__(self, tracker: ModuleTracker, aten_mode: TorchDispatchMode) -> None:
        super().__init__()
        self._record = tracker.record
        self._aten_mode = aten_mode
        self._rules = FUNCTION_RULES
        self._depth = -1  # the torch-function stack's length with this mode innermost
        self._aten_active = False  # whether aten_mode is pushed by run_at_aten_level
        # function -> calls counted at ATen level (tests and diagnostics: what has no fast rule)
        self.aten_level_calls: Counter = Counter()

    def __enter__(self) -> FunctionCountingMode:
        super().__enter__()
        self._depth = _stack_len()
        return self

    def step_aside(self) -> bool:
        """Pop this mode if it is the innermost torch-function mode; see [Note: leaf modules].

        Returns whether it did; the caller must then :meth:`step_back` when its call ends.
        """
        if _stack_len() != self._depth:
            return False
        top = _pop_mode()
        if top is not self:  # another mode took this depth meanwhile: leave the stack as it was
            _push_mode(top)
            return False
        return True

    def step_back(self) -> None:
        _push_mode(self)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        rule = self._rules.get(func)
        if rule is None or types not in _PLAIN_TYPES:
            return self.run_at_aten_level(func, args, kwargs)
        if rule is PASS:
            return func(*args, **kwargs) if kwargs else func(*args)
        if _functorch_active():  # vmap/grad: rules see per-example shapes, operators the batch
            return self.run_at_aten_level(func, args, kwargs)
        if rule.__class__ is Pointwise:
            out = func(*args, **kwargs) if kwargs else func(*args)
            if isinstance(out, _Tensor):
                self._record(out.numel(), 0, rule.packet)
            return out
        try:
            cost = rule.count(args, kwargs or _NO_KWARGS)
        except Exception:  # not a call the rule understands: the function raises its own error
            cost = None
        if cost is None:
            return self.run_at_aten_level(func, args, kwargs)
        out = func(*args, **kwargs) if kwargs else func(*args)
        if cost.__class__ is not tuple:
            cost = cost(out)
        if cost[0] or cost[1]:
            self._record(*cost)
        return out

    def run_at_aten_level(self, func: Any, args: tuple, kwargs: dict | None) -> Any:
        """Run ``func`` with the ATen-level counting mode pushed: its operators are counted one
        by one (calls without a rule, TorchScript modules).

        Calls made while that mode is already pushed just run: the mode's own calls to the
        operators it counts go through torch functions too when this mode is still on the stack
        (TorchScript modules), and must not be counted twice.
        """
        if self._aten_active:
            return func(*args, **(kwargs or _NO_KWARGS))
        self.aten_level_calls[func] += 1
        self._aten_active = True
        try:
            with self._aten_mode:
                return func(*args, **(kwargs or _NO_KWARGS))
        finally:
            self._aten_active = False


disable_inlining(FunctionCountingMode.__torch_function__)  # See [Note: profiling compiled models]
