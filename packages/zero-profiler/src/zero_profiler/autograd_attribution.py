"""Which module's backward an autograd node belongs to: exact, from node creation order.

[Note: exact backward attribution]
Every autograd node gets a sequence number when it is created, from a per-thread counter that
only grows (``torch._C._autograd._get_sequence_nr()`` peeks at the next one). So the nodes a
module's forward call created are exactly the nodes numbered in ``[lo, hi)``, where ``lo`` is
read when the call starts and ``hi`` when it ends, and since calls nest, so do their ranges: a
node belongs to the innermost call whose range holds its number. During backward the dispatch
mode asks ``_current_autograd_node()`` which node is running, and its work is credited to that
call's module stack (the module and its forward-time ancestors), whatever order autograd runs
the nodes in. Parallel branches, a module whose output feeds several consumers, a block whose
input gradient is ready before its other branch ran, and a module called from two parents are
therefore attributed by construction, not guessed from the order in which gradient hooks fire
(what ``torch.utils.module_tracker`` does). Nothing has to be reachable from a module's outputs,
and forward pays two counter reads per call (no graph walk).

Calls are stored in start order (so sorted by ``lo``) with their parent's index; a lookup
bisects to the last call starting at or before the node and climbs parents until one's range
holds it. The answer per node is cached.

Conventions that follow from what autograd executes:

* Nodes created outside every module call (the loss, user code) belong to no module: their work
  is "outside" the model, as in forward. ``AccumulateGrad`` nodes (sequence number ``2**64 - 1``,
  shared by all of them) belong to no module either: summing into an existing ``.grad`` is
  gradient accumulation across micro-batches, not the model's backward.
* When a tensor has several consumers, autograd sums their gradients as the last of them
  finishes; that addition runs under that consumer's node and is credited to its module.
* A module listed in ``ignore_list`` claims its range with the empty stack: its backward work is
  dropped, as its forward is, and so is in no parent's backward either.
* A forward replayed inside backward (activation checkpointing) is a call like any other; its
  stack starts with the stack of the node that replays it (see ``ModuleTracker._claim_stack``).
* Sequence numbers are per thread. A model whose forward creates nodes from several threads at
  once could alias two nodes; PyTorch's engine does not do that.

Only integers and module tuples are stored: profiling never keeps a graph or a saved tensor alive.
"""

from __future__ import annotations

from bisect import bisect_right

import torch

_next_sequence_nr = torch._C._autograd._get_sequence_nr
_current_autograd_node = torch._C._current_autograd_node

# A claimed stack that means "ignored": drop the work.
IGNORED: tuple = ()

_OPEN = float("inf")  # ``hi`` of a call that has not ended: it holds every later node


class GraphClaims:
    """Module calls as sequence-number ranges, and the lookup of the node autograd is running.

    See [Note: exact backward attribution]. ``enter`` and ``exit`` bracket one module call.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._los: list[int] = []  # start of each call, in start order
        self._his: list[float] = []
        self._stacks: list[tuple | None] = []
        self._parents: list[int] = []
        self._open: list[int] = []  # indices of the calls still running, innermost last
        self._cache: dict[int, tuple | None] = {}

    def enter(self) -> None:
        self._open.append(len(self._los))
        self._parents.append(self._open[-2] if len(self._open) > 1 else -1)
        self._los.append(_next_sequence_nr())
        self._his.append(_OPEN)
        self._stacks.append(None)

    def exit(self, stack: tuple) -> None:
        """End the innermost call; nodes it created are credited to ``stack``."""
        if not self._open:
            return  # the profile was reset while the call ran
        i = self._open.pop()
        self._his[i] = _next_sequence_nr()
        self._stacks[i] = stack

    def stack_of(self, seq: int) -> tuple | None:
        """The stack of the innermost call that created node number ``seq``, or None."""
        cached = self._cache.get(seq, self)
        if cached is not self:
            return cached  # type: ignore[return-value]
        i = bisect_right(self._los, seq) - 1
        while i >= 0 and seq >= self._his[i]:
            i = self._parents[i]
        stack = self._stacks[i] if i >= 0 else None
        if i < 0 or self._his[i] is not _OPEN:
            self._cache[seq] = stack  # final once the call has ended
        return stack

    def stack_of_current_node(self) -> tuple | None:
        """The stack of the node autograd is running, or None (no node, or a node of no module)."""
        node = _current_autograd_node()
        if node is None:
            return None
        return self.stack_of(node._sequence_nr())

    @property
    def calls(self) -> int:
        return len(self._los)
