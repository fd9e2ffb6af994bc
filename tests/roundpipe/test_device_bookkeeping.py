"""Device-side bookkeeping: bounded upload marks, the budget's non-raising allocation, the
chunked parameter copy, release of uploads prepared for skipped jobs, and the import layering of
the package."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
import torch
from helpers import mlp
from torch import nn

import roundpipe
from roundpipe import device, transfer
from roundpipe.device import UPLOAD_MARK_LIMIT, DeviceManager, MemoryAccount
from roundpipe.devices.link import CopyEvent
from roundpipe.threads import RunState, wait_until

PACKAGE = Path(roundpipe.__file__).parent


@pytest.fixture
def cpu_device():
    dev = DeviceManager(0, torch.device("cpu"))
    yield dev
    dev.shutdown_controller()


def test_upload_marks_stay_bounded(cpu_device):
    # every stage upload records a mark; before issue 13 the list grew for the process life
    for _ in range(1000):
        cpu_device.mark_upload(CopyEvent())
    assert len(cpu_device.upload_mark) == 1  # complete marks are dropped: only the newest
    pending = [CopyEvent(done=False) for _ in range(UPLOAD_MARK_LIMIT + 10)]
    for ev in pending:
        cpu_device.mark_upload(ev)
    assert len(cpu_device.upload_mark) == UPLOAD_MARK_LIMIT  # a hard cap even when pending
    assert cpu_device.flush_upload_marks() == pending[-UPLOAD_MARK_LIMIT:]
    assert len(cpu_device.upload_mark) == 0


def test_training_with_a_link_keeps_upload_marks_bounded(monkeypatch):
    # with a modelled link each prefetched stage upload is a pending event when marked
    monkeypatch.setenv("ROUNDPIPE_PREFETCH", "1")
    roundpipe.init_devices(num_virtual=2, link_gbps=1.0)
    model = roundpipe.RoundPipe(
        mlp(),
        pin_model="off",
        model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=3),
    )
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.01)
    x, y = torch.randn(6, 8), torch.randn(6, 1)
    for _ in range(5):
        model.forward_backward(
            (x,), label=y, loss_fn=lambda out, lab: nn.functional.mse_loss(out, lab) / 3
        )
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    device.wait_devices_idle(timeout=30)
    for dev in device.get_devices():
        # dozens of uploads happened on every device, yet only the newest marks are kept
        # (a complete mark goes when the next is added; a device uploads the stages of at most
        # one run ahead: 13 stage jobs over the two devices)
        assert 1 <= len(dev.upload_mark) <= 7, dev
        assert dev.flush_upload_marks() == []  # and every upload completed


def test_try_allocate_never_raises_and_never_overcommits():
    acc = MemoryAccount("dev", budget=100)
    assert acc.try_allocate(70)
    assert not acc.try_allocate(31)  # would overflow: refused, nothing accounted
    assert acc.resident == 70 and acc.peak == 70
    assert acc.try_allocate(30)
    acc.free(100)
    assert MemoryAccount("unbounded", budget=None).try_allocate(10**15)


def test_chunked_parameter_copy_equals_the_source(monkeypatch):
    # large CUDA uploads are split so activation copies can run between the pieces; the split
    # copy runs on any device, so check it here, with a chunk that does not divide the tensor
    monkeypatch.setattr(transfer, "CHUNK_UPLOAD_SIZE", 4 * 7)
    host = torch.randn(5, 9)
    out = transfer._h2d_param(host, torch.device("cpu"))
    assert torch.equal(out, host) and out.data_ptr() != host.data_ptr()
    strided = torch.randn(9, 5).t()  # not contiguous: one plain copy
    assert torch.equal(transfer._h2d_param(strided, torch.device("cpu")), strided)


class _Prepared:
    def __init__(self) -> None:
        self.freed = 0

    def free(self) -> None:
        self.freed += 1


def test_upload_prepared_for_a_skipped_job_is_freed():
    dev = DeviceManager(0, torch.device("cpu"), link_gbps=100.0)  # asynchronous: prefetches
    try:
        state = RunState("demo")
        gate = threading.Event()
        prepared: list[_Prepared] = []

        def prepare() -> _Prepared:
            prepared.append(_Prepared())
            return prepared[-1]

        def first() -> None:
            assert dev.take_prepared(state) is None  # the first job uploads for itself
            dev.prefetch_next()  # it holds its stage: the uploader prepares the next job
            gate.wait(30)
            raise ValueError("boom")

        dev.submit(state, "first", first, prepare=prepare)
        dev.submit(state, "second", lambda: None, prepare=prepare)  # prefetched, then skipped
        while not prepared and not state.failed():
            threading.Event().wait(0.01)
        gate.set()
        with pytest.raises(ValueError, match="boom"):
            state.join()
        wait_until(dev.idle, "device idle", timeout=30)
        assert len(prepared) == 1 and prepared[0].freed == 1  # never claimed: freed by the device
    finally:
        dev.shutdown_controller()


def _imports(path: Path) -> list[tuple[str, ast.stmt, bool]]:
    """(imported roundpipe module, node, inside a function) for every import in ``path``."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    package = package.removesuffix(".__init__")
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - child.level + 1]
                tail = [child.module] if child.module else []
                target = ".".join(base + tail) if child.level else child.module or ""
                if child.module is None:  # `from . import x`: the submodules
                    out.extend((f"{target}.{a.name}", child, in_function) for a in child.names)
                else:
                    out.append((target, child, in_function))
            elif isinstance(child, ast.Import):
                out.extend((a.name, child, in_function) for a in child.names)
            visit(child, nested)

    visit(ast.parse(path.read_text()), False)
    return [(m, n, f) for m, n, f in out if m == "roundpipe" or m.startswith("roundpipe.")]


def test_roundpipe_imports_form_layers_without_cycles():
    # devices execute, runtime/run.py launches, the wrappers sit on top: no import arrow points back
    # up, not even a lazy or a TYPE_CHECKING one
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        name = name.removesuffix(".__init__")
        graph[name] = {m for m, _, _ in _imports(path) if m != name}
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            raise AssertionError(
                "import cycle: " + " -> ".join(stack[stack.index(node) :] + [node])
            )
        if node in done or node not in graph:
            return
        for dep in sorted(graph[node]):
            visit(dep, stack + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    assert "roundpipe.runtime.run" not in graph["roundpipe.devices.device"]


def test_function_level_imports_say_why_they_are_deferred():
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    around = lines[node.lineno - 2 : node.lineno]
                    assert any("# deferred:" in line for line in around), (
                        f"{path.name}:{node.lineno} imports inside a function without a "
                        "'# deferred: <why>' comment"
                    )
