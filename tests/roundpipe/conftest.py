"""Shared fixtures: CPU virtual devices and a short wait deadline so hangs fail fast."""

from __future__ import annotations

import pytest

import roundpipe
from roundpipe import device, optim_stream


@pytest.fixture(autouse=True)
def _short_deadline(monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_WAIT_TIMEOUT", "60")
    yield
    optim_stream.synchronize_optim()


@pytest.fixture(params=[2, 3], ids=["2dev", "3dev"])
def ndev(request):
    """Run the test on 2 and on 3 CPU virtual devices."""
    roundpipe.init_devices(num_virtual=request.param)
    yield request.param
    device.wait_devices_idle(timeout=30)


@pytest.fixture
def two_devices():
    roundpipe.init_devices(num_virtual=2)
    yield 2
    device.wait_devices_idle(timeout=30)
