"""`slapo train --data` streams a text file larger than it wants to hold: tokenized a batch at a
time into the memory-mapped token cache, then trained on windows read from the map. The peak
resident memory of the run grows by far less than the file (benchmarks/train_streaming.py
measures a 1 GiB file the same way)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from train_streaming import measure  # noqa: E402  (the path above)

SIZE = 32 << 20


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_large_text_file_trains_in_far_less_memory_than_its_size(tmp_path):
    result = measure(SIZE, steps=2, root=tmp_path)
    runs = result["runs"]
    assert result["file_bytes"] == SIZE
    # the whole file was tokenized (one token per byte, the end-of-text token after it) and
    # cached as uint16 ids
    assert runs["tokenize"]["tokens"] == SIZE + 1 == runs["cached"]["tokens"]
    assert result["cache_bytes"] == 2 * (SIZE + 1)
    assert runs["tokenize"]["from_cache"] is False and runs["cached"]["from_cache"] is True
    # against a run on a tiny file: tokenizing (measured: 1 MiB more) and training on the map
    for name in ("tokenize", "cached"):
        growth = runs[name]["rss_growth"]
        assert growth < 0.5 * SIZE, f"{name}: peak RSS grew {growth / 2**20:.0f} MiB"
