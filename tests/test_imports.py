"""The package's modules import one another without cycles.

An import anywhere in a module counts (a function-local import that dodges a cycle at load
time is still one module needing the other), except under ``if TYPE_CHECKING:``: a type
named for the checker only. Importing a package (``asyncopd_jax.sampling``) counts as
importing its ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import asyncopd_jax

PACKAGE = Path(asyncopd_jax.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports (outside ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(filter(None, (resolve(a.name) for a in node.names)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # `from pkg import module` imports the module itself
                target = resolve(f"{base}.{alias.name}")
                found.update(filter(None, (target if target and target != base else None, resolve(base))))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(this)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, modules) for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_local_imports_and_skips_type_checking_ones(tmp_path):
    modules = {"asyncopd_jax.x", "asyncopd_jax.y", "asyncopd_jax.z"}
    source = PACKAGE / "_import_probe.py"
    try:
        source.write_text(
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from asyncopd_jax.x import A\n"
            "def f():\n    from asyncopd_jax.y import B\n"
            "from asyncopd_jax import z\n"
        )
        assert imported_modules(source, modules) == {"asyncopd_jax.y", "asyncopd_jax.z"}
    finally:
        source.unlink()


def test_the_package_has_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (outside TYPE_CHECKING): " + "; ".join(" <-> ".join(c) for c in found)
