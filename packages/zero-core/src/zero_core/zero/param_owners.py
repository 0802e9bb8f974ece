"""Which strategy owns a parameter's partitioned state: a weak reference on the parameter to the
object the ``safe_get_*`` helpers dispatch to, and the per-strategy :class:`ParamLocation`.

[Note: parameter owners]
The debugging helpers of ``zero_core.zero.debug_access`` take only a parameter (as DeepSpeed's
``safe_get_full_fp32_param(param)`` does), so they need to find the object that partitions it
(see [Note: safe_get owner protocol]). There is no process-wide table for that: each strategy
puts a *weak reference* to its owner object on the parameters it trains when it is built
(:func:`register_owner`, the private attribute ``_zero_owner``) and takes it off in
``close()`` (the engine's ``destroy()``, :func:`release_owner`). The reference is weak so that
a parameter never keeps an engine alive: an engine dropped without ``destroy()`` leaves a dead
reference, which :func:`owner_of` reads as "no owner". A strategy built later over the same
parameters replaces the earlier owner, as re-initializing an engine over a module does, and the
earlier one's ``close()`` leaves the later one in place. Two engines over different models in
one process (a policy and a reference model) thus never meet: each parameter names its own.
A pickled parameter (``torch.save(model)``) drops the reference: no engine trains the copy.

Where a parameter sits inside its strategy (stages 1-2: its partition group and index in it)
is a :class:`ParamLocation` the strategy keeps in its own map; stage 3's per-parameter state
is its record ([Note: stage 3 parameter records]).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

_OWNER = "_zero_owner"  # the attribute holding the weak reference: See [Note: parameter owners]


class ParamLocation(NamedTuple):
    """Where a stage 1/2 parameter lives: partition group ``group`` (an index into the strategy's
    groups and masters) and position ``index`` among that group's parameters (its layout slot).
    Immutable; unpacks as ``g, i = location``."""

    group: int
    index: int


class _OwnerRef:
    """A weak reference to a parameter's owner that pickles as None (See [Note: parameter owners])."""

    __slots__ = ("ref",)

    def __init__(self, owner: object) -> None:
        self.ref = weakref.ref(owner)

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return _no_owner, ()


def _no_owner() -> None:
    return None


def register_owner(params: Iterable[torch.Tensor], owner: object) -> None:
    """Make ``owner`` the owner of every parameter of ``params`` (replacing any earlier one),
    held weakly (See [Note: parameter owners])."""
    ref = _OwnerRef(owner)
    for p in params:
        setattr(p, _OWNER, ref)


def release_owner(params: Iterable[torch.Tensor], owner: object) -> None:
    """Forget ``owner`` on the parameters of ``params`` it still owns (a later owner stays)."""
    for p in params:
        ref = p.__dict__.get(_OWNER)
        if ref is not None and (ref.ref() is owner or ref.ref() is None):
            delattr(p, _OWNER)


def owner_of(param: torch.Tensor) -> object | None:
    """The owner of ``param``, or None (stage 0 without an owner, frozen, not trained, or its
    engine is gone)."""
    ref = getattr(param, _OWNER, None)
    return None if ref is None else ref.ref()


__all__ = ["ParamLocation", "owner_of", "register_owner", "release_owner"]
