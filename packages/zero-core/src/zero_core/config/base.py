"""The strict base model every config section derives from, and the small value types they share.

[Note: config models]
Every section of the DeepSpeed JSON config is a pydantic v2 model derived from
:class:`ConfigModel`, which

* forbids unknown keys (the loader reports them first, with a suggestion, see
  ``unknown_keys.py``; ``extra="forbid"`` is the safety net for direct ``model_validate``),
* accepts every DeepSpeed spelling of a key: the field name, its aliases (declared with
  ``validation_alias=AliasChoices(name, alias, ...)``) and the deprecated keys a section
  translates in its ``_translate_deprecated`` hook (with a ``FutureWarning`` naming the
  replacement),
* resolves ``"auto"`` (as written by the HuggingFace Trainer) on the fields marked with
  :data:`AUTO` to the field's default, so an HF config loads unchanged. Fields whose value can
  be derived (the three batch sizes) treat ``"auto"`` as "not given" and derive it instead.

Numbers written as floats (``5e8``) are accepted for integer fields when they are whole;
booleans are never accepted where a number is expected (``true`` is not a batch size).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)
from pydantic_core import PydanticCustomError

AUTO_VALUE = "auto"


class _AutoDefault:
    """Marker (used in ``Annotated``) for fields where ``"auto"`` means "use the default"."""

    def __repr__(self) -> str:
        return "AUTO"


AUTO = _AutoDefault()


def show(value: object, limit: int | None = None) -> str:
    """Render a config value as the user wrote it: JSON when possible, ``repr`` otherwise; cut to
    ``limit`` characters (ending in "...") when given, for whole sections quoted in a message."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    if limit is not None and len(text) > limit:
        text = text[: max(limit - 3, 0)] + "..."
    return text


def _reject_bool(value: object) -> object:
    # bool is an int subclass in Python and pydantic's lax mode would turn `true` into 1.
    if isinstance(value, bool):
        raise PydanticCustomError(
            "bool_not_number", "{value} is a boolean, expected a number", {"value": show(value)}
        )
    return value


NonNegInt = Annotated[int, BeforeValidator(_reject_bool), Field(ge=0)]
PosInt = Annotated[int, BeforeValidator(_reject_bool), Field(ge=1)]
Int = Annotated[int, BeforeValidator(_reject_bool)]
NonNegFloat = Annotated[float, BeforeValidator(_reject_bool), Field(ge=0)]
PosFloat = Annotated[float, BeforeValidator(_reject_bool), Field(gt=0)]
Float = Annotated[float, BeforeValidator(_reject_bool)]


def one_of(allowed: Iterable[Any], *, case_insensitive: bool = True, canonical: bool = True) -> Any:
    """An ``Annotated`` str/int type accepting only ``allowed``.

    With ``case_insensitive`` strings are matched ignoring case and, with ``canonical``, stored in
    the spelling of ``allowed`` (``"CPU"`` -> ``"cpu"``, ``"warn"`` -> ``"Warn"``).
    """
    allowed = tuple(allowed)
    listing = ", ".join(show(a) for a in allowed)
    by_lower = {str(a).lower(): a for a in allowed if isinstance(a, str)}

    def check(value: object) -> object:
        if isinstance(value, str) and case_insensitive and value.lower() in by_lower:
            return by_lower[value.lower()] if canonical else value
        if not isinstance(value, bool) and value in allowed:
            return value
        raise PydanticCustomError(
            "not_one_of", "{value} is not one of {allowed}", {"value": show(value), "allowed": listing}
        )

    kinds = {type(a) for a in allowed}
    base: Any = str if kinds == {str} else int if kinds == {int} else Any
    if base is int:
        return Annotated[int, BeforeValidator(_reject_bool), AfterValidator(check)]
    return Annotated[base, BeforeValidator(check)]


def aliases(name: str, *others: str) -> AliasChoices:
    """``validation_alias`` accepting the field name first, then each DeepSpeed alias."""
    return AliasChoices(name, *others)


def input_keys(model: type[BaseModel]) -> dict[str, str]:
    """Every key a model accepts in its input -> the field it fills (or the deprecated key itself)."""
    keys: dict[str, str] = {}
    for name, field in model.model_fields.items():
        keys[name] = name
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            for choice in alias.choices:
                if isinstance(choice, str):
                    keys[choice] = name
        elif isinstance(alias, str):
            keys[alias] = name
        if field.alias:
            keys[field.alias] = name
    for old in getattr(model, "deprecated_keys", {}):
        keys[old] = old
    return keys


class ConfigModel(BaseModel):
    """Base of every config section. See [Note: config models]."""

    model_config = ConfigDict(
        extra="forbid",
        validate_by_name=True,
        validate_by_alias=True,
        validate_assignment=True,
        arbitrary_types_allowed=False,
    )

    #: deprecated key -> its replacement, as shown in the warning. Translated by ``_translate_deprecated``.
    deprecated_keys: ClassVar[dict[str, str]] = {}
    #: where this section sits in the config, for messages (``"zero_optimization"``).
    config_path: ClassVar[str] = ""
    #: ``"error"``: unknown keys are errors (subject to the global switch); ``"warn_typos"``: the
    #: section is permissive (keeps unknown keys) and only warns about likely typos.
    unknown_keys: ClassVar[str] = "error"

    @model_validator(mode="before")
    @classmethod
    def _normalise_input(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if cls.deprecated_keys and any(k in data for k in cls.deprecated_keys):
            data = cls._translate_deprecated(data)
        for name, field in cls.model_fields.items():
            alias = field.validation_alias
            choices = (
                [c for c in alias.choices if isinstance(c, str)]
                if isinstance(alias, AliasChoices)
                else [name]
            )
            present = [c for c in choices if c in data]
            if len(present) > 1:
                values = {show(data[c]) for c in present}
                if len(values) > 1:
                    where = f"{cls.config_path}." if cls.config_path else ""
                    raise PydanticCustomError(
                        "alias_conflict",
                        "{keys} are spellings of the same key {name} but have different values {values}",
                        {
                            "keys": " and ".join(where + c for c in present),
                            "name": name,
                            "values": ", ".join(show(data[c]) for c in present),
                        },
                    )
                for extra in present[1:]:
                    del data[extra]
            if AUTO in field.metadata:
                for c in present:
                    if data.get(c) == AUTO_VALUE:
                        del data[c]
        return data

    @classmethod
    def _translate_deprecated(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Rewrite deprecated keys in ``data`` into their replacements (sections override)."""
        return data

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible dict of this section under its DeepSpeed field names."""
        return self.model_dump(mode="json")


class PermissiveSection(ConfigModel):
    """Built-in model of a section owned by another package. See [Note: config sections].

    Type-checks the keys DeepSpeed documents and keeps any other key unchanged, so a DeepSpeed
    config runs with only zero-core installed; the owning package's model replaces it.
    """

    model_config = ConfigDict(extra="allow")
    unknown_keys: ClassVar[str] = "warn_typos"
