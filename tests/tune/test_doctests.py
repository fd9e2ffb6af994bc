"""The examples in the docstrings of slapo.tune run and print what they claim."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "__init__",
    "space",
    "database",
    "errors",
    "trial",
    "strategies",
    "model",
    "tuner",
    "report",
    "tune_cli",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module("slapo.tune" if name == "__init__" else f"slapo.tune.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
