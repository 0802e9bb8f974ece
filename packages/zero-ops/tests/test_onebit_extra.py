"""zero-ops depends on torch alone except for ``zero_ops.onebit``, its ``onebit`` extra.

The 1-bit optimizers exchange through zero-core's compressed all-reduce, so that subpackage (and
only it) imports zero-core; without zero-core the rest of zero-ops works and importing
``zero_ops.onebit`` says what to install. zero-ops' own test environment holds zero-core (its
``test`` extra, for the onebit tests), so the absence is made here by hiding zero_core in a fresh
interpreter (``sys.modules["zero_core"] = None``: ``import`` and ``find_spec`` both miss it).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import zero_ops

SRC = Path(zero_ops.__file__).resolve().parent


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_only_onebit_imports_zero_core() -> None:
    importers = sorted(
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if any(m == "zero_core" or m.startswith("zero_core.") for m in _imported_modules(p))
    )
    assert importers and all(p.startswith("onebit/") for p in importers), importers


def test_without_zero_core_the_base_works_and_onebit_names_the_extra() -> None:
    probe = textwrap.dedent(
        """
        import sys
        sys.modules["zero_core"] = None  # zero-core not installed
        import torch
        import zero_ops, zero_ops.adagrad, zero_ops.aio, zero_ops.lion, zero_ops.transformer
        from zero_ops.adam import CPUAdam, FusedAdam
        from zero_ops.lamb import Lamb

        for cls in (CPUAdam, FusedAdam, Lamb):
            p = torch.nn.Parameter(torch.ones(4))
            opt = cls([p], lr=0.1)
            p.grad = torch.ones(4)
            opt.step()
            assert bool((p < 1).all()), cls
        try:
            import zero_ops.onebit
        except ModuleNotFoundError as exc:
            assert exc.name == "zero_core", exc.name
            print(exc)
        else:
            raise SystemExit("zero_ops.onebit imported without zero-core")
        """
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (
        "zero-core is not installed: pip install packages/zero-core 'packages/zero-ops[onebit]'" in out.stdout
    )
