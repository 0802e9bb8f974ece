"""zero-core's source holds two structural rules that review alone does not keep (read with ast,
nothing imported or run): no upward import from ``zero/`` or ``checkpoint/`` into ``engine/``
(the strategies and the checkpoint code sit below the engine that composes them; shared helpers
live in leaf modules such as ``utils/param_groups.py``), and no function longer than 80 lines
(the developers' guide: one concern per function)."""

from __future__ import annotations

import ast
from pathlib import Path

import zero_core

SRC = Path(zero_core.__file__).resolve().parent
MAX_FUNCTION_LINES = 80
#: functions allowed over the limit for now, each with the reason. Stage3Strategy.__init__ is being
#: rewritten by the MiCS/ZeRO++ work (its group setup); it is split once that lands.
LONG_FUNCTION_EXEMPT: set[tuple[str, str]] = set()


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


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
        and (str(path.relative_to(SRC)), node.name) not in LONG_FUNCTION_EXEMPT
    ]


def test_no_function_longer_than_80_lines() -> None:
    long = [f for p in _modules() for f in _long_functions(p)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(long)
