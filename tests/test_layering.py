"""Every import arrow under src/ points down the layer map, and none runs in a circle.

The map (floors by package, bottom first) is data in ``scripts/import_graph.py``, the script that
redraws the graph (docs/architecture.md); this test enforces the same map. Renaming a module inside
a package changes nothing here; a new top-level package or module must be given a floor there.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _load_graph_script():
    path = ROOT / "scripts" / "import_graph.py"
    spec = importlib.util.spec_from_file_location("import_graph", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("import_graph", module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


graph = _load_graph_script()

#: Upward arrows that remain, keyed (importing package, imported package), each with why. Only
#: deferred (function-level) imports may be listed, except where noted.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def _package(module: str, depth: int = 2) -> str:
    return ".".join(module.split(".")[:depth])


@pytest.mark.parametrize("package", sorted(graph.LAYERS))
def test_every_module_has_a_floor(package):
    modules, _ = graph.import_graph(SRC, package)
    missing = sorted(m for m in modules if graph.floor_of(m, package) is None)
    assert not missing, f"give these a floor in scripts/import_graph.py LAYERS: {missing}"


@pytest.mark.parametrize("kinds", [("module",), ("module", "function")])
@pytest.mark.parametrize("package", sorted(graph.LAYERS))
def test_no_import_cycle(package, kinds):
    # the imports that run: when a module loads, and deferred ones inside functions (a circle
    # of those is a tangle too); TYPE_CHECKING ones never run
    modules, arrows = graph.import_graph(SRC, package)
    found = graph.cycles(modules, [a for a in arrows if a.kind in kinds])
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("package", sorted(graph.LAYERS))
def test_imports_point_down_the_layer_map(package):
    _, arrows = graph.import_graph(SRC, package)
    bad = []
    for a in graph.upward(arrows, package):
        reason = KNOWN_UPWARD.get((_package(a.source), _package(a.target)))
        if reason is None or (a.kind != "function" and not reason.startswith("module-level")):
            bad.append(f"{a.path}:{a.line} {a.source} -> {a.target} ({a.kind}-level)")
    assert not bad, "imports that point up a floor (move the shared code down):\n" + "\n".join(bad)


def test_known_upward_arrows_still_exist():
    # a listed exception that no longer happens must leave the list, so the list stays the truth
    seen = set()
    for package in graph.LAYERS:
        _, arrows = graph.import_graph(SRC, package)
        seen |= {(_package(a.source), _package(a.target)) for a in graph.upward(arrows, package)}
    assert set(KNOWN_UPWARD) <= seen, f"no longer upward, drop them: {set(KNOWN_UPWARD) - seen}"


def test_the_map_catches_an_upward_arrow(tmp_path):
    # the oracle can fail: a ground-floor module importing the top floor is flagged
    pkg = tmp_path / "roundpipe"
    (pkg / "devices").mkdir(parents=True)
    (pkg / "wrapping").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "devices" / "__init__.py").write_text("")
    (pkg / "wrapping" / "__init__.py").write_text("")
    (pkg / "wrapping" / "model.py").write_text("")
    (pkg / "devices" / "transfer.py").write_text("from ..wrapping.model import X\n")
    _, arrows = graph.import_graph(tmp_path, "roundpipe")
    up = graph.upward(arrows, "roundpipe")
    assert [(a.source, a.target, a.kind) for a in up] == [
        ("roundpipe.devices.transfer", "roundpipe.wrapping.model", "module")
    ]
