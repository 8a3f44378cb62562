"""No import circles: the modules' imports, read from their source, form no cycle. Module-level imports (what Python
runs when a module loads), and in cli/, io/ and core/ alike the imports inside functions too (a lazy import that
closes a circle hides a tie that points the wrong way: core's backend ran the attention probe, which ran the
transformers route, which imported the backend's module). Imports under `if TYPE_CHECKING:` are for annotations
only and are not counted."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"cli": "conveyor.cli", "core": "conveyor.core", "io": "conveyor.io"}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, lazy: bool) -> set[str]:
    """The conveyor modules `path` imports: at module level, or (lazy) anywhere but under TYPE_CHECKING."""
    found: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        if _is_type_checking(node):
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not lazy:
                return
            in_function = True
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("conveyor"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, in_function)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return {m for m in found if m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_module_level_import_circle():
    graph = {m: _imports(p, lazy=False) - {m} for m, p in MODULES.items()}
    assert not _cycles(graph)


def test_no_import_circle_even_through_imports_inside_functions():
    """cli, io and core together, every import inside a function counted as if it were at module level."""
    graph = {m: _imports(p, lazy=True) - {m} for m, p in MODULES.items()}
    assert not _cycles(graph)


def test_the_check_reads_imports_inside_functions_and_skips_type_checking_ones(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from conveyor.core.engine import Engine\n"
                      "def f():\n    from conveyor.core.backends import base\n")
    assert _imports(source, lazy=False) == set()
    assert _imports(source, lazy=True) == {"conveyor.core.backends", "conveyor.core.backends.base"}


def test_the_check_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
