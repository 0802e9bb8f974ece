"""Which module's backward an autograd node belongs to: exact, from the graph itself.

[Note: exact backward attribution]
Every autograd node gets a sequence number when it is created, from a per-thread counter that
only grows (``torch._C._autograd._get_sequence_nr()`` peeks at the next one). So the nodes a
module's forward call created are exactly the nodes with a sequence number in
``[lo, hi)``, where ``lo`` is read when the call starts and ``hi`` when it ends. When a call ends
we walk the graph back from its outputs' ``grad_fn`` and map each node in that range to the
call's module stack (the module and its forward-time ancestors). During backward the dispatch
mode asks ``_current_autograd_node()`` which node is running and looks its sequence number up:
the work is credited to that stack, whatever order autograd runs the nodes in. Parallel
branches, a module whose output feeds several consumers, and a module called from two
different parents are therefore attributed by construction, not by guessing from the order in
which gradient hooks fire (what ``torch.utils.module_tracker`` does).

Calls nest, and children end before their parent, so a child has already claimed its nodes
when the parent walks. Each finished call keeps its *frontier* (the nodes outside its range at
which its walk stopped); the parent's walk jumps from any node of a child's range straight to
that child's frontier, so every node is visited once per forward, not once per depth level.
A node of a child's range that the child's walk could not reach (the child stored a tensor
that the parent used later) is claimed for the child when the parent finds it.

Conventions that follow from what autograd executes:

* Nodes created outside every module call (the loss, user code) belong to no module: their
  work is "outside" the model, as in forward. ``AccumulateGrad`` nodes (sequence number
  ``2**64 - 1``, shared by all of them) belong to no module either: summing into an existing
  ``.grad`` is gradient accumulation across micro-batches, not the model's backward.
* When a tensor has several consumers, autograd sums their gradients as the last of them
  finishes; that addition runs under that consumer's node and is credited to its module.
* A module listed in ``ignore_list`` claims its nodes with the empty stack: their work is
  dropped, as its forward is, and is therefore not in any parent's backward either.
* Nodes are keyed by sequence number, which is unique per thread. A model whose forward
  creates nodes from several threads at once could alias two nodes; the engine does not do that.

Only integers and module tuples are stored: no reference to a node outlives the forward call,
so profiling never keeps a graph (or its saved tensors) alive.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

_next_sequence_nr = torch._C._autograd._get_sequence_nr
_current_autograd_node = torch._C._current_autograd_node

# Sequence number of every AccumulateGrad node (it is created with UINT64_MAX).
ACCUMULATE_GRAD_SEQUENCE_NR = 2**64 - 1

# A claimed stack that means "ignored": drop the work.
IGNORED: tuple = ()


class _Call:
    """A finished forward call: its node range, stack and frontier."""

    __slots__ = ("frontier", "hi", "lo", "stack")

    def __init__(self, lo: int, hi: int, stack: tuple, frontier: list) -> None:
        self.lo = lo
        self.hi = hi
        self.stack = stack
        self.frontier = frontier


class GraphClaims:
    """Maps autograd nodes to the module stack whose forward call created them.

    See [Note: exact backward attribution]. ``enter`` and ``exit`` bracket one module call;
    ``stack_of_current_node`` is asked during backward.
    """

    def __init__(self) -> None:
        self.owner: dict[int, tuple] = {}
        # One entry per open call: [lo, los of finished child calls, the child calls].
        self._open: list[list[Any]] = []

    def clear(self) -> None:
        self.owner = {}
        self._open = []

    def enter(self) -> None:
        self._open.append([_next_sequence_nr(), [], []])

    def exit(self, output: Any, stack: tuple | None) -> None:
        """End the innermost call; ``stack=None`` claims nothing (no graph was recorded)."""
        lo, child_los, children = self._open.pop()
        if stack is None:
            return
        hi = _next_sequence_nr()
        if hi == lo:
            return  # the call created no node
        frontier = self._walk(output, lo, hi, stack, child_los, children)
        if self._open:
            parent = self._open[-1]
            parent[1].append(lo)
            parent[2].append(_Call(lo, hi, stack, frontier))

    def _walk(self, output: Any, lo: int, hi: int, stack: tuple, child_los: list, children: list) -> list:
        owner = self.owner
        work = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen: set[int] = set()
        jumped: set[int] = set()
        frontier: list = []
        while work:
            node = work.pop()
            if node is None:
                continue
            seq = node._sequence_nr()
            if seq in seen:
                continue
            seen.add(seq)
            if not lo <= seq < hi:
                if seq != ACCUMULATE_GRAD_SEQUENCE_NR:
                    frontier.append(node)
                continue
            i = bisect_right(child_los, seq) - 1
            child = children[i] if i >= 0 and seq < children[i].hi else None
            if child is None:
                owner[seq] = stack
            elif seq in owner:
                if i not in jumped:
                    jumped.add(i)
                    work.extend(child.frontier)
                continue
            else:
                owner[seq] = child.stack
            work.extend(fn for fn, _ in node.next_functions)
        return frontier

    def stack_of_current_node(self) -> tuple | None:
        """The stack of the node autograd is running, or None (no node, or a node of no module)."""
        node = _current_autograd_node()
        if node is None:
            return None
        return self.owner.get(node._sequence_nr())
