"""zero-core's own test environment holds only what zero-core declares.

``hatch test`` gives every package an environment with its declared dependencies and its
``test`` extra and nothing else, so an undeclared import fails there rather than on a user's
machine. This test holds that isolation: zero-core depends on none of its sibling packages
(dependencies point one way), so importing one of them must fail here. In the development
environment, which holds every package, it would fail: ``hatch run test`` deselects it.
"""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.isolated_env

SIBLINGS = ["zero_offload", "zero_pipe", "zero_moe", "zero_inference", "zero_profiler", "zero_ops", "zero"]


@pytest.mark.parametrize("module", SIBLINGS)
def test_undeclared_sibling_is_not_importable(module: str) -> None:
    with pytest.raises(ModuleNotFoundError, match=module):
        importlib.import_module(module)


def test_missing_sibling_is_named_with_its_install_command() -> None:
    from zero_core.plugins import MissingPackageError, require

    with pytest.raises(MissingPackageError, match=r"'zero-pipe'.*pip install packages/zero-pipe"):
        require("zero_pipe", "a PipelineModule")
