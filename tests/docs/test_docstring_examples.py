"""Every docstring example of slapo and roundpipe runs and prints what it claims, or is marked
``# doctest: +SKIP`` as an illustration that still defines every name it uses.

One test per module, so a failure names it; the machinery is in docstring_examples.py beside
this file (``python tests/docs/docstring_examples.py`` prints a per-module summary).
"""

from __future__ import annotations

import builtins
import doctest

import pytest
from docstring_examples import (
    DEFERRED,
    count,
    docstring_tests,
    load,
    module_names,
    run_module,
    undefined_names,
)

MODULES = module_names()


def _module_or_skip(name: str):
    module, reason = load(name)
    if module is None:
        pytest.skip(reason)
    if name in DEFERRED:
        pytest.skip(f"deferred: {DEFERRED[name]}")
    return module


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name: str, tmp_path) -> None:
    module = _module_or_skip(name)
    failed, report = run_module(module, tmp_path)
    assert failed == 0, f"{name}: {failed} docstring example(s) failed\n{report}"


@pytest.mark.parametrize("name", MODULES)
def test_skipped_examples_define_their_names(name: str) -> None:
    module = _module_or_skip(name)
    problems = [p for test in docstring_tests(module) for p in undefined_names(test)]
    assert not problems, f"{name}: skipped examples use undefined names:\n" + "\n".join(problems)


def test_every_module_is_found() -> None:
    # the parametrization above must not be empty or miss a package
    assert {"slapo", "slapo.schedule", "roundpipe", "roundpipe.runtime.plan"} <= set(MODULES)


def test_static_check_can_fail() -> None:
    def example() -> None:
        """
        >>> y = 1  # doctest: +SKIP
        >>> print(y, sch, model)  # doctest: +SKIP
        >>> print(undefined_runs)
        """

    globs = {"model": None, "__builtins__": builtins}
    (test,) = doctest.DocTestFinder().find(example, "example", globs=globs)
    problems = undefined_names(test)
    assert len(problems) == 1 and problems[0].endswith("sch (example)"), problems


def test_counts_split_run_and_skipped() -> None:
    def example() -> None:
        """
        >>> 1 + 1
        2
        >>> print("x")  # doctest: +SKIP
        """

    counts = count(doctest.DocTestFinder().find(example, "example", globs={}))
    assert (counts.run, counts.skipped) == (1, 1)
