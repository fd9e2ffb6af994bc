"""Transfers hidden behind compute: the copy engines (ordered lanes, real waitable events) and
proof, from each device's trace, that a device uploads its next stage and downloads gradients
while it computes; with no room in the budget it falls back to uploading at the stage start."""

from __future__ import annotations

import collections
import copy
import doctest
import importlib
import sys
import threading
import time

import pytest
import torch
from helpers import assert_close
from torch import nn

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.devices.link import CopyEngine, CopyEvent
from roundpipe.threads import RoundPipeTimeoutError

# -- copy engines ------------------------------------------------------------------------------


@pytest.fixture
def engine():
    eng = CopyEngine("test h2d", gbps=0.001, threaded=True, trace=collections.deque(maxlen=8))
    yield eng  # 1 MB/s: 1000 bytes hold the link for 1 ms
    eng.shutdown()


def test_copy_event_is_pending_until_the_engine_completes_it(engine):
    gate = threading.Event()
    ev = engine.bulk.submit("upload", "gated copy", 0, fn=gate.wait)
    assert not ev.query()  # a real event: the copy has not run
    with pytest.raises(RoundPipeTimeoutError, match="gated copy"):
        ev.synchronize(timeout=0.05)  # every wait is bounded
    marker = engine.bulk.record_event()  # completes after all work queued on the lane
    assert not marker.query()
    gate.set()
    marker.synchronize()
    assert ev.query() and marker.query()
    assert CopyEvent().query()  # an event nothing recorded is complete, as a CUDA event is


def test_lanes_keep_order_and_express_work_passes_a_bulk_transfer(engine):
    done: list[str] = []
    started, gate = threading.Event(), threading.Event()
    # 0.2 s of link for the first bulk transfer, which is held at the gate once it started
    first = engine.bulk.submit(
        "upload",
        "b0",
        200_000,
        fn=lambda: (started.set(), gate.wait()),
        then=lambda: done.append("b0"),
    )
    rest = [
        engine.bulk.submit("upload", f"b{i}", 1000, then=lambda i=i: done.append(f"b{i}"))
        for i in (1, 2)
    ]
    assert started.wait(30)
    urgent = engine.express.submit("h2d", "e0", 1000, then=lambda: done.append("e0"))
    gate.set()
    for ev in [first, *rest, urgent]:
        ev.synchronize()
    assert done == ["e0", "b0", "b1", "b2"]  # bulk in order; express slipped in first
    spans = {r.what: r for r in engine.trace}
    assert spans["b0"].start <= spans["e0"].start and spans["e0"].end <= spans["b0"].end
    assert spans["b0"].end <= spans["b1"].start <= spans["b1"].end <= spans["b2"].start


def test_a_caller_holding_the_link_pauses_the_bulk_transfer(engine):
    # The bulk transfer starts inside the hold (released from it), so the order below follows
    # from the events, not from how soon each thread is scheduled: released before the hold,
    # its 0.05 s of link ran out whenever the caller was late by as much.
    gate, started = threading.Event(), threading.Event()
    engine.bulk.submit("upload", "gate", 0, fn=lambda: gate.wait(30))  # parks the engine
    bulk = engine.bulk.submit("upload", "bulk", 50_000, fn=started.set)  # 0.05 s of link

    def start_bulk_while_held() -> None:
        gate.set()
        assert started.wait(30)
        assert not bulk.query()  # begun, and cannot end while the link is held

    # the calling thread keeps the link 0.1 s; unpaused, the bulk transfer would have ended
    # halfway through the hold; paused, it ends after it
    engine.express.hold("h2d", "held", 100_000, fn=start_bulk_while_held)
    bulk.synchronize()
    spans = {r.what: r for r in engine.trace}
    assert spans["held"].start <= spans["bulk"].start <= spans["held"].end <= spans["bulk"].end


