"""Redraw the import graph of ``src/slapo`` and ``src/roundpipe`` from the code; measure the house.

Prints, for each package: its floors (the layer map below, written by package so renames inside a
package do not change it), the import cycles (strongly connected components) and every arrow that
points up a floor, module-level and function-level (deferred) imports counted apart. Then the
``ruff --select C901`` count, the ``>>>`` lines in docstrings under ``src/`` and the largest files.

Usage::

    .venv/bin/python scripts/import_graph.py               # this checkout
    .venv/bin/python scripts/import_graph.py --root /tmp/x # another checkout (before/after)

``tests/test_layering.py`` and ``tests/roundpipe/test_device_bookkeeping.py`` load :data:`LAYERS`
and :func:`import_graph` from here, so the map the tests enforce is the map this script prints.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: Floors from the bottom, per top-level package: an import may point to its own floor or below.
#: A module belongs to the floor of the longest prefix that names it (``slapo.tune`` covers
#: ``slapo.tune.tuner``). The package itself (``slapo/__init__.py``, the public facade that
#: re-exports every floor) sits on top: nothing below may import it.
LAYERS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "slapo": [
        (
            "ground",
            (
                "slapo.exceptions",
                "slapo.ranks",
                "slapo.logger",
                "slapo.env",
                "slapo.precision",
                "slapo.surgery",
                "slapo.random",
                "slapo.data",
                "slapo.throughput",
                "slapo.tie_weights",
            ),
        ),
        ("schedule", ("slapo.schedule",)),
        ("op", ("slapo.op",)),
        ("sharding", ("slapo.sharding",)),
        ("tracing", ("slapo.tracing",)),
        ("pattern", ("slapo.pattern", "slapo.initialization")),
        ("primitives", ("slapo.primitives",)),
        ("model_schedule", ("slapo.model_schedule", "slapo.vision")),
        ("verify", ("slapo.verify",)),
        ("checkpoints", ("slapo.checkpoints", "slapo.consolidate")),
        ("targets", ("slapo.pipeline", "slapo.targets")),
        ("build", ("slapo.build",)),
        ("memory", ("slapo.memory",)),
        ("tune", ("slapo.tune",)),
        ("train", ("slapo.train",)),
        ("plan", ("slapo.plan",)),
        ("facade", ("slapo",)),
        ("cli", ("slapo.cli", "slapo.__main__")),
        ("testing", ("slapo.testing", "slapo.model_zoo")),
    ],
    "roundpipe": [
        ("ground", ("roundpipe.errors",)),
        ("devices", ("roundpipe.devices",)),
        ("runtime", ("roundpipe.runtime",)),
        ("optim", ("roundpipe.optim",)),
        ("wrapping", ("roundpipe.wrapping", "roundpipe.models")),
        ("facade", ("roundpipe", "roundpipe.seed_paths")),
    ],
}


@dataclass(frozen=True)
class Arrow:
    """One import: ``source`` imports ``target`` at ``path:line``; ``kind`` is ``module`` (runs at
    import), ``function`` (deferred into a function body) or ``typing`` (under TYPE_CHECKING)."""

    source: str
    target: str
    path: str
    line: int
    kind: str


def module_name(path: Path, src: Path) -> str:
    """``src/slapo/tune/__init__.py`` -> ``slapo.tune``."""
    name = ".".join(path.relative_to(src).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest known module that ``name`` names (``slapo.tune.tuner.Tuner`` -> the module)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def _arrows(path: Path, src: Path, modules: set[str]) -> list[Arrow]:
    source = module_name(path, src)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    rel = str(path.relative_to(src.parent))
    out: list[Arrow] = []

    def add(names: list[str], node: ast.stmt, kind: str) -> None:
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != source:
                out.append(Arrow(source, target, rel, node.lineno, kind))

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = "function" if kind == "module" else kind
            elif isinstance(child, ast.If) and _is_type_checking(child):
                inner = "typing"
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                # `from pkg import sub` names the submodule when there is one, else pkg itself
                add([f"{mod}.{a.name}" for a in child.names], child, inner)
            elif isinstance(child, ast.Import):
                add([a.name for a in child.names], child, inner)
            visit(child, inner)

    try:
        tree = ast.parse(path.read_text(), str(path))
    except SyntaxError as err:  # a file mid-edit in a shared checkout: say so, measure the rest
        print(f"warning: skipped {rel}: {err.msg} (line {err.lineno})", file=sys.stderr)
        return out
    visit(tree, "module")
    return out


def import_graph(src: Path, package: str) -> tuple[set[str], list[Arrow]]:
    """Every module of ``src/<package>`` and every import arrow between them."""
    files = sorted((src / package).rglob("*.py"))
    modules = {module_name(p, src) for p in files}
    arrows = list(dict.fromkeys(a for p in files for a in _arrows(p, src, modules)))
    return modules, arrows


def floor_of(module: str, package: str) -> int | None:
    """The index in :data:`LAYERS` of the floor ``module`` lives on; None if the map misses it."""
    best: tuple[int, int] | None = None  # (prefix length, floor)
    for floor, (_, prefixes) in enumerate(LAYERS[package]):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), floor)
    return None if best is None else best[1]


def upward(arrows: list[Arrow], package: str) -> list[Arrow]:
    """The arrows that point to a higher floor than their source's."""
    out = []
    for a in arrows:
        src_floor, dst_floor = floor_of(a.source, package), floor_of(a.target, package)
        if src_floor is not None and dst_floor is not None and dst_floor > src_floor:
            out.append(a)
    return out


