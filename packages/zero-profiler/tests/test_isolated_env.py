"""zero-profiler's own test environment holds torch, zero-profiler and its ``test`` extra, nothing else.

zero-profiler declares only torch ("works without anything distributed"); its ``autotuning``
extra adds zero-core (and matplotlib), and its ``test`` extra holds them for the autotuner's
tests. ``hatch test`` builds the environment from those declarations, so importing a package
none of them pulls in (the facade, the other family members, transformers) must fail there. That
the profiler itself needs nothing but torch is checked in any environment by
``test_autotuning_extra.py`` (zero-core hidden). In the development environment, which holds every
package, this would fail: ``hatch run test`` deselects it.
"""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.isolated_env


@pytest.mark.parametrize(
    "module", ["zero", "zero_ops", "zero_offload", "zero_pipe", "zero_moe", "zero_inference", "transformers"]
)
def test_undeclared_dependency_is_not_importable(module: str) -> None:
    with pytest.raises(ModuleNotFoundError, match=module):
        importlib.import_module(module)


def test_the_autotuning_extra_is_installed() -> None:
    import zero_profiler
    import zero_profiler.autotuning.autotuner

    assert zero_profiler.get_model_profile is not None
    assert callable(zero_profiler.autotuning.autotuner.autotune)
