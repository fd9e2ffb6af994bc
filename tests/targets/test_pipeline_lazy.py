"""The pipeline target with no example inputs: stages built on the first step (2 gloo ranks).

The checks run in the suite's shared 2-rank job (``conftest.py``, ``jobs_lazy.py``).
"""

from __future__ import annotations

import pytest

from dist_utils import assert_check

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.mark.parametrize("check", ["lazy_gpt2", "lazy_mlp", "lazy_errors"])
def test_pipeline_without_example_inputs(ranks2, check):
    """GPT-2 and a plain MLP with one cut train like the one-process model through the loop."""
    assert_check(ranks2, check)
