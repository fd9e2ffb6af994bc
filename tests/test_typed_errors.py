"""Every error the libraries raise on purpose is one of their own: a ``SlapoError`` under
src/slapo, a ``RoundPipeError`` under src/roundpipe, each keeping its standard base
(``ValueError``, ``TypeError``, ...) through multiple inheritance.

A ``raise <builtin exception>(...)`` in src/ fails here, named by file:line, unless Python's own
protocols demand the builtin (listed below with why).
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

BUILTIN_ERRORS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}

#: Builtins that keep their builtin type wherever they are raised.
ANY_PLACE = {
    "NotImplementedError": "an abstract method or a feature not built: Python's own idiom",
    "SystemExit": "a command-line exit with a status, not an error",
}

#: Special methods whose protocol names the builtin it raises (getattr/hasattr, pickle).
PROTOCOL_METHODS = {
    ("__getattr__", "AttributeError"): "the attribute protocol: hasattr/getattr test for it",
    ("__delattr__", "AttributeError"): "the attribute protocol",
    ("__reduce__", "TypeError"): "pickle's protocol for an object that is not pickled",
}

#: (file under src/, function, builtin) -> why it stays builtin.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("slapo/primitives/trace.py", "_base_dummy_inputs", "LookupError"): (
        "an internal signal: its only caller catches it and raises a typed TraceError"
    ),
    ("slapo/tracing/hf_fx.py", "one", "LookupError"): (
        "an internal signal ('value unknown') of two local helpers, caught by their callers"
    ),
    ("slapo/targets/deepspeed_pipe.py", "_held", "AssertionError"): (
        "an invariant (find_tie_groups found the parameter), not a user error"
    ),
    ("roundpipe/devices/attribute.py", "get", "KeyError"): (
        "a mapping-style lookup; callers ask ParamAttribute.has first"
    ),
    ("roundpipe/runtime/batch.py", "reduce", "AssertionError"): (
        "an invariant of the reducer objects the runtime itself hands out"
    ),
    ("slapo/testing/zoo_checks.py", "__post_init__", "ValueError"): (
        "slapo.testing is being moved out of slapo's import path (issue 38); convert it to the "
        "zoo's ZooError family there"
    ),
}


def builtin_raises(path: Path) -> list[tuple[int, str, str]]:
    """(line, enclosing function, builtin name) of every ``raise <builtin>`` in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            is_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            inner = child.name if is_function else function
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(exc, ast.Name) and exc.id in BUILTIN_ERRORS:
                    found.append((child.lineno, function, exc.id))
            visit(child, inner)

    visit(tree, "<module>")
    return found


def _offenders(src: Path) -> list[str]:
    bad = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        for line, function, name in builtin_raises(path):
            if (
                name in ANY_PLACE
                or (function, name) in PROTOCOL_METHODS
                or (rel, function, name) in ALLOWED
            ):
                continue
            bad.append(f"src/{rel}:{line} raise {name} (in {function})")
    return bad


def test_no_builtin_exception_is_raised_on_purpose():
    bad = _offenders(SRC)
    assert not bad, (
        "raise the package's typed errors (slapo.exceptions / roundpipe.errors, keeping the "
        "builtin as a second base) instead of:\n" + "\n".join(bad)
    )


def test_allowed_entries_still_exist():
    stale = []
    for rel, function, name in ALLOWED:
        path = SRC / rel
        raised = {(f, n) for _, f, n in builtin_raises(path)} if path.exists() else set()
        if (function, name) not in raised:
            stale.append((rel, function, name))
    assert not stale, f"drop these from ALLOWED, they no longer raise a builtin: {stale}"


def test_the_scan_names_file_and_line(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "def f(x):\n    if x:\n        raise ValueError('bad')\n    raise NotImplementedError\n"
    )
    assert _offenders(tmp_path) == ["src/pkg/m.py:3 raise ValueError (in f)"]


@pytest.mark.parametrize(
    ("error", "base"),
    [
        ("slapo.tune.TuneError", RuntimeError),
        ("slapo.tune.DatabaseCorruptError", ValueError),
        ("slapo.tune.errors.TuneValueError", ValueError),
        ("slapo.tune.errors.TuneTypeError", TypeError),
        ("slapo.primitives.compile.CompileError", RuntimeError),
        ("slapo.exceptions.OpError", ValueError),
        ("roundpipe.InvalidPlanError", ValueError),
        ("roundpipe.errors.RoundPipeTypeError", TypeError),
        ("roundpipe.DeviceMemoryError", MemoryError),
    ],
)
def test_typed_errors_keep_their_family_and_builtin_base(error, base):
    import importlib

    module, _, name = error.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    family = importlib.import_module(
        "slapo.exceptions" if module.startswith("slapo") else "roundpipe.errors"
    )
    root = family.SlapoError if module.startswith("slapo") else family.RoundPipeError
    assert issubclass(cls, root) and issubclass(cls, base)
