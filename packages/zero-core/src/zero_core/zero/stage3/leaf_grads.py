"""The gradients of a ZeRO-3 leaf module, reduced as one unit whatever each rank touched.

[Note: z3 leaf gradient units]
Stage 3 hands each parameter's gradient to the reduce buckets when it is complete (See
[Note: stage 3 gradient buckets]); that is only right when every rank produces the same
gradients in the same order. Inside a leaf module it does not hold: a mixture-of-experts block
routes each rank's tokens to different experts, so rank 0 may compute gradients for experts 0
and 2 while rank 1 computes them for experts 1 and 2, in data-dependent orders. Bucketed as they
come, the ranks would reduce-scatter different parameters against each other: an agreement
error when the sizes differ, silently wrong sums when they happen to match.

So the trainable parameters of a leaf's subtree form a *unit*, listed once in module order
(the same list on every rank). Their gradients are held as they arrive (added up when one
comes twice before the unit goes, as with reentrant activation checkpointing's inner backward) and the unit is handed to the reducer whole, in that order, with a
zero gradient for every parameter this rank did not use: every rank reduces the same
parameters in the same layout, so each parameter's reduced gradient is the mean over ranks of
what each rank computed (zero from a rank that did not use it), exactly data-parallel training.

When: at the leaf's entry a multi-grad hook (mode "all") goes on the input tensors that require
grad and have a producer (``grad_fn``); it fires when their gradients are complete, as the
producers' backward starts. Autograd runs the nodes of one device in decreasing creation order
(it always takes the ready node with the highest sequence number, and an unfinished node with
a higher one always has a ready one above it), and the producers were created before the
leaf's entry, so every node of the leaf's forward has run by then: every gradient the leaf
produced has arrived, and no later one can come from inside the leaf. The unit is handed over
there, once per call, at the same place in every rank's sequence of gradients (the ranks differ
only inside the leaf). Its full gradients are alive only while the leaf's backward runs, as its
gathered parameters are. A parameter this rank did not use stays gathered until the end of
backward, as any parameter without a gradient does (it may still be used outside the leaf
later in backward: a tied weight). (An identity autograd function on the inputs would give the
same signal, but model code could no longer modify its inputs in place.)

At the end of backward, units still holding gradients are handed over again (in unit order):
a parameter of the leaf also used outside it before the leaf's entry (a tied weight) gets its
gradient only after that use's backward (autograd accumulates all of a parameter's uses before
its gradient is complete), so the unit went with a zero for it at the signal; outside the
leaf every rank runs the same graph, so the same units are in that state on every rank. A leaf called while grad is enabled with no input that has a
producer (the first module of a model, a model marked a leaf as a whole, inputs that are leaf
tensors: their gradient can be complete before the leaf's last node has run) has no signal:
its unit is handed over at the end of backward too. DeepSpeed refuses such calls with a
RuntimeError; here they train, at the cost of holding the unit's gradients until the end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from zero_core.zero.stage3.leaf_modules import leaf_descendants, z3_leaf_module
from zero_core.zero.stage3.param_records import RECORDS_BY_ID as _BY_ID


class _Unit:
    __slots__ = ("name", "params", "pending", "needs_final")

    def __init__(self, name: str, params: list[torch.nn.Parameter]) -> None:
        self.name = name
        self.params = params
        self.pending: dict[int, torch.Tensor] = {}  # id(param) -> full gradient held
        self.needs_final = False  # called without a signal in this backward


class LeafGradUnits:
    """The units of every outermost leaf module of ``root``; See [Note: z3 leaf gradient units]."""

    def __init__(
        self,
        root: torch.nn.Module,
        on_grad_ready: Callable[[torch.nn.Parameter, torch.Tensor], None],
    ) -> None:
        self.on_grad_ready = on_grad_ready
        self.units: list[_Unit] = []
        self.owner: dict[int, _Unit] = {}  # id(param) -> its unit
        self.leaves: dict[int, _Unit] = {}  # id(outermost leaf module) -> its unit
        inside = leaf_descendants(root)  # leaves inside a leaf are part of the outer one's unit
        for name, module in root.named_modules():
            if id(module) in inside or not z3_leaf_module(module):
                continue
            params = [p for p in module.parameters() if p.requires_grad and id(p) in _BY_ID]
            params = [p for p in params if id(p) not in self.owner]  # a parameter in one unit only
            unit = _Unit(name or type(module).__name__, params)
            self.owner.update((id(p), unit) for p in params)
            self.units.append(unit)
            self.leaves[id(module)] = unit

    def __bool__(self) -> bool:
        return bool(self.units)

    # -- forward: the signal ---------------------------------------------------------------
    def on_leaf_entry(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of a leaf: arm the signal on its inputs' gradients (See the Note)."""
        unit = self.leaves.get(id(module))
        if unit is None or not unit.params or not torch.is_grad_enabled():
            return
        leaves, _ = tree_flatten((args, kwargs))
        produced = [t for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if not produced:
            unit.needs_final = True  # no signal for this call: handed over at the end of backward
            return
        register_multi_grad_hook(produced, lambda grads, u=unit: self.submit(u), mode="all")

    # -- backward: holding and handing over --------------------------------------------------
    def owns(self, param: torch.nn.Parameter) -> bool:
        return id(param) in self.owner

    def hold(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Keep ``param``'s gradient until its unit is handed over (summed if it comes twice)."""
        pending = self.owner[id(param)].pending
        held = pending.get(id(param))
        pending[id(param)] = grad if held is None else held.add_(grad)

    def submit(self, unit: _Unit) -> None:
        """Hand every parameter of ``unit`` to the reducer, in unit order (zeros where unused)."""
        pending, unit.pending = unit.pending, {}
        for p in unit.params:
            grad = pending.pop(id(p), None)
            if grad is None:  # not used by this rank (or not yet: a tied weight's outside use)
                grad = torch.zeros(_BY_ID[id(p)].shape, dtype=p.dtype, device=p.device)
            self.on_grad_ready(p, grad)
            del grad

    def end_of_backward(self) -> None:
        """Hand over the units still holding gradients or called without a signal (unit order)."""
        for unit in self.units:
            if unit.pending or unit.needs_final:
                unit.needs_final = False
                self.submit(unit)

    def pending_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for u in self.units for g in u.pending.values())
