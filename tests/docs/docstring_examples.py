"""Find, run and statically check the ``>>>`` examples in the docstrings of slapo and roundpipe.

The default suite runs them through tests/docs/test_docstring_examples.py; ``python
tests/docs/docstring_examples.py`` prints a per-module summary (examples run, skipped, failed)
for a quick look while editing docstrings.

An example either runs on CPU in a second or less, or is marked ``# doctest: +SKIP`` with the
reason beside it (several processes, a GPU, a long run, files outside a temporary folder). A
skipped example is still an example users copy: :func:`undefined_names` checks that every name
it uses is defined by the docstring, the module or the example itself.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import doctest
import importlib
import io
import os
import pkgutil
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("slapo", "roundpipe")
OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# Modules whose examples are not collected, with the reason. Importing the first runs a program.
NOT_COLLECTED: dict[str, str] = {
    "slapo.__main__": "importing it runs the `slapo` command line",
}


# Modules whose examples the suite does not run yet, with the reason: their docstrings still use
# names they never define, print other output, or start processes. Fixing a module's docstrings
# removes it from here (issue 38).
_NOT_YET_FIXED = "examples use names they do not define or print stale output (issue 38)"
DEFERRED: dict[str, str] = {
    **dict.fromkeys(
        [],
        _NOT_YET_FIXED,
    ),
}


def module_names() -> list[str]:
    """Every module of the two packages, found on disk (so a module that fails to import is
    still listed, and reported by :func:`load`)."""
    names = []
    for package in PACKAGES:
        names.append(package)
        path = [str(ROOT / "src" / package)]
        for info in pkgutil.walk_packages(path, prefix=f"{package}."):
            names.append(info.name)
    return sorted(set(names))


def load(name: str):
    """``(module, None)``, or ``(None, reason)`` when the module is not collected or cannot be
    imported on this machine (a missing optional dependency)."""
    if name in NOT_COLLECTED:
        return None, NOT_COLLECTED[name]
    try:
        return importlib.import_module(name), None
    except ImportError as error:  # an optional dependency this machine lacks
        return None, f"cannot import: {error}"


def docstring_tests(module) -> list[doctest.DocTest]:
    """The module's docstring examples, in source order (objects defined in the module only)."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = finder.find(module)  # ValueError: a docstring doctest cannot parse
    return sorted(tests, key=lambda t: (t.lineno or 0, t.name))


def is_skipped(example: doctest.Example) -> bool:
    return bool(example.options.get(doctest.SKIP))


@dataclass
class Counts:
    run: int = 0
    skipped: int = 0
    lines_run: int = 0
    lines_skipped: int = 0


def count(tests: list[doctest.DocTest]) -> Counts:
    """Examples and ``>>>`` lines run and skipped (an example's source lines after the first
    are ``...`` continuations; only its first line is a ``>>>`` line)."""
    counts = Counts()
    for test in tests:
        for example in test.examples:
            if is_skipped(example):
                counts.skipped += 1
                counts.lines_skipped += 1
            else:
                counts.run += 1
                counts.lines_run += 1
    return counts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _isolated(tmp_dir: Path) -> Iterator[None]:
    """Run examples in a scratch folder and put back the process-wide state they may change."""
    import torch
    import torch.distributed as dist

    had_group = dist.is_available() and dist.is_initialized()
    cwd = os.getcwd()
    dtype = torch.get_default_dtype()
    grad = torch.is_grad_enabled()
    threads = torch.get_num_threads()
    rng = torch.get_rng_state()
    environ = dict(os.environ)
    registries = _registries()
    before = {name: set(table) for name, table in registries.items()}
    os.chdir(tmp_dir)
    # examples that start a world of one (slapo.env.setup) rendezvous here, not on 29500
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    try:
        yield
    finally:
        os.chdir(cwd)
        if not had_group:
            import slapo.env

            # an example's world of one must not leak into others, nor what slapo.env.setup
            # saved to put back (a later setup/teardown would restore this module's port)
            slapo.env.teardown()
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
        os.environ.clear()
        os.environ.update(environ)
    leaked = {name: sorted(set(table) - before[name]) for name, table in registries.items()}
    leaked = {name: keys for name, keys in leaked.items() if keys}
    if leaked:  # a registration outlives its example: later tests would see it
        raise AssertionError(f"examples left registered: {leaked}; unregister them in the example")


