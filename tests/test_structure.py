"""Structural rules of every package's source (and of tools/), read with ``ast``: nothing is
imported or run, so the rules hold in any environment that has the repository.

* No import circle, inside a package or across packages. An import inside a function (a lazy
  import) counts like one at module level: it still makes each module need the other, and only
  moves the failure from import time to the first call. An import under ``if TYPE_CHECKING:``
  does not count: it never runs. What two modules share lives in the module that owns it, or in
  a leaf module both import.
* No function longer than 80 lines (the developers' guide: one concern per function), in
  ``packages/*/src`` and in ``tools/``: the tools are code users run (the converters, the fault
  harness, the test runner) or read as the reference of a measurement (the benchmarks).
* No file renamed into place outside the one atomic writer and the places that cannot import it
  (see [Note: one atomic writer] in ``zero_core/checkpoint/atomic.py``).
* Typed seams: lines annotated ``: Any`` or ``-> Any`` in ``packages/*/src`` stay under
  :data:`MAX_ANY_PER_1000_LINES` per 1,000 source lines (FSDP2 is near 4). Use the real type (a
  tensor, module, process group, config section, protocol), ``object`` for a value that is only
  checked or passed on, and ``if TYPE_CHECKING:`` imports where a real import would close a circle.

zero-core's ``tests/test_layering.py`` keeps the rule on the direction of imports inside
zero-core (``zero/`` and ``checkpoint/`` below ``engine/``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(ROOT.glob("packages/*/src"))
TOOLS = ROOT / "tools"
MAX_FUNCTION_LINES = 80
#: the most lines annotated ``Any`` per 1,000 lines of ``packages/*/src`` (see the module docstring)
MAX_ANY_PER_1000_LINES = 8
#: (file relative to the repository, function) allowed over the limit, with the reason. The
#: benchmark drivers below predate the rule in tools/ (a measurement, then its report, in one
#: function); they are split when next edited, and no new entry may be added.
LONG_FUNCTION_EXEMPT: set[tuple[str, str]] = {
    ("tools/bench/bench_aio.py", "main"),
    ("tools/bench/bench_checkpoint.py", "_report"),
    ("tools/bench/bench_offload.py", "main"),
    ("tools/bench/bench_pipe.py", "_bench_rank"),
    ("tools/bench/bench_pipe.py", "_write"),
    ("tools/bench/bench_profiler.py", "make_tools"),
    ("tools/bench/bench_stage0.py", "main"),
    ("tools/bench/bench_zero3.py", "_build"),
}
#: the files that may rename a file into place, each for the reason [Note: one atomic writer] gives
RENAMES_ALLOWED = {
    "packages/zero-core/src/zero_core/checkpoint/atomic.py",  # the one writer
    "packages/zero-core/src/zero_core/checkpoint/staged.py",  # publishes a directory, not a file
    "packages/zero-core/src/zero_core/checkpoint/zero_to_fp32.py",  # runs without zero_core
    "packages/zero-profiler/src/zero_profiler/profiler.py",  # depends on torch alone
    "tools/env_prefetch.py",  # runs under hatch before any package is installed
}


# -- the import graph ------------------------------------------------------------------------------
def module_files(src_roots: Iterable[Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under the source roots."""
    out: dict[str, Path] = {}
    for root in src_roots:
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(tree: ast.AST) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` of every import that can run: at module level or inside a
    function, not under ``if TYPE_CHECKING:`` (its ``else:`` runs, so it counts). ``name`` is
    the imported name of a ``from`` import, None for ``import module``."""
    out: list[tuple[int, str, str | None]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_node(stmt)
            else:
                visit_node(child)

    def visit_node(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.extend((node.lineno, node.module, alias.name) for alias in node.names)
        visit(node)

    visit(tree)
    return out


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """The names a module binds outside functions and classes; None when it has a module
    ``__getattr__`` (any name may then be found)."""
    names: set[str] = set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        else:  # if / try / with / for blocks at module level bind names too
            todo.extend(c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt))
    return names


def _target(
    module: str, name: str | None, modules: dict[str, Path], bound: dict[str, set[str] | None]
) -> str | None:
    """The scanned module an import needs, or None when it is outside the scanned sources.

    ``from pkg import name`` needs ``pkg.name`` when that is a module file, else ``pkg`` itself;
    a name that is neither a module file nor bound by ``pkg/__init__.py`` is a compiled
    extension module (``zero_ops._C``), outside the graph.
    """
    if name is not None and f"{module}.{name}" in modules:
        return f"{module}.{name}"
    if name is not None and module in modules and modules[module].name == "__init__.py":
        names = bound.setdefault(module, _top_level_names(ast.parse(modules[module].read_text())))
        return module if names is None or name in names else None
    while module and module not in modules:  # ``import a.b.c`` of a c that is not a file
        module = module.rpartition(".")[0]
    return module or None


def import_graph(src_roots: Iterable[Path]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}, over the source roots."""
    modules = module_files(src_roots)
    bound: dict[str, set[str] | None] = {}
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for mod, path in modules.items():
        for line, module, name in imports_of(ast.parse(path.read_text(), str(path))):
            target = _target(module, name, modules, bound)
            if target is not None and target != mod:
                graph[mod].setdefault(target, line)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _describe(component: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    inside = set(component)
    edges = [
        f"    {modules[a].relative_to(ROOT)}:{line} imports {b}"
        for a in component
        for b, line in sorted(graph[a].items())
        if b in inside
    ]
    return f"  {' <-> '.join(component)}\n" + "\n".join(edges)


def test_no_import_circles() -> None:
    graph = import_graph(SOURCES)
    found = circles(graph)
    modules = module_files(SOURCES)
    assert not found, (
        "import circles (lazy imports count; move what both sides need to the module that owns it, "
        "or to a leaf module):\n" + "\n".join(_describe(c, graph, modules) for c in found)
    )


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "src"


def test_a_lazy_import_closing_a_circle_is_found(tmp_path: Path) -> None:
    src = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import helper\n",
            "pkg/b.py": "def helper():\n    from pkg.a import thing\n    return thing\n",
            "pkg/c.py": "import pkg.a\n",
        },
    )
    assert circles(import_graph([src])) == [["pkg.a", "pkg.b"]]


def test_circles_through_a_package_init_and_across_packages_are_found(tmp_path: Path) -> None:
    src = _package(
        tmp_path / "one",
        {
            "pkg/__init__.py": "VERSION = '1'\nfrom pkg.core import run\n",
            "pkg/core.py": "def run():\n    from pkg import VERSION\n    return VERSION\n",
            "pkg/y.py": "def f():\n    from lib import m\n",
        },
    )
    other = _package(tmp_path / "two", {"lib/__init__.py": "", "lib/m.py": "import pkg.y\n"})
    assert circles(import_graph([src, other])) == [["lib.m", "pkg.y"], ["pkg", "pkg.core"]]


def test_type_checking_imports_and_compiled_modules_are_not_edges(tmp_path: Path) -> None:
    src = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": (
                "from typing import TYPE_CHECKING\nimport pkg.b\nif TYPE_CHECKING:\n    from pkg.c import C\n"
            ),
            "pkg/b.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.a import A\n",
            "pkg/c.py": "def load():\n    from pkg import _C\n    import pkg.a\n",
        },
    )
    assert circles(import_graph([src])) == []
    (src / "pkg" / "b.py").write_text("if TYPE_CHECKING:\n    pass\nelse:\n    from pkg.a import A\n")
    assert circles(import_graph([src])) == [["pkg.a", "pkg.b"]]


# -- function length -------------------------------------------------------------------------------
def long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    return [
        f"{rel}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
        and (rel, node.name) not in LONG_FUNCTION_EXEMPT
    ]


def _code_files() -> list[Path]:
    return sorted(p for root in [*SOURCES, TOOLS] for p in root.rglob("*.py"))


def test_no_function_longer_than_80_lines() -> None:
    long = [f for p in _code_files() for f in long_functions(p)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(long)


def test_the_exemptions_still_exist_and_are_still_long() -> None:
    tree_of = {rel: ast.parse((ROOT / rel).read_text()) for rel, _ in LONG_FUNCTION_EXEMPT}
    stale = []
    for rel, name in sorted(LONG_FUNCTION_EXEMPT):
        lengths = [
            n.end_lineno - n.lineno + 1
            for n in ast.walk(tree_of[rel])
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
        ]
        if not any(length > MAX_FUNCTION_LINES for length in lengths):
            stale.append(f"{rel} {name}")
    assert not stale, (
        "exempt functions now within the limit (remove them from LONG_FUNCTION_EXEMPT):\n" + "\n".join(stale)
    )


def test_the_length_rule_sees_methods_and_nested_functions(tmp_path: Path) -> None:
    body = "".join(f"        x{i} = {i}\n" for i in range(80))
    f = tmp_path / "m.py"
    f.write_text(f"class A:\n    def short(self):\n        pass\n\n    def long(self):\n{body}")
    assert [line.split()[1] for line in long_functions(f)] == ["long"]


# -- one atomic writer -----------------------------------------------------------------------------
def _is_rename(node: ast.Call) -> bool:
    """``os.replace``, ``os.rename``, ``shutil.move``, or ``path.replace(target)`` /
    ``path.rename(target)`` (pathlib's: one argument, where ``str.replace`` takes two)."""
    func = node.func
    if not isinstance(func, ast.Attribute):
        return False
    if isinstance(func.value, ast.Name) and (func.value.id, func.attr) in {
        ("os", "replace"),
        ("os", "rename"),
        ("shutil", "move"),
    }:
        return True
    return func.attr in ("replace", "rename") and len(node.args) == 1 and not node.keywords


def renames(path: Path) -> list[int]:
    """Lines renaming a file (see :func:`_is_rename`)."""
    tree = ast.parse(path.read_text(), str(path))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and _is_rename(node)]


def test_files_are_renamed_into_place_only_by_the_atomic_writer() -> None:
    found = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in _code_files()
        if p.relative_to(ROOT).as_posix() not in RENAMES_ALLOWED
        for line in renames(p)
    ]
    assert not found, (
        "temporary file renamed into place by hand; write through zero_core.checkpoint.atomic "
        "(atomic_write_text / _json / _safetensors, atomic_path; see [Note: one atomic writer]):\n"
        + "\n".join(found)
    )
    for rel in RENAMES_ALLOWED:
        assert (ROOT / rel).is_file(), f"{rel} is gone: drop it from RENAMES_ALLOWED"


def test_the_rename_finder_sees_os_and_pathlib_renames_not_str_replace(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text(
        "import os, shutil\n"
        "os.replace(a, b)\n"
        "os.rename(a, b)\n"
        "shutil.move(a, b)\n"
        "tmp.replace(final)\n"
        "name.replace('-', '_')\n"
        "cfg.replace(x=1)\n"
    )
    assert renames(f) == [2, 3, 4, 5]


_ANY_ANNOTATION = re.compile(r":\s*Any\b|-> Any\b")


def any_annotation_lines(path: Path) -> tuple[int, int]:
    """(lines annotated ``: Any`` / ``-> Any``, all lines) of one source file."""
    lines = path.read_text().splitlines()
    return sum(1 for line in lines if _ANY_ANNOTATION.search(line)), len(lines)


def test_any_annotations_stay_rare() -> None:
    counts = {p: any_annotation_lines(p) for root in SOURCES for p in sorted(root.rglob("*.py"))}
    annotated = sum(n for n, _ in counts.values())
    total = sum(t for _, t in counts.values())
    density = 1000 * annotated / total
    worst = sorted(counts.items(), key=lambda kv: -kv[1][0])[:10]
    listing = "\n".join(f"  {n:3d} {p.relative_to(ROOT)}" for p, (n, _) in worst)
    assert density < MAX_ANY_PER_1000_LINES, (
        f"{annotated} lines annotated Any in {total} source lines ({density:.2f} per 1,000, the limit is "
        f"{MAX_ANY_PER_1000_LINES}); give these seams their real types. Most in:\n{listing}"
    )


def test_the_any_counter_sees_parameters_and_returns_not_containers(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text(
        "def f(x: Any, y: int) -> None: ...\n"
        "def g(x: int) -> Any: ...\n"
        "value:Any = 1\n"
        "def h(x: dict[str, Any]) -> list[Any]: ...\n"
        "def k(x: AnyStr) -> object: ...\n"
    )
    assert any_annotation_lines(f) == (3, 5)
