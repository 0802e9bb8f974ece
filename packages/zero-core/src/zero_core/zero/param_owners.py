"""Which strategy owns a parameter's partitioned state: typed per-parameter records kept by the
strategies, and the process-wide registry the ``safe_get_*`` helpers look owners up in.

[Note: parameter owner registry]
The debugging helpers of ``zero_core.zero.debug_access`` take only a parameter (as DeepSpeed's
``safe_get_full_fp32_param(param)`` does), so they need to find the object that partitions it
(see [Note: safe_get owner protocol]). Rather than patching attributes onto ``nn.Parameter``
(FSDP2 keeps its per-parameter state in ``FSDPParam`` records, not on the parameter), each
strategy registers its parameters in :data:`PARAM_OWNERS` when it is built and removes them in
``close()`` (the engine's ``destroy()``). The registry holds parameters weakly, by identity
(``torch.utils.weak.WeakIdKeyDictionary``: a tensor's ``==`` is elementwise, so a plain
``WeakKeyDictionary`` cannot compare keys), so a dropped model leaves no entry behind. A
strategy built later over the same parameters replaces the earlier owner, as re-initializing
an engine over a module does.

Where a parameter sits inside its strategy (stages 1-2: its partition group and index in it)
is a :class:`ParamLocation` the strategy keeps in its own map.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary


class ParamLocation(NamedTuple):
    """Where a stage 1/2 parameter lives: partition group ``group`` (an index into the strategy's
    groups and masters) and position ``index`` among that group's parameters (its layout slot).
    Immutable; unpacks as ``g, i = location``."""

    group: int
    index: int


class ParamOwnerRegistry:
    """Parameter -> the object implementing the safe_get owner protocol for it.
    See [Note: parameter owner registry]."""

    def __init__(self) -> None:
        self._owners: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def register(self, params: Iterable[torch.Tensor], owner: object) -> None:
        """Make ``owner`` the owner of every parameter of ``params`` (replacing any earlier one)."""
        for p in params:
            self._owners[p] = owner

    def release(self, params: Iterable[torch.Tensor], owner: object) -> None:
        """Forget the parameters of ``params`` still owned by ``owner`` (a later owner stays)."""
        for p in params:
            if self._owners.get(p) is owner:
                del self._owners[p]

    def owner_of(self, param: torch.Tensor) -> object | None:
        """The owner of ``param``, or None (stage 0 without an owner, frozen, or not trained)."""
        return self._owners.get(param)


# The one registry of this process; entries live as long as their parameter and owning strategy.
PARAM_OWNERS = ParamOwnerRegistry()

__all__ = ["PARAM_OWNERS", "ParamLocation", "ParamOwnerRegistry"]
