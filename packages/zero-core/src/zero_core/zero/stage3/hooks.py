"""Module and gradient hooks that drive stage 3 without changes to model code.

[Note: stage 3 hooks]
* forward pre-hook: the root's starts an iteration (see [Note: stage 3 parameter coordinator]);
  every module's gathers its parameters (and its external ones).
* forward post-hook: releases them, except a parameter the module returns (the second pattern of
  DeepSpeed's external-parameter docs: it is registered as external to the enclosing module, so it
  stays gathered while that module runs and is gathered again for its backward). With grad
  enabled it also puts a multi-grad hook on the outputs: it fires before the module's backward
  and gathers the parameters again (this also covers recomputation under activation
  checkpointing, whose re-run forward goes through the same hooks).
* post-accumulate-grad hook of each trainable parameter: the gradient is complete, so it is
  handed to the gradient reducer (``.grad`` is dropped; see [Note: stage 3 gradient buckets])
  and the gathered parameter released (no later backward node needs it). A leaf module's
  parameters are held and go to the reducer as one unit (See [Note: z3 leaf gradient units]).
* end of backward (autograd engine callback): launches the last gradient bucket, releases the
  rest; the engine's ``after_backward`` waits for the reductions.
* ``module._parameters`` becomes a :class:`ZeroParamDict`: reading a released parameter as a
  module attribute inside some module's forward gathers it and registers it as external to
  that module (the first pattern of DeepSpeed's docs: ``compute_logits(x, self.embeddings.weight)``).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from zero_core.zero.stage3.leaf_grads import LeafGradUnits
from zero_core.zero.stage3.leaf_modules import leaf_descendants
from zero_core.zero.stage3.param_coordinator import ParamCoordinator
from zero_core.zero.stage3.param_records import RECORDS_BY_ID as _BY_ID
from zero_core.zero.stage3.partitioned_param import ParamStatus
from zero_core.zero.stage3.runtime_context import stage3_context

# The runtimes driving a forward and zero.Init's gather-on-access callbacks live in the process's
# Stage3Context (See [Note: stage 3 runtime context]).


class ZeroParamDict(dict):
    """``module._parameters`` for stage 3: gathers a released parameter when model code reads it."""

    def __getitem__(self, key: str) -> Any:
        p = dict.__getitem__(self, key)
        if p is not None and (st := _BY_ID.get(id(p))) is not None and st.status is not ParamStatus.AVAILABLE:
            _on_access(p, self)
        return p

    def items(self):  # noqa: ANN201 (dict view)
        outside = stage3_context().on_access_outside_forward
        if outside:
            for p in dict.values(self):
                if p is not None and id(p) in _BY_ID:
                    outside[-1](p, self)
        return dict.items(self)


def _on_access(p: torch.nn.Parameter, owner: ZeroParamDict) -> None:
    ctx = stage3_context()
    if ctx.active_hooks and ctx.active_hooks[-1].stack:
        ctx.active_hooks[-1].external_access(p)
    elif ctx.on_access_outside_forward:
        ctx.on_access_outside_forward[-1](p, owner)  # owner: the module's parameter dict


def install_param_dict(module: torch.nn.Module) -> None:
    if not isinstance(module._parameters, ZeroParamDict):
        module._parameters = ZeroParamDict(module._parameters)


def _output_leaves(output: Any) -> list[Any]:
    """The leaves of a module's output: pytree containers and dataclass fields, recursively.

    Dataclass outputs (zero-moe's gate returns one) must be looked into: a module whose
    output tensors are missed gets no pre-backward hook, so its parameters would not be
    gathered for its backward.
    """
    out: list[Any] = []
    todo = [output]
    while todo:
        leaves, _ = tree_flatten(todo.pop())
        for leaf in leaves:
            if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
                todo.extend(getattr(leaf, f.name) for f in dataclasses.fields(leaf))
            else:
                out.append(leaf)
    return out


def _weak_grad_hook(ref: weakref.ref) -> Callable[[torch.nn.Parameter], None]:
    """A post-accumulate-grad hook calling ``ref()._grad_ready`` while the runtime lives.

    The parameter's C++ side holds its hooks, out of the cycle collector's sight: a hook
    holding the runtime strongly (runtime -> coordinator -> module -> parameter -> hook) would
    keep the model, the strategy and the parameters' records alive forever (See
    [Note: stage 3 parameter records]).
    """

    def hook(param: torch.nn.Parameter) -> None:
        runtime = ref()
        if runtime is not None:
            runtime._grad_ready(param)

    return hook


class Stage3Hooks:
    """Installs and runs the hooks of [Note: stage 3 hooks] for one root module."""

    def __init__(
        self,
        root: torch.nn.Module,
        coordinator: ParamCoordinator,
        on_grad_ready: Callable[[torch.nn.Parameter, torch.Tensor], None],
        on_backward_end: Callable[[], None] = lambda: None,
        grad_bytes_live: Callable[[], int] = lambda: 0,
    ) -> None:
        self.root = root
        self.coordinator = coordinator
        self.on_grad_ready = on_grad_ready
        self.on_backward_end = on_backward_end
        self.grad_bytes_live = grad_bytes_live
        self.stack: list[torch.nn.Module] = []
        self.handles: list[Any] = []
        self.in_backward = False
        self._backward_task: int | None = None
        self.paused = False  # see pause_module_hooks
        inside_leaves = leaf_descendants(root)  # See [Note: z3 leaf modules]
        # a leaf's gradients are reduced as one unit: See [Note: z3 leaf gradient units]
        self.leaf_units = LeafGradUnits(root, on_grad_ready)
        for m in root.modules():
            install_param_dict(m)
            if id(m) in inside_leaves:
                continue
            self.handles.append(m.register_forward_pre_hook(self._pre_forward))
            if id(m) in self.leaf_units.leaves:
                self.handles.append(m.register_forward_pre_hook(self._leaf_entry, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post_forward))
        seen: set[int] = set()
        for p in root.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.handles.append(p.register_post_accumulate_grad_hook(_weak_grad_hook(weakref.ref(self))))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # -- forward ------------------------------------------------------------------------
    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self.paused:
            return
        if module is self.root and not self.stack and not self.in_backward:
            self.coordinator.begin_iteration((self.root.training, torch.is_grad_enabled()))
        if not self.stack:
            stage3_context().active_hooks.append(self)
        self.stack.append(module)
        self.coordinator.fetch(module, "forward")

    def _leaf_entry(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not self.paused:
            self.leaf_units.on_leaf_entry(module, args, kwargs)

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if self.paused:
            return None
        leaves = _output_leaves(output)
        returned = [t for t in leaves if isinstance(t, torch.nn.Parameter) and id(t) in _BY_ID]
        if self.stack and self.stack[-1] is module:
            self.stack.pop()
        if returned and self.stack:
            # Pattern 2: the parent uses the returned parameter; it owns it from now on.
            from zero_core.zero.stage3.external_params import register_external_parameter

            for p in returned:
                register_external_parameter(self.stack[-1], p)
                _BY_ID[id(p)].active += 1
        self.coordinator.release_module(module, "forward", keep=returned)
        active = stage3_context().active_hooks
        if not self.stack and active and active[-1] is self:
            active.pop()
        if torch.is_grad_enabled():
            tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, lambda grads, m=module: self._pre_backward(m), mode="any")
        return None

    def external_access(self, p: torch.nn.Parameter) -> None:
        """A released parameter read inside a forward: gather it, make it the module's external."""
        from zero_core.zero.stage3.external_params import register_external_parameter

        owner = self.stack[-1]
        register_external_parameter(owner, p)
        self.coordinator.ensure_available([p], f"access from module {type(owner).__name__}")
        self.coordinator._track([p])
        _BY_ID[id(p)].active += 1

    # -- backward -----------------------------------------------------------------------
    def _pre_backward(self, module: torch.nn.Module) -> None:
        if not self.in_backward:
            self.in_backward = True
            self._backward_task = torch._C._current_graph_task_id()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self.coordinator.fetch(module, "backward")
        # Parameters without gradients (frozen) are released at the end of backward.
        for p in module.parameters(recurse=bool(getattr(module, "_z3_leaf", False))):
            st = _BY_ID.get(id(p))
            if st is not None:
                st.active = 0

    def _grad_ready(self, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        if id(param) not in _BY_ID:
            return
        coord = self.coordinator
        coord.extra_bytes = self._grad_bytes() + grad.numel() * grad.element_size()
        coord.peak_bytes = max(coord.peak_bytes, coord.live_bytes() + coord.extra_bytes)
        if self.leaf_units.owns(param):  # held until its unit goes: See [Note: z3 leaf gradient units]
            self.leaf_units.hold(param, grad)
        else:
            self.on_grad_ready(param, grad)
        del grad
        coord.extra_bytes = self._grad_bytes()
        coord.release_after_grad(param)

    def _grad_bytes(self) -> int:
        """Full-size gradient bytes alive: in the reduce buckets and held for leaf units."""
        held = self.leaf_units.pending_bytes() if self.leaf_units else 0
        return self.grad_bytes_live() + held

    def _end_backward(self) -> None:
        if self._backward_task is not None and torch._C._current_graph_task_id() not in (
            -1,
            self._backward_task,
        ):
            return
        self.in_backward = False
        self._backward_task = None
        self.leaf_units.end_of_backward()  # before the last bucket: See [Note: z3 leaf gradient units]
        self.on_backward_end()
        self.coordinator.end_iteration()
