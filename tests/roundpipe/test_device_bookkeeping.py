"""Device-side bookkeeping: bounded upload marks, the inter-stream memory manager, the
transfer helpers the internal API keeps, and the import layering of the package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from helpers import mlp
from torch import nn

import roundpipe
from roundpipe import device
from roundpipe.device import UPLOAD_MARK_LIMIT, DeviceManager, gc_collect
from roundpipe.transfer import (
    PinnedUpload,
    RegisterBackwardEvent,
    chunk_layer_params,
    create_upload_pair,
)

PACKAGE = Path(roundpipe.__file__).parent


@pytest.fixture
def cpu_device():
    dev = DeviceManager(0, torch.device("cpu"))
    yield dev
    dev.shutdown_controller()


def test_upload_marks_stay_bounded(cpu_device):
    # every host-to-device upload records a mark; before, the list grew for the process life
    for _ in range(1000):
        cpu_device.mark_upload()
    assert len(cpu_device.upload_mark) == 1  # CPU marks complete at once: only the newest
    assert cpu_device.upload_mark.maxlen == UPLOAD_MARK_LIMIT  # a hard cap even when pending
    assert cpu_device.flush_upload_marks() == []  # nothing pending
    assert len(cpu_device.upload_mark) == 0


def test_training_keeps_upload_marks_bounded(two_devices):
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
        # uploads happened on every device, yet only the newest (complete) mark is kept
        assert len(dev.upload_mark) == 1, dev


def test_inter_stream_mem_manager_holds_until_streams_pass(cpu_device):
    mm = cpu_device.mem_manager
    t = torch.ones(256)
    mm.free(t.untyped_storage(), cpu_device.compute_stream, cpu_device.downstream)
    assert len(mm.free_queue) == 1  # held, with one marker per using stream
    assert len(mm.free_queue[0][1]) == 2
    mm.stream_synced()
    assert mm.free_queue == []  # CPU markers are complete: released

    mm.record_stream(t, cpu_device.upstream, cpu_device.compute_stream)
    with pytest.raises(RuntimeError, match="last used on another stream"):
        mm.record_stream(t, cpu_device.upstream, cpu_device.downstream)
    mm.flush()  # tracked tensors move to the free queue
    assert mm.in_use == {} and len(mm.free_queue) == 1
    assert len(mm.free_queue[0][1]) == 2  # upload and compute stream
    device.device_list.append(cpu_device)  # gc_collect walks the managed devices
    try:
        gc_collect()
    finally:
        device.device_list.remove(cpu_device)
    assert mm.free_queue == []


def test_pinned_upload_and_backward_event_are_differentiable(cpu_device):
    x = torch.randn(3, 2, requires_grad=True)
    y = PinnedUpload.apply(x, cpu_device.device)
    assert y.data_ptr() != x.data_ptr()  # a real copy
    z = RegisterBackwardEvent.apply(y * 2, cpu_device.new_event())
    z.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3, 2), 2.0), rtol=0, atol=0)


def test_create_upload_pair_registers_the_copy():
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    srcs = [torch.randn(5), torch.randn(2, 3), torch.randn(1)]
    dsts = [create_upload_pair(pairs, s, torch.device("cpu")) for s in srcs]
    assert [p[1] for p in pairs] == dsts
    for chunk in chunk_layer_params(pairs, 2):
        for src, dst in chunk:
            dst.copy_(src)
    for s, d in zip(srcs, dsts):
        assert torch.equal(s, d) and d.data_ptr() != s.data_ptr()


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
    # devices execute, run.py launches, the wrapper sits on top: no import arrow points back
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
    assert "roundpipe.run" not in graph["roundpipe.device"]


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
