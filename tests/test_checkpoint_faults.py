"""Issue 25's checkpoint fault injection, end to end: the cases of ``tools/faults/checkpoint_cases.py``.

Each case injects a fault (kill -9 of a zero-pipe rank while it re-saves a tag, 1-3 flipped
bits, a forged header with recomputed checksums, an edited or resealed ``checkpoint.json``, a
world-size-2 checkpoint recorded as 1, a full disk, a ``..`` tag) and asserts the outcome: the
last good checkpoint loads, or the load fails naming the file. Small N here; the script's
``--full`` runs more.
"""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cases():
    spec = importlib.util.spec_from_file_location(
        "checkpoint_cases", os.path.join(ROOT, "tools", "faults", "checkpoint_cases.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checkpoint_faults_are_survived_or_named(tmp_path):
    mod = _cases()
    cases = mod.run_cases(str(tmp_path), kills=2, flips=1, seed=3)
    failed = [c for c in cases if c[3] != mod.OK]
    assert not failed, "\n".join(" | ".join(c) for c in failed)
    for prefix in ("kill", "flip", "forge", "edit checkpoint.json", "world size", "ENOSPC", "tag"):
        assert any(c[0].startswith(prefix) for c in cases), prefix
    assert sum(c[0].startswith("kill") for c in cases) == 2
    assert "0 losses" in mod.totals(cases) and "0 silent loads" in mod.totals(cases)
