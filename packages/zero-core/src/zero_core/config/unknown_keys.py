"""Finding unknown keys at any depth, before validation, so each can name its closest known key.

[Note: unknown config keys]
DeepSpeed silently ignores keys it does not know, so ``"gradient_clipp1ng": 1.0`` trains without
clipping. We reject them: ``gradient_clipp1ng: unknown key, did you mean gradient_clipping?``
(difflib's closest match among the keys the enclosing section accepts, with the full path). The
walk runs on the raw dict before pydantic, because pydantic's ``extra_forbidden`` error knows
neither the accepted keys nor a suggestion; the unknown keys are removed from the copy that is
validated, so every other problem is still reported in the same :class:`ConfigError`.

The check can be downgraded to a warning (the key is then dropped) with the config key
``"zero_allow_unknown_keys": true`` or the environment variable ``ZERO_CONFIG_UNKNOWN_KEYS=warn``
(``=error`` is the default). Keys starting with ``_`` (``"_comment"``, the usual stand-in for
comments in JSON) are dropped without a word at any depth. Sections whose model allows extra keys are not checked
(``amp`` passes its keys to Apex); permissive built-in plugin sections keep unknown keys and only
warn when one is close to a documented key (a likely typo).
"""

from __future__ import annotations

import difflib
import os
import types
import typing
import warnings
from typing import Any

from pydantic import BaseModel

from zero_core.config.base import input_keys
from zero_core.config.errors import ConfigError, join_path, suggest
from zero_core.config.ignored_keys import drop_ignored_key

ENV_VAR = "ZERO_CONFIG_UNKNOWN_KEYS"


def unknown_key_policy(raw: dict[str, Any]) -> str:
    """``"warn"`` or ``"error"``, from the config switch and the environment variable."""
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env not in ("", "warn", "error"):
        raise ConfigError([f'environment variable {ENV_VAR}={env!r} is not one of "warn", "error"'])
    switch = raw.get("zero_allow_unknown_keys", False)
    if not isinstance(switch, bool):
        raise ConfigError([f"zero_allow_unknown_keys: {switch!r} is not a boolean (use true or false)"])
    return "warn" if env == "warn" or switch else "error"


def nested_model(annotation: Any) -> type[BaseModel] | None:
    """The config model inside ``annotation`` (``Optional[M]``, ``Annotated[M, ...]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel) and annotation is not BaseModel:
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = nested_model(arg)
            if found is not None:
                return found
    return None


def strip_unknown_keys(
    data: dict[str, Any],
    model: type[BaseModel],
    path: str,
    policy: str,
    problems: list[str],
    sections: dict[str, type[BaseModel]] | None = None,
) -> dict[str, Any]:
    """A copy of ``data`` without unknown keys; each becomes a problem (or a warning with ``policy="warn"``).

    ``sections`` maps plugin-section names to their models (root level only).
    """
    accepted = input_keys(model)
    if sections:
        accepted.update({name: name for name in sections})
    extra = model.model_config.get("extra")
    mode = getattr(model, "unknown_keys", "error")
    if mode == "error" and extra != "forbid":
        mode = "allow"  # a model that accepts extra keys (ours or a plugin's) is not checked
    out: dict[str, Any] = {}
    for key, value in data.items():
        where = join_path(path, key)
        if key not in accepted:
            if drop_ignored_key(where):  # See [Note: keys DeepSpeed ignores]
                continue
            if isinstance(key, str) and key.startswith("_") and mode != "allow":
                continue  # a comment ("_comment": JSON has none); no config key starts with "_"
            if mode == "allow":
                out[key] = value
            elif mode == "warn_typos":
                out[key] = value
                close = difflib.get_close_matches(key, list(accepted), n=1, cutoff=0.75)
                if close:
                    warnings.warn(
                        f"{where}: {suggest(key, accepted)} (kept as is)", UserWarning, stacklevel=3
                    )
            elif policy == "warn":
                warnings.warn(f"{where}: {suggest(key, accepted)} (ignored)", UserWarning, stacklevel=3)
            else:
                problems.append(f"{where}: {suggest(key, accepted)}")
            continue
        sub = None
        if sections and key in sections:
            sub = sections[key]
        elif accepted[key] in model.model_fields:
            sub = nested_model(model.model_fields[accepted[key]].annotation)
        if sub is not None and isinstance(value, dict):
            value = strip_unknown_keys(value, sub, where, policy, problems)
        out[key] = value
    return out