def cycles(modules: set[str], arrows: list[Arrow]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for a in arrows:
        graph[a.source].add(a.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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


def doctest_lines(src: Path) -> int:
    """``>>>`` lines inside docstrings (module, class, function) under ``src``."""
    count = 0
    for path in src.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text(), str(path))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False) or ""
                count += sum(line.lstrip().startswith(">>>") for line in doc.splitlines())
    return count


def complexity_count(root: Path) -> int | None:
    """Functions ``ruff check --select C901`` flags (ruff's default max-complexity, 10)."""
    ruff = Path(sys.executable).with_name("ruff")
    cmd = [str(ruff)] if ruff.exists() else [sys.executable, "-m", "ruff"]
    done = subprocess.run(
        [*cmd, "check", "--select", "C901", "--output-format", "concise", "--no-cache", "src"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    return sum(" C901 " in line for line in done.stdout.splitlines())


def largest_files(src: Path, n: int = 15) -> list[tuple[int, str]]:
    sizes = [
        (len(p.read_text().splitlines()), str(p.relative_to(src.parent))) for p in src.rglob("*.py")
    ]
    return sorted(sizes, reverse=True)[:n]


def report(root: Path) -> str:
    src = root / "src"
    lines: list[str] = []
    for package in LAYERS:
        modules, arrows = import_graph(src, package)
        by_kind = {k: [a for a in arrows if a.kind == k] for k in ("module", "function", "typing")}
        lines.append(
            f"== {package}: {len(modules)} modules, arrows: "
            + ", ".join(f"{k} {len(v)}" for k, v in by_kind.items())
        )
        lines.append("floors (bottom first): " + " < ".join(name for name, _ in LAYERS[package]))
        unplaced = sorted(m for m in modules if floor_of(m, package) is None)
        if unplaced:
            lines.append(f"not on the map: {', '.join(unplaced)}")
        module_cycles = cycles(modules, by_kind["module"])
        # the imports that run: a TYPE_CHECKING import never does
        all_cycles = cycles(modules, by_kind["module"] + by_kind["function"])
        lines.append(f"cycles, module-level imports: {len(module_cycles)}")
        lines.extend(f"  {' <-> '.join(c)}" for c in module_cycles)
        lines.append(f"cycles, imports that run (deferred too): {len(all_cycles)}")
        lines.extend(f"  {' <-> '.join(c)}" for c in all_cycles)
        for kind, kind_arrows in by_kind.items():
            up = upward(kind_arrows, package)
            lines.append(f"upward arrows, {kind}-level: {len(up)}")
            lines.extend(f"  {a.source} -> {a.target}  ({a.path}:{a.line})" for a in up)
    lines.append(f"== ruff --select C901 src: {complexity_count(root)}")
    lines.append(f"== '>>>' lines in src docstrings: {doctest_lines(src)}")
    lines.append("== largest files under src (lines):")
    lines.extend(f"  {n:5d} {p}" for n, p in largest_files(src))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parents[1],
        help="the checkout to measure (default: this one)",
    )
    print(report(parser.parse_args().root))


if __name__ == "__main__":
    main()
