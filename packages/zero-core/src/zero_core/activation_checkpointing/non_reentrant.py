"""``non_reentrant_checkpoint``: activation checkpointing built on saved-tensor hooks.

[Note: non-reentrant checkpoint]
DeepSpeed offers ``deepspeed.checkpointing.non_reentrant_checkpoint`` beside the autograd-Function
``checkpoint`` (See [Note: how a checkpoint recomputes]). The non-reentrant form does not wrap the
block in one autograd Function: it runs the block with grad enabled but intercepts every tensor
autograd would save (``torch.autograd.graph.saved_tensors_hooks``), keeping none of them, and
recomputes the block the first time backward asks for one. That lifts the reentrant form's
limits: ``torch.autograd.grad`` works, gradients reach every input that requires grad with no
anchor tensor, keyword arguments and any output structure pass through, and backward can stop
part way through the block. PyTorch implements exactly this mechanism
(``torch.utils.checkpoint.checkpoint(use_reentrant=False)``); we use it, adding what our
``checkpoint`` guarantees: the recompute replays every RNG state of the forward, including the
model-parallel tracker's (See [Note: which generator the tracker tracks]), and the forward's
autocast state.

The storage options of ``configure`` (``partition_activations``, ``cpu_checkpointing``,
``contiguous_memory_optimization``) act on the inputs the reentrant form keeps; here the inputs
stay where the caller holds them, so those options do not apply, and a call made while any of
them is on warns once, saying so.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

from zero_core.activation_checkpointing.rng import RNGSnapshot

_WARNED = [False]


def _rng_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """(forward context, recompute context): the recompute runs with the forward's RNG states."""
    snapshot: list[RNGSnapshot] = []

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        snapshot.append(RNGSnapshot.capture())
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        outer = RNGSnapshot.capture()
        snapshot[0].restore()
        try:
            yield
        finally:
            outer.restore()

    return forward(), recompute()


def _warn_storage_options() -> None:
    from zero_core.activation_checkpointing.checkpointing import get_config

    cfg = get_config()
    on = [
        name
        for name in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
        if getattr(cfg, name, False)
    ]
    if on and not _WARNED[0]:
        _WARNED[0] = True
        warnings.warn(
            f"non_reentrant_checkpoint: activation_checkpointing options {on} apply to checkpoint() only; "
            "non_reentrant_checkpoint keeps its inputs where the caller holds them",
            UserWarning,
            stacklevel=3,
        )


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` keeping no activations; recompute them in backward.

    Same results as running ``function`` directly (RNG included). See [Note: non-reentrant checkpoint].
    """
    if not callable(function):
        raise TypeError(
            f"non_reentrant_checkpoint: 'function' must be callable, got {type(function).__name__}"
        )
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    _warn_storage_options()
    return torch.utils.checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=False,  # ours replays every generator, the tracker's included
        context_fn=_rng_contexts,
        **kwargs,
    )
