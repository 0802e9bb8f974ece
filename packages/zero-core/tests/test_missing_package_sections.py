"""A config section that only another package acts on fails loudly when that package is missing."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from zero_core.testing import run_multirank

BASE = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


def _initialize_without(module: str, section: dict) -> str:
    import zero_core

    real = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == module else real(name, *a)
    model = torch.nn.Linear(4, 4)
    try:
        zero_core.initialize(model=model, model_parameters=model.parameters(), config={**BASE, **section})
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        importlib.util.find_spec = real
    return "accepted"


@pytest.mark.parametrize(
    "module, section, dist",
    [
        ("zero_pipe", {"pipeline": {"stages": 2}}, "zero-pipe"),
    ],
)
def test_section_without_its_package_names_it(module: str, section: dict, dist: str) -> None:
    (msg,) = run_multirank(_initialize_without, 1, args=(module, section), timeout=120)
    name = next(iter(section))
    assert msg.startswith("MissingPackageError: "), msg
    assert f"the config's '{name}' section" in msg and f"'{dist}' package" in msg, msg
    assert f"pip install packages/{dist}" in msg, msg
