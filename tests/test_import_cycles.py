"""No import circle inside the project's packages: every arrow between two modules points one way; and no
function in them over 150 lines.

Edges, read from the source with `ast` (nothing is imported):
- module-level imports *and* imports inside functions count. A function-level import is still a
  dependency: it runs whenever the function does, and moving an import into a function is the
  usual way a circle gets hidden rather than cut (launch.py <-> worker.py, encoder_actions.py <->
  long_short.py were such circles). Counting them keeps each module readable and testable on its own.
- imports under `if TYPE_CHECKING:` do not count: they never run, they only name types.
- `from pkg import name` is an edge to the module `pkg.name` when that is a module, else to `pkg`;
  importing `a.b.c` is an edge to `a.b.c` only (not to the packages above it, whose `__init__`
  running first is Python's mechanics, not this module's dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("omnibench", "systems", "workloads", "simulator")


def modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, skipping `if TYPE_CHECKING:` bodies."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking_only(node):
            yield from (n for child in node.orelse for n in _imports_of(child))
            continue
        yield from _imports_of(node)


def _imports_of(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node)


def edges(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    out = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
            continue
        base = node.module or ""
        if node.level:  # relative: from the module's package, one level up per extra dot
            parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, base] if base else parts)
        for a in node.names:
            target = f"{base}.{a.name}"
            if target in known:
                out.add(target)
            elif base in known:
                out.add(base)
    out.discard(name)
    return out


def cycles(root: Path, packages=PACKAGES) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    known = modules(root, packages)
    graph = {m: sorted(edges(m, p, known)) for m, p in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_circle_inside_the_project_packages():
    found = cycles(ROOT)
    assert not found, "import circles (each list: modules that import one another): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_the_check_finds_a_circle_hidden_in_a_function_and_ignores_type_only_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n    return a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import D\n")
    (pkg / "d.py").write_text("from . import c\n")
    assert cycles(tmp_path, ("pkg",)) == [["pkg.a", "pkg.b"]]


def test_no_function_in_the_product_packages_is_over_150_lines():
    long = []
    for package in ("omnibench", "systems", "simulator", "workloads"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 150:
                    long.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert not long, long
