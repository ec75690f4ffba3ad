"""Tables of README.md and results/BENCHMARKS.md written from committed records, so that no figure
there can go stale.

A document holds a table between two markers, on lines of their own (a block: a markdown table
and its caption) or inside one line (a figure quoted in a sentence or a table cell):

    <!-- table:h100-validation -->
    ...written by the script...
    <!-- /table -->

    the memory estimate is <!-- table:h100-memory-range -->...<!-- /table --> the measured peaks

    python -m omnibench.tables                  # rewrite every table in DOCUMENTS
    python -m omnibench.tables --check          # exit 1, with a diff, where a committed table differs
    python -m omnibench.tables --only NAME[,NAME] [--check]
    python -m omnibench.tables --fast [--check] # leave the slow tables (marked slow=True) as they are

tests/test_tables.py runs `--check --fast` in the default test run and the slow tables under
`-m slow`. To add a table: a module in this package with a function returning its markdown,
decorated with `@table("name")` (every module of the package is imported by `registry()`), and the
markers where it goes; a document not yet in DOCUMENTS is added there.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import pkgutil
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omnibench.provenance import REPO_ROOT

# The documents whose markers the script fills, relative to the repository root.
DOCUMENTS = ("README.md", "results/BENCHMARKS.md", "results/calibration/README.md", "results/gpu/README.md",
             "docs/simulator-accuracy.md")

MARKER = re.compile(r"<!-- table:([A-Za-z0-9_.-]+) -->(.*?)<!-- /table -->", re.DOTALL)
_OPEN = re.compile(r"<!-- table:([A-Za-z0-9_.-]+) -->")


class TableError(ValueError):
    """A marker without a registered table, an unclosed marker, or an inline table of several lines."""


@dataclass(frozen=True)
class Table:
    name: str
    make: Callable[[], str]
    slow: bool = False  # too slow for the default test run (checked under -m slow)


_TABLES: dict[str, Table] = {}


def table(name: str, slow: bool = False):
    """Register `fn() -> markdown` as the table NAME."""

    def register(fn: Callable[[], str]) -> Callable[[], str]:
        if name in _TABLES and _TABLES[name].make is not fn:
            raise TableError(f"table {name!r} is registered twice ({_TABLES[name].make.__module__} and {fn.__module__})")
        _TABLES[name] = Table(name, fn, slow)
        return fn

    return register


def registry() -> dict[str, Table]:
    """Every table of every module in this package."""
    for mod in pkgutil.iter_modules(__path__):
        if not mod.name.startswith("_"):  # not __main__
            importlib.import_module(f"{__name__}.{mod.name}")
    return dict(_TABLES)


def render(text: str, made: Callable[[str], str | None], where: str = "document") -> str:
    """`text` with the content of each marker replaced by `made(name)` (None: left as it is)."""
    opened = [m.start() for m in _OPEN.finditer(text)]
    closed = {m.start() for m in MARKER.finditer(text)}
    for at in opened:
        if at not in closed:
            line = text.count("\n", 0, at) + 1
            raise TableError(f"{where}:{line}: <!-- table:... --> without its <!-- /table -->")

    def fill(m: re.Match) -> str:
        name, old = m.group(1), m.group(2)
        new = made(name)
        if new is None:
            return m.group(0)
        block = old.startswith("\n")
        body = new.strip("\n")
        if not block and "\n" in body:
            line = text.count("\n", 0, m.start()) + 1
            raise TableError(f"{where}:{line}: table {name!r} is inline (markers on one line) but has several lines")
        return f"<!-- table:{name} -->" + (f"\n{body}\n" if block else body) + "<!-- /table -->"

    return MARKER.sub(fill, text)


def names_in(text: str) -> list[str]:
    return [m.group(1) for m in MARKER.finditer(text)]


def write(root: Path | None = None, only: set[str] | None = None, fast: bool = False,
          check: bool = False, documents: tuple[str, ...] | None = None) -> list[str]:
    """Fill (or, with `check`, compare) every marker of `documents` (default DOCUMENTS) under `root`
    (default the repository); returns the unified diffs of the documents that differ from what the
    tables write (empty: all up to date)."""
    root = REPO_ROOT if root is None else root
    documents = DOCUMENTS if documents is None else documents
    tables = registry()
    found = {}
    for doc in documents:
        path = root / doc
        if path.is_file():
            found[doc] = path.read_text()
    used = {n for text in found.values() for n in names_in(text)}
    unknown = sorted(used - set(tables))
    if unknown:
        raise TableError(f"markers name tables nobody registered: {', '.join(unknown)} "
                         f"(registered: {', '.join(sorted(tables))})")
    if only:
        bad = sorted(only - set(tables))
        if bad:
            raise TableError(f"--only: no table {', '.join(bad)}; registered: {', '.join(sorted(tables))}")
    cache: dict[str, str] = {}

    def made(name: str) -> str | None:
        t = tables[name]
        if (only and name not in only) or (fast and t.slow):
            return None
        if name not in cache:
            cache[name] = t.make()
        return cache[name]

    diffs = []
    for doc, text in found.items():
        new = render(text, made, doc)
        if new == text:
            continue
        diffs.append("".join(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                  f"{doc} (committed)", f"{doc} (python -m omnibench.tables)")))
        if not check:
            (root / doc).write_text(new)
    return diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m omnibench.tables", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 where a committed table differs")
    ap.add_argument("--only", default="", help="comma-separated table names (default: all)")
    ap.add_argument("--fast", action="store_true", help="leave the slow tables as they are")
    ap.add_argument("--list", action="store_true", help="list the registered tables and exit")
    a = ap.parse_args(argv)
    if a.list:
        for name, t in sorted(registry().items()):
            doc = (t.make.__doc__ or "").strip().splitlines()
            print(f"{name}{' (slow)' if t.slow else ''}: {doc[0] if doc else ''}")
        return 0
    try:
        diffs = write(only={x for x in a.only.split(",") if x} or None, fast=a.fast, check=a.check)
    except TableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.check:
        for d in diffs:
            print(d)
    if a.check and diffs:
        print(f"{len(diffs)} document(s) differ from what the tables write: run `python -m omnibench.tables`",
              file=sys.stderr)
        return 1
    print("every table is up to date" if a.check else f"rewrote {len(diffs)} document(s)"
          + "".join(f"\n  {d.splitlines()[0].removeprefix('--- ').removesuffix(' (committed)')}" for d in diffs))
    return 0
