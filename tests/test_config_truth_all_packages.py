"""The config key rule over every package's section models, and the README's lists of keys.

zero-core's ``test_config_truth.py`` walks the section models visible where it runs; packages
that register their own model (zero-pipe's ``pipeline``, through the ``zero.config_sections``
entry point) add or change fields only when installed. Here, with the whole family installed,
every field of every model is in exactly one of the three sets of [Note: config key truth],
every entry names a field, and README.md's block equals what ``tools/config_key_tables.py``
generates (run it with ``--write`` after changing a table).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAMILY = ("zero_pipe", "zero_moe", "zero_offload", "zero_profiler", "zero_ops", "zero_inference")


def _tables():
    spec = importlib.util.spec_from_file_location(
        "config_key_tables", ROOT / "tools" / "config_key_tables.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_whole_family_is_installed() -> None:
    missing = [m for m in FAMILY if importlib.util.find_spec(m) is None]
    assert not missing, f"this test checks the section models of every package; missing: {missing}"


def test_every_field_of_every_package_is_in_exactly_one_set() -> None:
    from zero_core.config import refresh_entry_points, sections
    from zero_core.config.effect_tests import EFFECT_TESTS
    from zero_core.config.key_paths import config_fields
    from zero_core.config.no_effect import NO_EFFECT
    from zero_core.config.unimplemented import UNIMPLEMENTED

    refresh_entry_points()
    from zero_pipe.config import PipelineSectionConfig

    assert sections.config_sections()["pipeline"] is PipelineSectionConfig
    keys = [f.key for f in config_fields()]
    assert "pipeline.lookahead" in keys

    def sets(key: str) -> list[str]:
        top = key.split(".")[0]
        b = key in UNIMPLEMENTED or (top in UNIMPLEMENTED and UNIMPLEMENTED[top].is_on is not None)
        return [s for s, hit in (("a", key in EFFECT_TESTS), ("b", b), ("c", key in NO_EFFECT)) if hit]

    wrong = {k: sets(k) for k in keys if len(sets(k)) != 1}
    assert not wrong, wrong
    entries = [*EFFECT_TESTS, *NO_EFFECT, *(k for k, e in UNIMPLEMENTED.items() if e.is_on is None)]
    assert not [k for k in entries if k not in keys], "entries naming no field of any package's model"


def test_readme_lists_the_three_sets() -> None:
    tables = _tables()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    migration = readme.split("\n## Migrating from DeepSpeed\n", 1)[1].split("\n## ", 1)[0]
    if tables.readme_block(migration) != tables.render():
        pytest.fail(
            "README.md's config key tables are out of date: run python tools/config_key_tables.py --write"
        )
