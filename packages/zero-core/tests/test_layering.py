"""zero-core's own structural rule that review alone does not keep (read with ast, nothing
imported or run): no upward import from ``zero/`` or ``checkpoint/`` into ``engine/`` (the
strategies and the checkpoint code sit below the engine that composes them; shared helpers live
in leaf modules such as ``utils/param_groups.py``). The rules of every package (no import circle,
no function longer than 80 lines, one atomic writer) are the repository's
``tests/test_structure.py``."""

from __future__ import annotations

import ast
from pathlib import Path

import zero_core

SRC = Path(zero_core.__file__).resolve().parent


def _modules(*subpackages: str) -> list[Path]:
    roots = [SRC / s for s in subpackages] if subpackages else [SRC]
    return sorted(p for root in roots for p in root.rglob("*.py"))


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def test_zero_and_checkpoint_do_not_import_the_engine() -> None:
    upward = [
        f"{p.relative_to(SRC)}:{line}: {name}"
        for p in _modules("zero", "checkpoint")
        for line, name in _imports(p)
        if name == "zero_core.engine" or name.startswith("zero_core.engine.")
    ]
    assert not upward, "upward imports into zero_core.engine:\n" + "\n".join(sorted(set(upward)))


def test_the_import_walker_sees_function_level_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text(
        "def g():\n    from zero_core.engine.engine import ZeroEngine\n    import zero_core.engine\n"
    )
    assert {n for _, n in _imports(f)} >= {"zero_core.engine.engine", "zero_core.engine"}
