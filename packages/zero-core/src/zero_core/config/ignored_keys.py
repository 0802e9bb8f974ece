"""Keys that DeepSpeed accepts and ignores inside sections it knows: accepted here too, loudly.

[Note: keys DeepSpeed ignores]
DeepSpeed reads several sections key by key (``optimizer``, ``flops_profiler`` ...) and never
looks at a key it does not read, so configs in the wild (DeepSpeed's own tests among them) carry
keys that do nothing there: ``"flops_profiler": {"step": 1}`` (the key is ``profile_step``),
``"optimizer": {"torch_adam": true}`` (DeepSpeed reads it from ``optimizer.params``). Rejecting
them as unknown would stop such a config from running at all; silently dropping them would
break our rule that a key we accept either works or says loudly that it does nothing. So each
one is listed here with what it does (nothing, and what was probably meant); the loader warns
with that text and drops the key before validation, so no section model or plugin ever sees it.
Keys not listed keep the unknown-key check of ``unknown_keys.py``.
"""

from __future__ import annotations

import warnings

#: "section.key" -> why it does nothing, in DeepSpeed as here.
IGNORED_KEYS: dict[str, str] = {
    "flops_profiler.step": (
        "DeepSpeed ignores it (the profiled step is flops_profiler.profile_step), and so does zero"
    ),
    "optimizer.torch_adam": (
        "DeepSpeed ignores it here (it reads torch_adam from optimizer.params), and so does zero; "
        "zero's Adam/AdamW are torch.optim's in any case"
    ),
    "optimizer.adam_w_mode": (
        "DeepSpeed ignores it here (it reads adam_w_mode from optimizer.params), and so does zero: "
        "move it into optimizer.params to choose between AdamW and Adam with L2 decay"
    ),
}


def drop_ignored_key(path: str) -> bool:
    """If ``path`` ("section.key") is a key DeepSpeed ignores, warn what it does and return True
    (the caller drops it). See [Note: keys DeepSpeed ignores]."""
    why = IGNORED_KEYS.get(path)
    if why is None:
        return False
    warnings.warn(f"config: {path} does nothing: {why}", UserWarning, stacklevel=4)
    return True
