"""Every field of the config as a dotted key, and the value a validated config holds for one.

[Note: config key truth]
A config key zero accepts is exactly one of three things (the rule ``test_config_truth.py``
enforces over every field of every section model, plugin sections included):

(a) read by the product, with a named test that shows its effect: the dotted key is in
    ``effect_tests.EFFECT_TESTS`` (key -> ``"test file::test name"``), and the test exists;
(b) not implemented: the key (or its whole section) is in ``unimplemented.UNIMPLEMENTED``, and
    setting it to a value other than the model's default is an error naming the key and saying
    what to use instead (``zero_allow_unknown_keys`` downgrades it to a warning);
(c) without effect: the key is in ``no_effect.NO_EFFECT`` because it cannot change what a run
    computes (a DeepSpeed tuning knob with no counterpart here); a non-default value warns
    once per process, naming the key and why.

"Non-default" is judged on the validated config against the default of the field in the model
that validated it, so every spelling of a key (aliases, deprecated names, ``"auto"``) counts
the same. The README's migration section lists the three sets (generated from these tables:
``tools/config_key_tables.py``; a test fails when it drifts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from zero_core.config import sections
from zero_core.config.root import ZeroConfig
from zero_core.config.unknown_keys import nested_model

#: the default of a field that has none (a required key such as ``optimizer.type``)
REQUIRED = object()


@dataclass(frozen=True)
class ConfigField:
    """One leaf field of the config: its dotted key and the default of the model declaring it."""

    key: str
    model: type[BaseModel]
    name: str
    default: Any


def _default(model: type[BaseModel], name: str) -> Any:
    field = model.model_fields[name]
    if field.default is PydanticUndefined and field.default_factory is None:
        return REQUIRED
    return field.get_default(call_default_factory=True)


def _section_models() -> dict[str, type[BaseModel]]:
    """Plugin sections -> the models validating them now (built-in, entry point or registered)."""
    return sections.config_sections()


def _walk(model: type[BaseModel], prefix: str, out: list[ConfigField]) -> None:
    for name, field in model.model_fields.items():
        sub = nested_model(field.annotation)
        if sub is not None:
            _walk(sub, f"{prefix}{name}.", out)
        else:
            out.append(ConfigField(f"{prefix}{name}", model, name, _default(model, name)))


def config_fields() -> list[ConfigField]:
    """Every leaf field of the config, in declaration order, with the plugin sections' current models."""
    plugin = _section_models()
    out: list[ConfigField] = []
    for name, field in ZeroConfig.model_fields.items():
        if name == "extra_sections":
            continue
        sub = plugin.get(name) or nested_model(field.annotation)
        if sub is not None:
            _walk(sub, f"{name}.", out)
        else:
            out.append(ConfigField(name, ZeroConfig, name, _default(ZeroConfig, name)))
    for name, model in plugin.items():  # registered sections that are new top-level keys
        if name not in ZeroConfig.model_fields:
            _walk(model, f"{name}.", out)
    return out


def value_at(cfg: ZeroConfig, key: str) -> tuple[bool, Any, Any]:
    """``(present, value, default)`` of dotted ``key`` in the validated ``cfg``.

    ``present`` is False when an enclosing optional section is absent (``offload_param`` is
    None) or the key names no field; ``default`` is the field's default in the model holding it.
    """
    obj: Any = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        if obj is None:
            return False, None, None
        if obj is cfg and part not in ZeroConfig.model_fields and part in _section_models():
            obj = cfg.section(part)
            continue
        fields = type(obj).model_fields if isinstance(obj, BaseModel) else {}
        if part not in fields:
            return False, None, None
        if i == len(parts) - 1:
            return True, getattr(obj, part), _default(type(obj), part)
        obj = getattr(obj, part)
    return False, None, None


def is_set(cfg: ZeroConfig, key: str) -> tuple[bool, Any]:
    """Whether ``cfg`` holds a value other than the default at ``key``, and that value."""
    present, value, default = value_at(cfg, key)
    return present and default is not REQUIRED and value != default, value
