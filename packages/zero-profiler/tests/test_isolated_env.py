"""zero-profiler's own test environment holds torch and zero-profiler, nothing of the family.

zero-profiler declares only torch ("works without anything distributed"); ``hatch test`` builds
its environment from that declaration, so importing zero-core (or transformers, which no
profiler dependency pulls in) must fail there. In the development environment, which holds
every package, it would fail: ``hatch run test`` deselects it.
"""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.isolated_env


@pytest.mark.parametrize("module", ["zero_core", "zero", "transformers", "pydantic"])
def test_undeclared_dependency_is_not_importable(module: str) -> None:
    with pytest.raises(ModuleNotFoundError, match=module):
        importlib.import_module(module)


def test_profiler_imports_without_them() -> None:
    import zero_profiler

    assert zero_profiler.get_model_profile is not None
