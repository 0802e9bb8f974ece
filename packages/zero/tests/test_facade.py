"""The ``zero`` facade: every documented name resolves from its owning package, and a
missing package is an ImportError naming the distribution to install."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import re

import pytest
import zero
import zero._lazy as lazy

README = pathlib.Path(__file__).resolve().parents[3] / "README.md"


def _resolve(dotted: str):
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for name in parts[1:]:
        obj = getattr(obj, name)
    return obj


def _migration_names() -> list[str]:
    """Every ``zero.…`` name in the README's migration table (second column)."""
    text = README.read_text()
    table = text[text.index("## Migrating from DeepSpeed") :]
    names = []
    for line in table.splitlines():
        if not line.startswith("| `deepspeed"):
            continue
        right = line.split("|")[2]
        for name in re.findall(r"`(zero\.[A-Za-z0-9_.]+)`", right):
            names.append(name)
    return sorted(set(names))


def test_version():
    assert zero.__version__ == "0.1.0"


@pytest.mark.parametrize("name", _migration_names())
def test_migration_table_names_resolve(name):
    assert _resolve(name) is not None


@pytest.mark.parametrize("name", sorted(zero._NAMES))
def test_top_level_names_resolve(name):
    assert getattr(zero, name) is not None


def test_names_come_from_owner():
    import zero_core
    import zero_core.lr_schedules

    assert zero.initialize is zero_core.initialize
    assert zero.lr_schedules.WarmupLR is zero_core.lr_schedules.WarmupLR


def test_missing_package_names_distribution(monkeypatch):
    real = importlib.util.find_spec

    def fake(name, *args):
        if name.split(".")[0] == "zero_pipe":
            return None
        return real(name, *args)

    monkeypatch.setattr(lazy.importlib.util, "find_spec", fake)
    with pytest.raises(ImportError, match=r"pip install packages/zero-pipe \(from a clone"):
        zero.pipe.PipelineModule  # noqa: B018
    with pytest.raises(ImportError, match=r"pip install packages/zero-pipe \(from a clone"):
        zero.PipelineModule  # noqa: B018


def test_unknown_name():
    with pytest.raises(AttributeError, match="no attribute 'not_a_thing'"):
        zero.not_a_thing  # noqa: B018


def test_zero_to_fp32_runs_as_a_module(tmp_path):
    """``python -m zero.utils.zero_to_fp32`` is the converter's command line (as with DeepSpeed's)."""
    import subprocess
    import sys

    run = [sys.executable, "-m", "zero.utils.zero_to_fp32"]
    usage = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0 and "checkpoint_dir" in usage.stdout, usage
    missing = subprocess.run(
        [*run, str(tmp_path), str(tmp_path / "out.safetensors")], capture_output=True, text=True
    )
    assert missing.returncode != 0 and "zero_to_fp32: error" in missing.stderr, missing


def test_optimizer_names_come_from_zero_ops():
    # the optimizers moved from zero-core to zero-ops (issue 38); DeepSpeed's paths stay
    import zero_ops.adam
    import zero_ops.lamb
    import zero_ops.onebit

    assert zero.ops.adam.OnebitAdam is zero_ops.onebit.OnebitAdam
    assert zero.ops.adam.ZeroOneAdam is zero_ops.onebit.ZeroOneAdam
    assert zero.ops.adam.FusedAdam is zero_ops.adam.FusedAdam
    assert zero.ops.adam.CPUAdam is zero_ops.adam.CPUAdam
    assert zero.ops.lamb.OnebitLamb is zero_ops.onebit.OnebitLamb
    assert zero.ops.lamb.FusedLamb is zero_ops.lamb.Lamb