def test_copy_errors_reach_the_waiter_and_the_engine_survives(engine):
    bad = engine.express.submit("h2d", "bad copy", 10, fn=lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bad.synchronize()
    engine.express.submit("h2d", "next copy", 10).synchronize()


def test_without_a_link_copies_run_inline():
    eng = CopyEngine("inline")
    out: list[int] = []
    ev = eng.bulk.submit("upload", "x", 10**9, fn=lambda: out.append(1), then=lambda: out.append(2))
    assert ev.query() and out == [1, 2]  # no thread, no modelled time
    with pytest.raises(ValueError, match="threaded"):
        CopyEngine("bad", gbps=1.0, threaded=False)


def test_bad_settings_are_clear_errors(monkeypatch, two_devices):
    monkeypatch.setenv("ROUNDPIPE_VIRTUAL_LINK_GBPS", "fast")
    with pytest.raises(ValueError, match="ROUNDPIPE_VIRTUAL_LINK_GBPS"):
        roundpipe.init_devices(num_virtual=1)
    monkeypatch.delenv("ROUNDPIPE_VIRTUAL_LINK_GBPS")
    with pytest.raises(ValueError, match="link_gbps"):
        roundpipe.init_devices(num_virtual=1, link_gbps=-1)
    assert len(roundpipe.get_devices()) == 2  # a refused setting leaves the devices alone
    monkeypatch.setenv("ROUNDPIPE_PREFETCH", "yes")
    model = RoundPipe(nn.Linear(4, 4), pin_model="off")
    with pytest.raises(ValueError, match="ROUNDPIPE_PREFETCH"), torch.no_grad():
        model(torch.randn(2, 4))


# -- overlap in a training step -----------------------------------------------------------------

WIDTH, N_LAYERS, N_MB = 256, 4, 2
# 0.05 GB/s: a layer's weights (256 KiB) hold the link ~5 ms, a microbatch's activations ~0.7 ms
GBPS = 0.05
GATE_TIMEOUT = 20.0  # s: a gate that is never opened fails the step instead of hanging it


def _one_layer_stages() -> roundpipe.ModelExecutePlan:
    plan = roundpipe.ModelExecutePlan()
    plan.fwd_plan = [range(i, i + 1) for i in range(N_LAYERS)]
    plan.bwd_plan = plan.fwd_plan[::-1]
    return plan


class _Gates:
    """Deterministic overlap: makes each stage's compute wait (bounded) until the next stage's
    upload on the same device landed, and each gradient download wait (bounded) until a later
    stage computed on its device. Where the runtime serialised them instead, a gate is never
    opened and the step fails after :data:`GATE_TIMEOUT`; where it overlaps them, the trace
    order below holds whatever the machine's load."""

    def __init__(self) -> None:
        self.enabled = False
        self.cond = threading.Condition()
        self.computed: dict[int, int] = collections.Counter()  # device id -> gate calls

    def __deepcopy__(self, memo) -> _Gates:
        return self  # shared by the model, its reference copy and the upload skeletons

    def device(self) -> roundpipe.device.DeviceManager:
        me = threading.current_thread()
        return next(d for d in roundpipe.get_devices() if d.controller_thread is me)

    def in_stage(self) -> None:
        """Called in every layer's compute, on the device's worker thread."""
        if not self.enabled:
            return
        dev = self.device()
        with self.cond:
            self.computed[dev.id] += 1
            self.cond.notify_all()

        def next_upload_landed() -> bool:
            records = list(dev.trace)
            uploads = sum(r.kind == "upload" for r in records)
            computes = sum(r.kind == "compute" for r in records)
            return uploads >= computes + 2 or not dev._queue  # the last stage has no next

        deadline = time.monotonic() + GATE_TIMEOUT
        while not next_upload_landed():  # the copy engines append to the trace: poll it
            if time.monotonic() > deadline:
                raise TimeoutError(f"the next stage on {dev} was not uploaded during this one")
            time.sleep(0.001)

    def gate_downloads(self, monkeypatch, dev) -> None:
        """Hold each gradient download (but a device's last) on the d2h engine until its device
        computed again. It holds the engine thread: safe here, where nothing a stage computes on
        waits for a device -> host copy queued behind a download (backward stages start from
        inputs saved long before)."""
        lane = dev.grad_downstream
        submit = lane.submit

        def gated(kind, what, nbytes, fn=None, then=None, event=None):
            if not (self.enabled and kind == "download" and dev._queue):
                return submit(kind, what, nbytes, fn, then, event)
            with self.cond:
                seen = self.computed[dev.id]

            def wait_for_next_stage() -> None:
                with self.cond:
                    if not self.cond.wait_for(lambda: self.computed[dev.id] > seen, GATE_TIMEOUT):
                        raise TimeoutError(f"no stage computed on {dev} while {what} downloaded")
                if fn is not None:
                    fn()

            return submit(kind, what, nbytes, wait_for_next_stage, then, event)

        monkeypatch.setattr(lane, "submit", gated)


class _Gate(nn.Module):
    def __init__(self, gates: _Gates) -> None:
        super().__init__()
        self.gates = gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gates.in_stage()
        return x


def _reference(gates: _Gates | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(N_LAYERS)]
    if gates is None:
        return nn.Sequential(*layers)
    return nn.Sequential(*[nn.Sequential(layer, _Gate(gates)) for layer in layers])


def _traced_step(
    monkeypatch, ndev: int, prefetch: bool, budget: int | None = None, gates: _Gates | None = None
):
    """One traced training step (after a warm-up step); returns the devices, the model and the
    loss next to plain PyTorch's."""
    monkeypatch.setenv("ROUNDPIPE_PREFETCH", "1" if prefetch else "0")
    devs = roundpipe.init_devices(num_virtual=ndev, link_gbps=GBPS, memory_limit=budget)
    ref = _reference(gates)
    net = copy.deepcopy(ref)
    cfg = RoundPipeRunConfig(num_microbatch=N_MB, execute_plan=_one_layer_stages())
    model = RoundPipe(net, pin_model="off", model_run_config=cfg, name="m")
    x, y = torch.randn(8 * N_MB, WIDTH), torch.randn(8 * N_MB, WIDTH)

    def loss_fn(out, lab):
        return nn.functional.mse_loss(out, lab) / N_MB

    model.forward_backward((x,), label=y, loss_fn=loss_fn)  # warm-up: skeletons, timers
    model.zero_grad()
    for d in devs:
        d.trace.clear()
    if gates is not None:
        for d in devs:
            gates.gate_downloads(monkeypatch, d)
        gates.enabled = True
    try:
        loss = model.forward_backward((x,), label=y, loss_fn=loss_fn)
    finally:
        if gates is not None:
            gates.enabled = False
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss")
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"grad {name}")
    return devs


