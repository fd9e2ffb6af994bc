"""The CUDA device and the CPU virtual device are two backends behind one interface."""

from __future__ import annotations

import copy
import doctest
import importlib
import inspect
import io
import re
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.devices import device as device_mod
from roundpipe.devices import transfer
from roundpipe.devices.backend import DeviceBackend, Streams
from roundpipe.devices.cuda_backend import CudaBackend
from roundpipe.devices.device import DeviceManager, make_backend
from roundpipe.devices.link import CopyEvent
from roundpipe.devices.threads import RunState, wait_until
from roundpipe.devices.virtual_backend import VirtualBackend

ABSTRACT = {
    name
    for name, member in inspect.getmembers(DeviceBackend)
    if getattr(member, "__isabstractmethod__", False)
    or getattr(getattr(member, "fget", None), "__isabstractmethod__", False)
}


def _backends() -> list[DeviceBackend]:
    out: list[DeviceBackend] = [
        VirtualBackend(torch.device("cpu")),
        VirtualBackend(torch.device("cpu"), link_gbps=8.0),
    ]
    if torch.cuda.is_available():  # the CUDA backend is only instantiated where CUDA exists
        out.append(CudaBackend(torch.device("cuda", 0)))
    return out


def test_both_backends_implement_the_whole_interface():
    assert {"to_device", "to_host", "fill_stage", "start_grad_download"} <= ABSTRACT
    for cls in (VirtualBackend, CudaBackend):
        assert issubclass(cls, DeviceBackend)
        assert not cls.__abstractmethods__, cls  # every abstract method is implemented
        for name in ABSTRACT:  # ... by the class itself, with the interface's parameters
            mine, theirs = getattr(cls, name), getattr(DeviceBackend, name)
            if isinstance(theirs, property):
                continue
            assert list(inspect.signature(mine).parameters) == list(
                inspect.signature(theirs).parameters
            ), (cls, name)
    for backend in _backends():
        assert isinstance(backend.async_copies, bool)
        assert backend.prefetch_depth is None or backend.prefetch_depth >= 1
        assert backend.available_bytes(1) > 0
        event = backend.new_event()
        assert hasattr(event, "record") and hasattr(event, "synchronize")


def test_backend_properties():
    plain, linked = _backends()[:2]
    assert plain.aliases_host and not plain.async_copies and not plain.supports_pinning
    assert linked.async_copies and linked.prefetch_depth is None
    assert CudaBackend.is_cuda and CudaBackend.supports_pinning and not CudaBackend.aliases_host
    with pytest.raises(ValueError, match="link model"):
        CudaBackend(torch.device("cuda", 0), link_gbps=1.0)  # refused before touching CUDA
    with pytest.raises(ValueError, match="no RoundPipe device backend"):
        make_backend(torch.device("meta"))


@pytest.mark.parametrize("gbps", [None, 50.0])
def test_a_device_manager_moves_data_through_its_backend(gbps):
    dev = DeviceManager(0, torch.device("cpu"), link_gbps=gbps)
    try:
        assert isinstance(dev.backend, VirtualBackend) and not dev.is_cuda
        assert dev.async_copies == (gbps is not None)
        streams = dev.backend.create_streams("probe", None)
        assert isinstance(streams, Streams)
        for engine in (streams.h2d, streams.d2h):
            engine.shutdown()
        x = torch.randn(4, 3)
        (up,) = transfer.async_h2d(dev, [x])
        assert torch.equal(up, x) and up.data_ptr() != x.data_ptr()  # a real copy
        down, tag = transfer.async_d2h(dev, [up * 2, "tag"])
        transfer.prefetch_h2d(dev, [down])
        (again,) = transfer.async_h2d(dev, [down])  # waits for the arrival / the staged copy
        assert torch.equal(again, x * 2) and tag == "tag"
        dev.wait_activation_copies()
        dev.synchronize()
        assert dev.new_event().query()
    finally:
        dev.shutdown_controller()


def test_stage_upload_and_gradient_download_through_the_backend():
    roundpipe.init_devices(num_virtual=1, link_gbps=50.0)
    dev = roundpipe.get_devices()[0]
    layer = nn.Linear(3, 2)
    attr = roundpipe.attribute.make_layer_attribute("probe", layer, 0, None)
    stage = transfer.upload_layers([layer], [attr], dev, with_grad=True, prefetch=True)
    assert stage is not None and stage.aliases_host
    stage.wait_ready()
    stage.layers[0](torch.ones(5, 3)).sum().backward()
    state = RunState("probe")
    state.add_jobs(1)
    done = threading.Event()
    transfer.download_layer_async(
        stage, dev, False, True, "probe", state.failed, lambda err: (done.set(), state.job_done())
    )
    assert done.wait(30)
    assert layer.weight.grad is not None and torch.equal(layer.bias.grad, torch.full((2,), 5.0))
    wait_until(dev.idle, "device idle", timeout=30)
    assert dev.memory.resident == 0
    roundpipe.init_devices(num_virtual=1)


def test_device_and_transfer_code_do_not_branch_on_the_device_kind():
    for module in (device_mod, transfer):
        source = Path(module.__file__).read_text()
        branches = re.findall(r"(?:if|elif|else|and|or|not)\b[^\n]*\bis_cuda\b", source)
        assert branches == [], (module.__name__, branches)
        assert "torch.cuda.Stream" not in source and "torch.cuda.Event" not in source


def test_seed_paths_still_import():
    from roundpipe.device import DeviceManager as SeedDeviceManager
    from roundpipe.device import get_devices, init_devices  # noqa: F401
    from roundpipe.transfer import async_d2h, async_h2d, download_layer, upload_layers  # noqa: F401

    assert SeedDeviceManager is DeviceManager
    assert CopyEvent().query()


def test_host_tensors_from_a_linked_device_stay_plain_tensors():
    # the link's bookkeeping (arrival, staged crossing) is kept beside the tensors, not on them:
    # what a user gets back deep-copies and saves like any tensor
    dev = DeviceManager(0, torch.device("cpu"), link_gbps=50.0)
    try:
        (out,) = transfer.async_d2h(dev, [torch.ones(64)])
        transfer.prefetch_h2d(dev, [out])
        assert not out.__dict__
        copy.deepcopy(out)
        torch.save(out, io.BytesIO())
        assert torch.equal(transfer.async_h2d(dev, [out])[0], torch.ones(64))
    finally:
        dev.shutdown_controller()


@pytest.mark.parametrize(
    "name", ["devices.backend", "devices.virtual_backend", "devices.cuda_backend"]
)
def test_backend_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(f"roundpipe.{name}"))
    assert result.attempted > 0 and result.failed == 0
