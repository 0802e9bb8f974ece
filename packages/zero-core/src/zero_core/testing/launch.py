"""Launch ``zero run`` from a test, and read what an autotuning search wrote.

Shared by zero-profiler's autotuning tests and the cross-package ones (which cannot import each
other's test modules).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_zero(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    """``python -m zero_core.launcher run *args`` in ``cwd``; asserts success, returns stdout."""
    out = subprocess.run(
        [sys.executable, "-m", "zero_core.launcher", "run", *args],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out.stdout


def experiment_records(exps: Path) -> dict[str, dict]:
    """Every experiment record (``<name>.json``) of an autotuning ``exps_dir``, by name."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(exps.glob("*.json"))}


def write_json(path: Path, obj: object) -> Path:
    """Write ``obj`` as JSON to ``path`` and return the path (configs for a launch)."""
    path.write_text(json.dumps(obj))
    return path
