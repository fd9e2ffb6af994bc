"""CUDA-only tests: skipped without a GPU; `scripts/gpu-check.sh` runs them on one.

Every test here runs on a real device, with real streams, events, pinned memory and NCCL; the
CPU suite covers the same code paths on CPU virtual devices.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# the RoundPipe reference helpers are shared with the CPU suite (tests/conftest.py puts tests/, with
# the small transformers models, on the path)
_ROUNDPIPE_TESTS = str(Path(__file__).resolve().parents[1] / "roundpipe")
if _ROUNDPIPE_TESTS not in sys.path:
    sys.path.append(_ROUNDPIPE_TESTS)


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu-check.sh on one)")
    for item in items:
        if Path(str(item.fspath)).resolve().parent == here:
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_cuda_state(monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_WAIT_TIMEOUT", "120")
    yield
    if torch.cuda.is_available():
        from roundpipe import device, optim_stream

        optim_stream.synchronize_optim()
        device.wait_devices_idle(timeout=60)
        torch.cuda.synchronize()


@pytest.fixture
def gpu():
    """RoundPipe on the real GPU(s)."""
    import roundpipe

    roundpipe.init_devices(backend="cuda")
    yield torch.device("cuda", 0)
