"""Config errors: one exception carrying every problem found, each as ``key.path: message``.

pydantic reports errors as ``loc`` tuples and terse English; users of a JSON config want the
dotted key path they wrote, the value they gave and what is allowed, e.g.
``zero_optimization.stage: 5 is not one of 0, 1, 2, 3``. :func:`format_validation_error` turns
a :class:`pydantic.ValidationError` into such lines.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import ValidationError

from zero_core.config.base import show


class ConfigError(ValueError):
    """An invalid zero/DeepSpeed config. ``problems`` lists each problem as ``path: message``;
    ``hint`` (not a problem itself) is a closing line on what to do about them."""

    def __init__(
        self, problems: Sequence[str], *, source: str | None = None, hint: str | None = None
    ) -> None:
        self.problems = list(problems)
        self.source = source
        self.hint = hint
        where = f" ({source})" if source else ""
        if len(self.problems) == 1:
            text = f"invalid config{where}: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            text = f"invalid config{where}, {len(self.problems)} problems:\n{lines}"
        if hint:
            text += f"\n{hint}"
        super().__init__(text)


def join_path(*parts: object) -> str:
    """``("zero_optimization", "offload_param", "device")`` -> ``zero_optimization.offload_param.device``;
    integers become ``[i]``."""
    out = ""
    for part in parts:
        if part in ("", None):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def suggest(key: str, candidates: Iterable[str]) -> str:
    """``unknown key, did you mean X?`` (closest known key by difflib), or the list of known keys."""
    candidates = sorted(set(candidates))
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if close:
        return f"unknown key, did you mean {close[0]}?"
    if len(candidates) <= 12:
        return f"unknown key; known keys are {', '.join(candidates)}"
    return "unknown key"


def _bound(kind: str, ctx: dict[str, Any]) -> str:
    return {
        "greater_than_equal": f">= {ctx.get('ge')}",
        "greater_than": f"> {ctx.get('gt')}",
        "less_than_equal": f"<= {ctx.get('le')}",
        "less_than": f"< {ctx.get('lt')}",
    }[kind]


def describe(error: dict[str, Any]) -> str:
    """One pydantic error (``ValidationError.errors()`` item) as a sentence about the value."""
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = show(error.get("input"))
    if kind in ("int_parsing", "int_type"):
        return f"{value} is not an integer"
    if kind == "int_from_float":
        return f"{value} is not a whole number"
    if kind in ("float_parsing", "float_type"):
        return f"{value} is not a number"
    if kind in ("bool_parsing", "bool_type"):
        return f"{value} is not a boolean (use true or false)"
    if kind == "string_type":
        return f"{value} is not a string"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        return f"{value} is out of range: must be {_bound(kind, ctx)}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"{value} is not an object (expected a JSON object of keys)"
    if kind in ("list_type", "tuple_type"):
        return f"{value} is not a list"
    if kind in ("too_short", "too_long"):
        return f"{value} has the wrong length: {error['msg']}"
    if kind == "missing":
        return "required key is missing"
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "literal_error":
        expected = str(ctx.get("expected", "")).replace(" or ", ", ")
        return f"{value} is not one of {expected}"
    if kind in ("value_error", "assertion_error"):
        msg = error["msg"]
        for prefix in ("Value error, ", "Assertion failed, "):
            msg = msg.removeprefix(prefix)
        return msg
    # Custom errors (not_one_of, alias_conflict, ...) already carry a full sentence.
    return error["msg"]


def format_validation_error(exc: ValidationError, prefix: str = "") -> list[str]:
    """Every error of ``exc`` as ``path: sentence``; ``prefix`` is the path of the validated section."""
    lines = []
    for error in exc.errors(include_url=False):
        path = join_path(prefix, *error["loc"])
        # Model-level validators may report several problems, one a line, each with its full path.
        for text in describe(error).split("\n"):
            lines.append(f"{path}: {text}" if path and not text.startswith(path) else text)
    return lines
