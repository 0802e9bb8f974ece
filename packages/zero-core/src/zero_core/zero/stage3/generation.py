"""``unwrap_model_for_generation``: the bare model, with full parameters, for ``generate()``.

[Note: generation under ZeRO-3]
RLHF trainers (trl's ``unwrap_model_for_generation`` does this for DeepSpeed) generate with
the policy between training steps. Under stage 3 each module's forward gathers and releases
its parameters, which for autoregressive decoding means one all-gather per module per token.
Gathering everything once for the whole generation is far cheaper when it fits: inside the
context every parameter is gathered (held, as by ``GatheredParameters``) and the engine's
per-module hooks are paused, so ``generate()`` runs on the plain module at full speed; on
exit the hooks resume and the parameters are released. With ``gather_params=False`` (the
model does not fit gathered) the module is yielded with its hooks active, so each forward
gathers what it needs as usual. At stages 0-2 (and for a plain module) it only unwraps.
The context must be entered on every rank (gathering is collective).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any, gather_params: bool = True) -> Iterator[torch.nn.Module]:
    """Yield the module inside ``model`` (an engine or a module) ready for generation. Collective at stage 3."""
    module = getattr(model, "module", model)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"unwrap_model_for_generation: model must be an engine from zero.initialize or a torch.nn.Module, "
            f"got {type(model).__name__}"
        )
    hooks = getattr(getattr(model, "strategy", None), "hooks", None)
    if hooks is None or not gather_params:
        yield module
        return
    from zero_core.zero.stage3.gathered_parameters import GatheredParameters

    with GatheredParameters(list(module.parameters())):
        hooks.paused = True
        try:
            yield module
        finally:
            hooks.paused = False