def _registries() -> dict[str, Any]:
    """The process-wide registries an example may add to (what it adds must not outlive it)."""
    from slapo.model_schedule import schedule_registry
    from slapo.model_schedule.tp_styles import REGISTRY
    from slapo.schedule import PRIMITIVES
    from slapo.targets import target_registry

    return {
        "slapo.schedule.PRIMITIVES": PRIMITIVES,
        "slapo.targets.target_registry._TARGETS": target_registry._TARGETS,
        "slapo.model_schedule.tp_styles.REGISTRY": REGISTRY,
        "slapo.model_schedule.schedule_registry._SCHEDULES": schedule_registry._SCHEDULES,
    }


def run_module(module, tmp_dir: Path) -> tuple[int, str]:
    """Run the module's examples; ``(failed, report)`` with doctest's report of each failure."""
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    out = io.StringIO()
    with _isolated(tmp_dir):
        for test in docstring_tests(module):
            runner.run(test, out=out.write)
    return runner.failures, out.getvalue()


# -- the static check of skipped examples -------------------------------------------------------


def _bound(tree: ast.AST) -> set[str]:
    """Names an example binds anywhere: assignments, imports, defs, loop and ``with`` targets,
    comprehension variables, handlers, walrus, and the parameters of its defs and lambdas."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.update(node.names)
    return bound


def _used(tree: ast.AST) -> list[tuple[str, int]]:
    """``(name, line within the example)`` of every name the example reads."""
    return [
        (node.id, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    ]


def undefined_names(test: doctest.DocTest) -> list[str]:
    """``module:line: name`` for each name a skipped example reads that nothing defines: no
    earlier example of the docstring, the module's globals, builtins, nor the example itself."""
    defined = set(test.globs) | set(dir(builtins))
    problems = []
    for example in test.examples:
        try:
            tree = ast.parse(example.source)
        except SyntaxError as error:
            line = (test.lineno or 0) + example.lineno + 1
            problems.append(f"{test.filename}:{line}: example does not parse ({error.msg})")
            continue
        bound = _bound(tree)
        if is_skipped(example):
            for name, line in _used(tree):
                if name not in defined and name not in bound:
                    where = (test.lineno or 0) + example.lineno + line
                    problems.append(f"{_relative(test.filename)}:{where}: {name} ({test.name})")
        defined |= bound
    return problems


def _relative(filename: str | None) -> str:
    if not filename:
        return "?"
    path = Path(filename)
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def _summary() -> None:
    """Print examples run/skipped per module and run them (the quick look while editing)."""
    import tempfile
    import time

    total = Counts()
    for name in module_names():
        module, reason = load(name)
        if module is None:
            print(f"{name}: not collected ({reason})")
            continue
        if name in DEFERRED and "--all" not in sys.argv:
            print(f"{name}: deferred ({DEFERRED[name]})")
            continue
        try:
            tests = docstring_tests(module)
        except ValueError as error:
            print(f"{name}: FAIL cannot parse: {error}")
            continue
        counts = count(tests)
        for field in vars(total):
            setattr(total, field, getattr(total, field) + getattr(counts, field))
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            failed, report = run_module(module, Path(tmp))
        took = time.perf_counter() - start
        undefined = [p for t in tests for p in undefined_names(t)]
        flag = "FAIL" if failed or undefined else "ok"
        print(
            f"{name}: {flag} run={counts.run} skipped={counts.skipped} failed={failed} "
            f"undefined={len(undefined)} {took:.2f}s"
        )
        if "-v" in sys.argv:
            print(report, *undefined, sep="\n")
    print(f"total: {vars(total)}")


if __name__ == "__main__":
    _summary()