def _pairs(dev):
    """(stage, next stage on the same device, uploads by stage, downloads by stage)."""
    computes = sorted((r for r in dev.trace if r.kind == "compute"), key=lambda r: r.start)
    uploads = {r.what: r for r in dev.trace if r.kind == "upload"}
    downloads = {r.what: r for r in dev.trace if r.kind == "download"}
    assert len(computes) >= 2 and set(uploads) == {c.what for c in computes}
    return list(zip(computes, computes[1:])), uploads, downloads


@pytest.mark.parametrize("ndev", [1, 2])
def test_next_stage_uploads_while_the_current_one_computes(monkeypatch, ndev):
    # the gates make the order deterministic where the runtime overlaps, and fail the step
    # where it does not (see _Gates): no assertion here depends on how fast anything ran
    devs = _traced_step(monkeypatch, ndev, prefetch=True, gates=_Gates())
    for dev in devs:
        pairs, uploads, downloads = _pairs(dev)
        for cur, nxt in pairs:
            # the ORDER that proves overlap: the next stage's parameters were on the link
            # before the current stage finished computing
            assert uploads[nxt.what].start < cur.end, (cur, uploads[nxt.what])
            if cur.what in downloads:  # the next stage computed before its gradients landed
                grads = downloads[cur.what]
                assert cur.end <= grads.start and nxt.start < grads.end, (cur, grads, nxt)


def test_gates_fail_a_step_that_does_not_overlap(monkeypatch):
    # the check above can fail: without prefetch the first gate is never opened
    monkeypatch.setattr(sys.modules[__name__], "GATE_TIMEOUT", 0.5)
    with pytest.raises(TimeoutError, match="was not uploaded during this one"):
        _traced_step(monkeypatch, 1, prefetch=False, gates=_Gates())
    roundpipe.init_devices(num_virtual=1)


@pytest.mark.parametrize("ndev", [1, 2])
def test_without_prefetch_uploads_and_compute_take_turns(monkeypatch, ndev):
    # the same trace with ROUNDPIPE_PREFETCH=0 shows the opposite order: the test above can fail
    devs = _traced_step(monkeypatch, ndev, prefetch=False)
    for dev in devs:
        pairs, uploads, _ = _pairs(dev)
        for cur, nxt in pairs:
            assert uploads[nxt.what].start >= cur.end, (cur, uploads[nxt.what])


def test_budget_for_one_stage_falls_back_to_no_prefetch(monkeypatch):
    layer = WIDTH * WIDTH * 4 + WIDTH * 4
    budget = 2 * layer + layer // 2  # one stage with its gradients, never two stages with them
    devs = _traced_step(monkeypatch, 1, prefetch=True, budget=budget)
    (dev,) = devs
    pairs, uploads, _ = _pairs(dev)
    waited = [nxt for cur, nxt in pairs if uploads[nxt.what].start >= cur.end]
    # a stage with gradients never fits beside another: those uploads waited for the stage
    # before them to end (and the step above still equalled plain PyTorch, without deadlock)
    assert {n.what for n in waited} >= {f"m backward layers {i}-{i}" for i in range(N_LAYERS - 1)}
    assert 0 < dev.memory.peak <= budget and dev.memory.resident == 0


@pytest.mark.parametrize(
    "name", ["devices.link", "devices.device", "devices.transfer", "devices.threads"]
)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(f"roundpipe.{name}"))
    roundpipe.init_devices(num_virtual=1)  # examples re-create devices: leave plain ones
    assert result.attempted > 0 and result.failed == 0
