"""zero-profiler depends on torch alone except for ``zero_profiler.autotuning``, its ``autotuning`` extra.

The autotuner launches training jobs through zero-core's launcher and reads zero-core's config, so
that subpackage (and only it) imports zero-core; without zero-core the profiler and the memory
estimators work, and importing ``zero_profiler.autotuning`` says what to install. The test
environment holds zero-core (the ``test`` extra), so its absence is made here by hiding zero_core in a
fresh interpreter (``sys.modules["zero_core"] = None``: ``import`` and ``find_spec`` both miss it).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import zero_profiler

SRC = Path(zero_profiler.__file__).resolve().parent


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_only_autotuning_imports_zero_core() -> None:
    importers = sorted(
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if any(m == "zero_core" or m.startswith("zero_core.") for m in _imported_modules(p))
    )
    assert importers and all(p.startswith("autotuning/") for p in importers), importers


def test_without_zero_core_the_profiler_works_and_autotuning_names_the_extra() -> None:
    probe = textwrap.dedent(
        """
        import sys
        sys.modules["zero_core"] = None  # zero-core not installed
        import torch
        import zero_profiler
        from zero_profiler import get_model_profile, zero_paper_model_states_bytes

        model = torch.nn.Linear(8, 4)
        flops, macs, params = get_model_profile(
            model, input_shape=(2, 8), print_profile=False, as_string=False
        )
        assert (flops, macs, params) == (2 * 2 * 8 * 4, 2 * 8 * 4, 36), (flops, macs, params)  # 2 FLOPs a MAC
        assert zero_paper_model_states_bytes(1000, 4, 3) == 16 * 1000 / 4
        try:
            import zero_profiler.autotuning
        except ModuleNotFoundError as exc:
            assert exc.name == "zero_core", exc.name
            print(exc)
        else:
            raise SystemExit("zero_profiler.autotuning imported without zero-core")
        """
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    hint = "which is not installed: pip install packages/zero-core 'packages/zero-profiler[autotuning]'"
    assert hint in out.stdout, out.stdout
