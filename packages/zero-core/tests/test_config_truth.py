"""No config key is accepted and then ignored: the rule of [Note: config key truth].

Every field of every config model (nested sections and the plugin sections registered now
included) is exactly one of: (a) implemented, with an existing test of its effect
(``EFFECT_TESTS``); (b) not implemented, a non-default value is an error naming the key and
what to do instead (``UNIMPLEMENTED``); (c) without effect, a non-default value warns once,
naming the key (``NO_EFFECT``). A new field in none of them fails here, as does a field in two.
With every package installed, ``tests/test_config_truth_all_packages.py`` checks the same over
the other packages' section models and that the README lists the three sets.
"""

from __future__ import annotations

import ast
import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
from zero_core.config import ConfigError, load_config, sections
from zero_core.config.effect_tests import EFFECT_TESTS
from zero_core.config.key_paths import REQUIRED, config_fields
from zero_core.config.no_effect import NO_EFFECT, reset_no_effect_warnings
from zero_core.config.unimplemented import UNIMPLEMENTED

ROOT = Path(__file__).resolve().parents[3]
BASE = {"train_batch_size": 8}


def _category(key: str) -> list[str]:
    top = key.split(".")[0]
    found = []
    if key in EFFECT_TESTS:
        found.append("a")
    if key in UNIMPLEMENTED or (top in UNIMPLEMENTED and UNIMPLEMENTED[top].is_on is not None):
        found.append("b")
    if key in NO_EFFECT:
        found.append("c")
    return found


def test_every_field_is_in_exactly_one_category() -> None:
    fields = config_fields()
    assert len(fields) > 150  # the walk reached the nested sections and the plugin sections
    wrong = {f.key: _category(f.key) for f in fields if len(_category(f.key)) != 1}
    assert not wrong, (
        "config keys must be in exactly one of EFFECT_TESTS (implemented, with an effect test), "
        "UNIMPLEMENTED (an error when set) and NO_EFFECT (a warning when set); see [Note: config key truth]: "
        f"{wrong}"
    )


def test_every_entry_names_a_field() -> None:
    """An entry whose key is no field is stale, unless its section's model comes from a package
    not installed here (the all-packages test checks those)."""
    known = {f.key for f in config_fields()}
    plugin = set(sections.config_sections())
    entries = [*EFFECT_TESTS, *NO_EFFECT, *(k for k, e in UNIMPLEMENTED.items() if e.is_on is None)]
    stale = [k for k in entries if k not in known and k.split(".")[0] not in plugin]
    assert not stale, f"entries that name no config field: {stale}"


@functools.cache
def _test_names(path: str) -> frozenset[str]:
    tree = ast.parse((ROOT / path).read_text())
    return frozenset(
        node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    )


def test_every_effect_test_exists() -> None:
    missing = []
    for key, ref in EFFECT_TESTS.items():
        path, sep, name = ref.partition("::")
        if not sep or not name.startswith("test_"):
            missing.append(f"{key}: {ref!r} is not 'file::test_name'")
        elif not (ROOT / path).is_file():
            missing.append(f"{key}: no file {path}")
        elif name not in _test_names(path):
            missing.append(f"{key}: {path} has no test {name}")
    assert not missing, "\n".join(missing)


def _sample(key: str) -> Any:
    """A valid value other than the default for the field ``key``."""
    field = next(f for f in config_fields() if f.key == key)
    info = field.model.model_fields[field.name]
    default = field.default
    if isinstance(default, bool):
        return not default
    if key.endswith("noisy_gate_policy"):
        return "Jitter"
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default + 1.0
    if isinstance(default, str):
        return "bf16" if key.endswith("data_type") else default + "x"
    if default is None and "dict" in str(info.annotation):
        return {"err_beta": 0.8}
    if default is None and "float" in str(info.annotation):
        return 1.0
    raise AssertionError(f"no sample value for {key} (default {default!r}, {info.annotation})")


def _raw(key: str, value: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = dict(BASE)
    node = cfg
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    if key.startswith("zero_optimization."):
        cfg["zero_optimization"].setdefault("stage", 3 if "zero_quantized" in key else 0)
    if key.startswith("optimizer."):
        cfg["optimizer"].setdefault("type", "Adam")
    return cfg


UNIMPLEMENTED_KEYS = sorted(k for k, e in UNIMPLEMENTED.items() if e.is_on is None)


@pytest.mark.parametrize("key", UNIMPLEMENTED_KEYS)
def test_unimplemented_key_set_is_an_error_naming_it_and_what_to_do(key: str) -> None:
    entry = UNIMPLEMENTED[key]
    with pytest.raises(ConfigError) as info:
        load_config(_raw(key, _sample(key)), world_size=1)
    text = str(info.value)
    assert f"{key}: " in text and entry.what in text and entry.instead in text, text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(_raw(key, next(f.default for f in config_fields() if f.key == key)), world_size=1)


@pytest.mark.parametrize("key", sorted(NO_EFFECT))
def test_no_effect_key_set_warns_once_naming_it(key: str) -> None:
    reset_no_effect_warnings()
    with pytest.warns(UserWarning, match=f"{key} is set but has no effect in zero: "):
        load_config(_raw(key, _sample(key)), world_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        load_config(_raw(key, _sample(key)), world_size=1)
        default = next(f.default for f in config_fields() if f.key == key)
        reset_no_effect_warnings()
        load_config(_raw(key, default), world_size=1)  # the default is silent


def test_aliases_count_as_the_key() -> None:
    # DeepSpeed's stage3_-prefixed alias is judged as the key itself (a stage-3 key below stage 3 warns)
    with pytest.warns(
        UserWarning, match="zero_optimization.use_all_reduce_for_fetch_params: applies to stage 3"
    ):
        load_config(
            {**BASE, "zero_optimization": {"stage": 1, "stage3_use_all_reduce_for_fetch_params": True}}
        )


def test_required_fields_have_no_default() -> None:
    required = sorted(f.key for f in config_fields() if f.default is REQUIRED)
    assert required == ["optimizer.type", "scheduler.type"], required
