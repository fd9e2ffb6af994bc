"""Tuning errors are Slapo errors: one ``except slapo.SlapoError`` catches bad tuning input."""

from __future__ import annotations

import pytest

import slapo
from slapo.tune import Database, TuneError, Tuner


def test_tune_error_is_a_slapo_error():
    with pytest.raises(slapo.SlapoError, match="no valid configuration") as info:
        Tuner([], ["true"], db=Database(None))  # an empty space cannot be tuned
    assert isinstance(info.value, TuneError) and isinstance(info.value, RuntimeError)
