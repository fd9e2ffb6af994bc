"""Core runtime: stage jobs executed on device workers, and the autograd bridge.

One call of a RoundPipe model becomes a :class:`RoundPipeRun`. Its forward stages, the
fused last stage and the backward stages are queued on devices round-robin, in a global
order in which every job only depends on earlier jobs, so the pipeline cannot deadlock.
Activations and gradients travel between stages through host memory.

Overlap, on devices with asynchronous copies (CUDA, a modelled link): each job comes with its
stage upload, which the device runs on its uploader thread while the job before it computes,
after the same fences the job would pass (prefetch, ``ROUNDPIPE_PREFETCH``, on by default; see
:func:`roundpipe.device.prefetch_enabled`; it never waits for device memory: a stage that does not
fit beside the running one uploads when it starts). A stage with gradients hands them to the
device's d2h engine and returns: they land on the host while the next stage computes, and the run
is not finished (``RunState.join``) until they have.

Recompute (``recompute_grain``): forward stages run without autograd and backward recomputes.
``"stage"`` keeps each backward stage's input and recomputes the whole stage with autograd
recording, so all its layers' activations are on the device at once. ``"layer"`` keeps every
layer's input on the host (copied there as forward produces it) and recomputes each layer once,
last to first, right before its backward: one layer's activations at a time.

Memory: CUDA devices are measured by their allocator; on CPU virtual devices
``ROUNDPIPE_ACCOUNT_ACTIVATIONS=1`` accounts the activations of each stage job on the device's
``MemoryAccount`` beside the parameters (:mod:`roundpipe.runtime.activations`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..devices.device import DeviceManager, get_devices, get_next_device, prefetch_enabled
from ..devices.link import TraceRecord
from ..devices.threads import RunState
from ..devices.transfer import (
    StageOnDevice,
    async_d2h,
    async_h2d,
    download_layer,
    download_layer_async,
    prefetch_h2d,
    upload_layers,
)
from ..errors import RoundPipeRuntimeError, RoundPipeTypeError, RoundPipeValueError
from .activations import ActivationAccount, accounting_enabled
from .batch import Batch
from .context import ForwardCtx, RecomputeCtx
from .plan import ModelExecutePlan, ModelTracker, PipelineModel
from .profile import annotate
from .rng import derive_seed
from .run_config import FullRoundPipeRunConfig

__all__ = [
    "RoundPipeBatchedBackward",
    "RoundPipeRun",
    "RoundPipeRunContext",
    "run_backward",
    "run_forward",
    "run_forward_backward",
]

_cpu_rng_lock = threading.RLock()
# the activation account of the stage job running on this (worker) thread, if any
_job_account = threading.local()

# a boundary state: (leaves, treespec, is_call_args); is_call_args marks the (args, kwargs)
# of the first layer, otherwise the value is the previous layer's output.
State = tuple[list[Any], Any, bool]


def call_layer(layer: torch.nn.Module, leaves: list[Any], spec: Any, is_args: bool) -> Any:
    """Call ``layer`` on a boundary state: a plain tuple output is unpacked as ``*args``."""
    value = pytree.tree_unflatten(leaves, spec)
    if is_args:
        args, kwargs = value
        return layer(*args, **kwargs)
    if type(value) is tuple:
        return layer(*value)
    return layer(value)


# calls one layer of a stage: (layer id, layer, input leaves, input spec, is_call_args) -> output
LayerCall = Callable[[int, torch.nn.Module, list[Any], Any, bool], Any]


def _run_chain(
    layer_ids: range,
    layers: list[torch.nn.Module],
    state: State,
    call: LayerCall,
) -> tuple[Any, list[Any], Any]:
    """Run ``layers`` in order, each on the previous one's output; the first gets ``state``.

    Returns the last output with its flattened leaves and spec.
    """
    h, hs, ha = state
    out = None
    for li, layer in zip(layer_ids, layers):
        out = call(li, layer, h, hs, ha)
        h, hs = pytree.tree_flatten(out)
        ha = False
    return out, h, hs


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


class RoundPipeRunContext:
    """Per-microbatch state shared between the forward and backward of one run."""

    def __init__(self, microbatch_id: int) -> None:
        self.microbatch_id = microbatch_id
        self.saved_inputs: dict[int, State] = {}
        self.recompute_data: dict[int, tuple] = {}
        self.grad_states: list[Any] | None = None
        self.outputs: State | None = None
        self._lock = threading.Lock()

    def save_input(self, layer_id: int, state: State) -> None:
        """Keep the (host) input of ``layer_id`` for backward recompute."""
        self.saved_inputs[layer_id] = state

    def save_for_recompute(self, layer_id: int, device: DeviceManager, *data: Any) -> None:
        """Keep ``data`` (moved to host) for the recompute of ``layer_id``."""
        for x in pytree.tree_leaves(data):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                raise RoundPipeValueError("save_for_recompute: saved tensors must not require grad")
        with self._lock:
            if layer_id in self.recompute_data:
                raise RoundPipeRuntimeError(f"save_for_recompute called twice by layer {layer_id}")
            leaves, spec = pytree.tree_flatten(data)
            self.recompute_data[layer_id] = pytree.tree_unflatten(_to_host(device, leaves), spec)

    def cut_recompute_data(self, layer_id: int) -> Any:
        """Retrieve and forget the data saved by ``layer_id``."""
        with self._lock:
            return self.recompute_data.pop(layer_id, None)

    def fetch_recompute_data(self, layer_id: int, device: DeviceManager) -> Any:
        """Data saved by ``layer_id``, copied to ``device`` (``None`` if nothing was saved)."""
        with self._lock:
            data = self.recompute_data.get(layer_id)
        if data is None:
            return None
        leaves, spec = pytree.tree_flatten(data)
        return pytree.tree_unflatten(async_h2d(device, leaves), spec)


# the caller's autocast regions: ((device type, dtype), ...) and whether the cast cache is on
AutocastSettings = tuple[tuple[tuple[str, torch.dtype], ...], bool]


def _caller_autocast() -> AutocastSettings | None:
    """The autocast regions (CUDA and CPU) the calling thread is in, or None."""
    regions = tuple(
        (dev, torch.get_autocast_dtype(dev))
        for dev in ("cuda", "cpu")
        if torch.is_autocast_enabled(dev)
    )
    return (regions, torch.is_autocast_cache_enabled()) if regions else None


def _under_autocast(settings: AutocastSettings, job: Callable[..., None], *args: Any) -> None:
    """Run a stage job inside the caller's autocast regions."""
    regions, cache = settings
    with contextlib.ExitStack() as stack:
        for dev, dtype in regions:
            stack.enter_context(torch.autocast(dev, dtype=dtype, cache_enabled=cache))
        job(*args)


class RoundPipeRun:
    """Everything one call of a RoundPipe model needs: batch, plan, progress, errors."""

    def __init__(
        self,
        model: PipelineModel,
        config: FullRoundPipeRunConfig,
        batch: Batch,
        plan: ModelExecutePlan,
        enable_grad: bool,
        kind: str,
    ) -> None:
        self.model = model
        self.config = config
        self.batch = batch
        # a forward_backward plan in the user guide's spelling (fwd_plan stopping before the
        # fused stage) runs as the fused stage closing fwd_plan; check_valid lets such a plan
        # through for "fused" only, every other plan is kept as is
        self.plan = plan.fused_layout()
        self.enable_grad = enable_grad
        self.state = RunState(f"{model.name} {kind}")
        self.tracker = ModelTracker(self.plan, self.state)
        self.num_microbatch = batch.num_microbatch
        self.contexts = [RoundPipeRunContext(m) for m in range(self.num_microbatch)]
        self.timer = model.model_timer.new_iter(use_cuda_events=get_devices()[0].is_cuda)
        self.base_seed: int | None = None
        if config.preserve_rng_state:
            self.base_seed = int(torch.randint(0, 2**62, (1,)).item())
        # which first-layer input leaves need gradients (only caller tensors requiring grad)
        self.input_grad_mask = [
            [isinstance(t, torch.Tensor) and t.requires_grad for t in leaves]
            for leaves in batch.flatten_states
        ]
        self.states: list[State] = [
            (list(leaves), spec, True)
            for leaves, spec in zip(batch.flatten_states, batch.flatten_specs)
        ]
        self.loss_fn: Callable | None = None
        self.return_outputs = False
        # prefetch stage uploads (devices with asynchronous copies only); read once per call
        self.prefetch = prefetch_enabled()
        # autocast is thread-local: the caller's regions are re-entered by every stage job,
        # backward ones included (their recompute must cast as the forward did)
        self.autocast = _caller_autocast()
        # account activations on CPU virtual devices (ROUNDPIPE_ACCOUNT_ACTIVATIONS); read once
        self.account_activations = accounting_enabled()
        # layer grain: forward keeps every (recomputed) layer's input, backward recomputes
        # each layer once from it
        self.layer_grain = config.recompute_grain == "layer"
        # a forward stage's output handed to the next stage on the same device without a round
        # trip over the link (microbatch -> (device, device copies)); with one device only, where
        # the next stage always runs there. Activation accounting measures the plain path.
        self.handoff: dict[int, tuple[DeviceManager, list[Any]]] = {}
        self.hands_off = len(get_devices()) == 1 and not self.account_activations

    # -- helpers used by stage jobs --------------------------------------------------------
    @contextlib.contextmanager
    def rng(self, device: DeviceManager, layer_id: int, microbatch_id: int) -> Iterator[None]:
        """Seed random ops of one layer call from (run seed, layer, microbatch)."""
        if self.base_seed is None:
            yield
            return
        seed = derive_seed(self.base_seed, layer_id, microbatch_id)
        if device.is_cuda:
            gen = torch.cuda.default_generators[device.device.index or 0]
            lock: contextlib.AbstractContextManager = contextlib.nullcontext()
        else:
            # CPU virtual devices share the global CPU generator: serialize seeded sections
            gen, lock = torch.default_generator, _cpu_rng_lock
        with lock:
            saved = gen.get_state()
            gen.manual_seed(seed)
            try:
                yield
            finally:
                gen.set_state(saved)

    def layer_attrs(self, layers: range) -> list[Any]:
        return [self.model.layer_attrs[i] for i in layers]

    def host_layers(self, layers: range) -> list[torch.nn.Module]:
        return [self.model.layers[i] for i in layers]

    # -- launching -------------------------------------------------------------------------
    # Jobs are queued here, on the next device round-robin; a device only executes them.
    def _launch(
        self, what: str, job: Callable[..., None], layers: range, kind: str, *args: Any
    ) -> None:
        device = get_next_device()
        prepare = None
        if self.prefetch and device.async_copies:  # the device uploads the stage ahead of the job
            prepare = functools.partial(_upload_stage, device, self, layers, kind, prefetch=True)
        if self.autocast:
            job = functools.partial(_under_autocast, self.autocast, job)
        device.submit(
            self.state,
            f"{what} on {device.device}:{device.id}",
            job,
            device,
            self,
            *args,
            prepare=prepare,
        )

    def launch_forward(self, fused: bool) -> None:
        """Queue forward stages (and, when ``fused``, the fused stage and backward stages)."""
        n_fwd = len(self.plan.fwd_plan) - (1 if fused else 0)
        for gid in range(n_fwd):
            self._launch(
                f"forward group {gid}", run_forward, self.plan.fwd_plan[gid], "forward", gid
            )
        if fused:
            self._launch(
                "fused forward-backward", run_forward_backward, self.plan.bwd_plan[0], "fused"
            )
            for gid in range(1, len(self.plan.bwd_plan)):
                self._launch(
                    f"backward group {gid}", run_backward, self.plan.bwd_plan[gid], "backward", gid
                )

    def launch_backward(self) -> None:
        """Queue all backward stages (non-fused training)."""
        for gid in range(len(self.plan.bwd_plan)):
            self._launch(
                f"backward group {gid}", run_backward, self.plan.bwd_plan[gid], "backward", gid
            )

    def join(self) -> None:
        """Wait for every queued job; re-raise the first worker error here."""
        try:
            self.state.join()
        finally:
            self.timer.finish()

    def input_grads(self) -> list[list[Any]]:
        """Per-microbatch gradients of the first layer's input leaves."""
        out = []
        for ctx, leaves in zip(self.contexts, self.batch.flatten_states):
            g = ctx.grad_states
            out.append(list(g) if g is not None else [None] * len(leaves))
        return out


# stage kind -> (LayerAttribute fence, gradients uploaded and downloaded, buffers downloaded)
_STAGE_KINDS = {
    "forward": ("forward_fence", False, True),
    "backward": ("backward_fence", True, False),
    "fused": ("forward_backward_fence", True, True),
}


def _stage_name(run: RoundPipeRun, layers: range, kind: str) -> str:
    return f"{run.model.name} {kind} layers {layers.start}-{layers.stop - 1}"


def _upload_stage(
    device: DeviceManager, run: RoundPipeRun, layers: range, kind: str, prefetch: bool
) -> StageOnDevice | None:
    """Pass the layers' fences for a stage of ``kind``, then upload them; a ``prefetch`` gets
    None when the device budget cannot hold them beside the running stage."""
    fence, with_grad, _ = _STAGE_KINDS[kind]
    attrs = run.layer_attrs(layers)
    for attr in attrs:
        getattr(attr, fence)(run.state)
    what = _stage_name(run, layers, kind)
    return upload_layers(run.host_layers(layers), attrs, device, with_grad, what, prefetch=prefetch)


def _landed(
    run: RoundPipeRun, what: str, device: DeviceManager, error: BaseException | None
) -> None:
    """A stage's gradients reached the host (or failed to): the run's deferred job is done."""
    if error is not None:
        run.state.fail(error, f"gradient download of {what} on {device.device}:{device.id}")
    run.state.job_done()


@contextlib.contextmanager
def _stage_on(
    device: DeviceManager, run: RoundPipeRun, layers: range, kind: str
) -> Iterator[StageOnDevice]:
    """The uploaded ``layers`` for a stage of ``kind``: the upload the device prepared ahead,
    or one made now (after the fences); when the block succeeds, copy buffers / gradients back
    to the host (gradients in the background where copies are asynchronous); the device
    copies are always freed.

    Stages with a backward are timed as a whole (forward stages time each layer).
    """
    _, with_grad, with_buffer = _STAGE_KINDS[kind]
    what = _stage_name(run, layers, kind)
    stage = device.take_prepared(run.state)
    if stage is None:  # not prefetched (or no room for it beside the stage before)
        stage = _upload_stage(device, run, layers, kind, prefetch=False)
        assert stage is not None
    device.prefetch_next()  # this stage holds its memory: the next one may take what is left
    handed_off = False
    try:
        stage.wait_ready()
        start = time.perf_counter()
        timed = run.timer.time_bwd(layers, device.compute_stream) if with_grad else None
        with timed or contextlib.nullcontext(), _accounting(run, device, what):
            yield stage
        device.trace.append(TraceRecord("compute", what, start, time.perf_counter()))
        if with_grad and stage.aliases_host:
            # the stage read the host parameters in place up to here: only now may a pending
            # optimizer copy-back overwrite them (see _backward_inputs for real copies)
            for attr in run.layer_attrs(layers):
                attr.backward_uploaded()
        if with_grad and device.async_copies:
            run.state.add_jobs(1)  # the gradients land after this job returned
            handed_off = True
            download_layer_async(
                stage,
                device,
                with_buffer,
                with_grad,
                what,
                run.state.failed,
                functools.partial(_landed, run, what, device),
            )
        else:
            download_layer(stage, device, with_buffer=with_buffer, with_grad=with_grad, what=what)
    finally:
        if not handed_off:
            stage.free()


@contextlib.contextmanager
def _accounting(run: RoundPipeRun, device: DeviceManager, what: str) -> Iterator[None]:
    """Account the activations of a stage's compute on a CPU virtual device's memory when the
    run asks for it (see :mod:`roundpipe.runtime.activations`); what is still counted at the
    end (gradients, outputs) leaves the device with the stage."""
    if not run.account_activations or device.is_cuda:
        yield
        return
    account = ActivationAccount(device.memory, what)
    _job_account.current = account
    try:
        with account:
            yield
    finally:
        _job_account.current = None
        account.release_all()


def _to_host(device: DeviceManager, leaves: Sequence[Any], copy: bool = False) -> list[Any]:
    """:func:`async_d2h` of ``leaves``, no longer counted on the device's activation account.

    A CPU virtual device hands its tensors to the host without a copy; ``copy`` makes a real
    one there, for tensors the device keeps using (a layer input kept for recompute while the
    layer computes on it, which may also change it in place).
    """
    if copy and not device.is_cuda:
        leaves = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in leaves]
    out = async_d2h(device, leaves)
    account: ActivationAccount | None = getattr(_job_account, "current", None)
    if account is not None:
        account.release(out)
    return out


def _grads_handed_over(layers: Sequence[torch.nn.Module]) -> None:
    """Parameter gradients already accounted with the stage upload: not activations."""
    account: ActivationAccount | None = getattr(_job_account, "current", None)
    if account is not None:
        account.release(p.grad for layer in layers for p in layer.parameters())


def _save_fn(
    run: RoundPipeRun, ctx: RoundPipeRunContext, layer_id: int, device: DeviceManager
) -> Callable[..., None]:
    return lambda *data: ctx.save_for_recompute(layer_id, device, *data)


def _forward_layer(
    run: RoundPipeRun,
    device: DeviceManager,
    ctx: RoundPipeRunContext,
    stage_input: tuple[list[Any], int],
    li: int,
    layer: torch.nn.Module,
    x: list[Any],
    spec: Any,
    is_args: bool,
) -> Any:
    """Forward one layer without autograd, keeping its host input when backward needs it.

    ``stage_input`` is the stage's host input leaves and first layer id: the first layer's
    input is already on the host.
    """
    m = ctx.microbatch_id
    if run.enable_grad and (run.layer_grain or run.tracker.backward_need_input(li)):
        host_leaves, first = stage_input
        host = host_leaves if li == first else _to_host(device, x, copy=True)
        ctx.save_input(li, (host, spec, is_args))
    fwd_ctx = ForwardCtx(_save_fn(run, ctx, li, device)) if run.enable_grad else None
    with (
        torch.no_grad(),
        annotate(f"fwd layer {li} mb {m}"),
        run.rng(device, li, m),
        run.timer.time_fwd("fwd", li, device.compute_stream),
        fwd_ctx or contextlib.nullcontext(),
    ):
        return call_layer(layer, x, spec, is_args)


def _output_events(device: DeviceManager, with_backward: bool) -> tuple[Any, Any]:
    """(forward, backward) events of a microbatch's outputs just copied to the host: both
    complete once the copies did (the consumer's recompute reads the same host data); no
    backward event where no backward will run."""
    event = device.new_event()
    event.record(device.downstream)
    return event, (event if with_backward else None)


def _prefetch_inputs(run: RoundPipeRun, device: DeviceManager, kind: str, gid: int, m: int) -> None:
    """While microbatch ``m`` computes in group ``gid`` (of ``kind``): start moving the next
    microbatch's stage input, and in the fused stage this microbatch's label, across the
    device's link (:func:`~roundpipe.devices.transfer.prefetch_h2d`; only a CPU virtual device
    with a modelled link has anything to start). On the last microbatch of a backward (or the
    fused) stage, the next backward stage's first input goes ahead when that stage runs on this
    device too (one device)."""
    if device.link_gbps is None:
        return
    nxt, leaves = m + 1, []
    if kind == "backward" and nxt < run.num_microbatch:
        leaves += _backward_input(run, gid, nxt)
    elif (
        kind != "backward"
        and nxt < run.num_microbatch
        and run.tracker.forward_ready(gid, nxt)
        and not _handed_off(run, device, nxt)
    ):
        leaves += run.states[nxt][0]
    if kind == "fused":
        leaves += pytree.tree_leaves(run.batch.label_list[m])
    if kind != "forward" and nxt == run.num_microbatch and run.hands_off:
        next_gid = gid + 1 if kind == "backward" else 1  # the fused stage is backward group 0
        if next_gid < len(run.plan.bwd_plan):
            leaves += _backward_input(run, next_gid, 0)
    prefetch_h2d(device, leaves)


def _backward_input(run: RoundPipeRun, gid: int, m: int) -> list[Any]:
    """The host tensors backward group ``gid`` uploads first for microbatch ``m``: the group's
    saved input (stage grain), or its last layer's (layer grain walks last to first)."""
    layers = run.plan.bwd_plan[gid]
    saved = run.contexts[m].saved_inputs.get(layers[-1] if run.layer_grain else layers.start)
    return list(saved[0]) if saved is not None else []


def _stage_input(run: RoundPipeRun, device: DeviceManager, m: int, leaves: list[Any]) -> list[Any]:
    """Microbatch ``m``'s stage input on ``device``: the previous stage's output it kept there
    (:func:`_hand_off`), else an upload of the host copy."""
    kept = run.handoff.pop(m, None)
    if kept is not None and kept[0] is device:
        return kept[1]
    return async_h2d(device, leaves)


def _hand_off(run: RoundPipeRun, device: DeviceManager, m: int, x: list[Any]) -> None:
    """Keep a device copy of a forward stage's output for the next stage (same device): it
    then needs no upload. A copy, because the host copy of a virtual device aliases ``x``
    and a CUDA download may still read it, while the next stage may change its input in
    place."""
    run.handoff[m] = (device, [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in x])


def _handed_off(run: RoundPipeRun, device: DeviceManager, m: int) -> bool:
    kept = run.handoff.get(m)
    return kept is not None and kept[0] is device


def run_forward(device: DeviceManager, run: RoundPipeRun, layer_group_id: int) -> None:
    """Forward one layer group over all microbatches (no autograd graph is kept)."""
    layers = run.plan.fwd_plan[layer_group_id]
    with _stage_on(device, run, layers, "forward") as stage:
        for m in range(run.num_microbatch):
            run.tracker.forward_wait_for(layer_group_id, m)
            ctx = run.contexts[m]
            leaves, spec, is_args = run.states[m]
            if is_args:  # the caller's inputs: packed ones may still be on their way
                run.batch.wait_forward_events(m, run.state)
            forward = functools.partial(_forward_layer, run, device, ctx, (leaves, layers.start))
            state = (_stage_input(run, device, m, leaves), spec, is_args)
            _prefetch_inputs(run, device, "forward", layer_group_id, m)
            _, x, spec = _run_chain(layers, stage.layers, state, forward)
            run.states[m] = (_to_host(device, x), spec, False)
            if run.hands_off and layer_group_id < len(run.plan.fwd_plan) - 1:
                _hand_off(run, device, m, x)
            del x, state  # the device copies: free before the next microbatch
            if layer_group_id == len(run.plan.fwd_plan) - 1:
                run.batch.output_events[m] = _output_events(device, run.enable_grad)
            run.tracker.forward_notify(layer_group_id)


def _prepare_inputs(
    run: RoundPipeRun,
    device: DeviceManager,
    layers: range,
    m: int,
    state: State,
    handoff: bool = False,
) -> list[Any]:
    """Upload a stage input (with ``handoff``, take the one the previous forward stage kept on
    ``device`` where it did) and mark the leaves whose gradients backward must produce."""
    leaves, _, _ = state
    x = _stage_input(run, device, m, leaves) if handoff else async_h2d(device, leaves)
    for i, t in enumerate(x):
        needs = run.input_grad_mask[m][i] if layers.start == 0 else _is_float(t)
        if needs:
            t.requires_grad_(True)
    return x


def _backward(outputs: Sequence[Any], grads: Sequence[Any] | None) -> None:
    """Back-propagate ``grads`` into ``outputs`` (pairs without a gradient are skipped)."""
    if grads is None:
        return
    if len(outputs) != len(grads):
        raise RoundPipeRuntimeError(
            f"backward got {len(grads)} gradients for {len(outputs)} stage outputs; "
            "a layer's output structure changed between forward and recompute"
        )
    ts, gs = [], []
    for o, g in zip(outputs, grads):
        if isinstance(o, torch.Tensor) and o.requires_grad and g is not None:
            ts.append(o)
            gs.append(g.to(o.device) if g.device != o.device else g)
    if ts:
        torch.autograd.backward(ts, gs)


def _input_grads(x: list[Any]) -> list[Any]:
    return [t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in x]


def _recompute_layer(
    run: RoundPipeRun,
    device: DeviceManager,
    ctx: RoundPipeRunContext,
    li: int,
    layer: torch.nn.Module,
    x: list[Any],
    spec: Any,
    is_args: bool,
) -> Any:
    data = ctx.fetch_recompute_data(li, device)
    with (
        annotate(f"recompute layer {li} mb {ctx.microbatch_id}"),
        run.rng(device, li, ctx.microbatch_id),
        run.timer.time_fwd("re", li, device.compute_stream),
        RecomputeCtx(data),
    ):
        return call_layer(layer, x, spec, is_args)


def _backward_inputs(
    run: RoundPipeRun,
    device: DeviceManager,
    layers: range,
    stage: StageOnDevice,
    wait: Callable[[int], None],
    host_state: Callable[[RoundPipeRunContext], State],
    upload: bool = True,
    handoff: bool = False,
) -> Iterator[tuple[RoundPipeRunContext, State]]:
    """Per microbatch in order, once ``wait(m)`` returned: its context and its stage input
    (``host_state(ctx)``) uploaded, leaves needing gradients marked (with ``upload=False``, the
    host state itself: the caller uploads it when it needs it; with ``handoff``, the fused
    stage's input the previous forward stage kept on the device where it did).

    Once microbatch 0 arrived, a stage holding its own copy of the parameters (CUDA) signals
    that this run's backward has it: by then every forward stage of this run uploaded these
    layers too (the backward job may have uploaded early, before the forward stage of the same
    layers on another device), so a pending optimizer copy-back can no longer make forward and
    backward see different values. A stage using the host parameters in place (CPU) signals
    when its compute ended instead (:func:`_stage_on`).
    """
    for m in range(run.num_microbatch):
        wait(m)
        if m == 0 and not stage.aliases_host:
            for attr in run.layer_attrs(layers):
                attr.backward_uploaded()
        ctx = run.contexts[m]
        state = host_state(ctx)
        if state[2]:  # the caller's inputs, read (again) here: packed ones may be in flight
            run.batch.wait_forward_events(m, run.state)
            run.batch.wait_backward_events(m, run.state)
        if not upload:
            yield ctx, state
            continue
        x = _prepare_inputs(run, device, layers, m, state, handoff)
        yield ctx, (x, state[1], state[2])


def run_backward(device: DeviceManager, run: RoundPipeRun, layer_group_id: int) -> None:
    """Recompute one backward layer group from its saved input(s) and back-propagate.

    Stage grain recomputes the group from its input with autograd recording, then runs its
    backward; layer grain walks the layers last to first, recomputing each once from the input
    forward saved for it, so only one layer's activations are on the device at a time.
    """
    layers = run.plan.bwd_plan[layer_group_id]
    wait = functools.partial(run.tracker.backward_wait_for, layer_group_id)
    by_layer = run.layer_grain

    def saved(ctx: RoundPipeRunContext) -> State:
        if by_layer:  # a peek: the layer's own step takes it
            return ctx.saved_inputs[layers.start]
        return ctx.saved_inputs.pop(layers.start)

    with _stage_on(device, run, layers, "backward") as stage:
        for ctx, state in _backward_inputs(
            run, device, layers, stage, wait, saved, upload=not by_layer
        ):
            _prefetch_inputs(run, device, "backward", layer_group_id, ctx.microbatch_id)
            if by_layer:
                x = _backward_by_layer(run, device, layers, stage, ctx)
            else:
                recompute = functools.partial(_recompute_layer, run, device, ctx)
                with torch.enable_grad():
                    _, h, _ = _run_chain(layers, stage.layers, state, recompute)
                _backward(h, ctx.grad_states)
                del h
                _grads_handed_over(stage.layers)
                for li in layers:
                    ctx.cut_recompute_data(li)
                x = state[0]
            ctx.grad_states = _to_host(device, _input_grads(x))
            del x
            run.tracker.backward_notify(layer_group_id)


def _backward_by_layer(
    run: RoundPipeRun,
    device: DeviceManager,
    layers: range,
    stage: StageOnDevice,
    ctx: RoundPipeRunContext,
) -> list[Any]:
    """Layer grain backward of one microbatch: for each layer, last first, upload the input
    forward saved for it, recompute the layer once with autograd, back-propagate the gradients
    of its outputs and drop everything but its input gradients. Returns the stage input (whose
    ``.grad`` holds the stage's input gradients)."""
    m = ctx.microbatch_id
    grads = ctx.grad_states
    x: list[Any] = []
    for k in reversed(range(len(layers))):
        li = layers[k]
        host, spec, is_args = ctx.saved_inputs.pop(li)
        if k == 0:
            x = _prepare_inputs(run, device, layers, m, (host, spec, is_args))
        else:
            x = async_h2d(device, host)
            for t in x:
                if _is_float(t):
                    t.requires_grad_(True)
        with torch.enable_grad():
            out = _recompute_layer(run, device, ctx, li, stage.layers[k], x, spec, is_args)
        _backward(pytree.tree_leaves(out), grads)
        del out
        _grads_handed_over(stage.layers[k : k + 1])
        ctx.cut_recompute_data(li)
        grads = _input_grads(x)
    return x


def _fused_layer(
    run: RoundPipeRun,
    device: DeviceManager,
    m: int,
    li: int,
    layer: torch.nn.Module,
    x: list[Any],
    spec: Any,
    is_args: bool,
) -> Any:
    """Forward one layer of the fused stage (autograd records it: no recompute). Timed as the
    layer's ``re`` pass: the forward a backward stage runs, as in the planner's backward time."""
    with (
        annotate(f"fused layer {li} mb {m}"),
        run.rng(device, li, m),
        run.timer.time_fwd("re", li, device.compute_stream),
    ):
        return call_layer(layer, x, spec, is_args)


def run_forward_backward(device: DeviceManager, run: RoundPipeRun) -> None:
    """Fused last stage: forward, loss and backward per microbatch, no recompute."""
    fwd_gid = len(run.plan.fwd_plan) - 1
    layers = run.plan.bwd_plan[0]
    loss_fn = run.loss_fn
    assert loss_fn is not None
    wait = functools.partial(run.tracker.forward_wait_for, fwd_gid)

    def current(ctx: RoundPipeRunContext) -> State:
        return run.states[ctx.microbatch_id]

    with _stage_on(device, run, layers, "fused") as stage:
        for ctx, state in _backward_inputs(run, device, layers, stage, wait, current, handoff=True):
            m = ctx.microbatch_id
            _prefetch_inputs(run, device, "fused", fwd_gid, m)
            x = state[0]
            fused = functools.partial(_fused_layer, run, device, m)
            with torch.enable_grad():
                out, h, hs = _run_chain(layers, stage.layers, state, fused)
                label = run.batch.label_list[m]
                if label is not None:
                    label = pytree.tree_unflatten(
                        async_h2d(device, pytree.tree_leaves(label)),
                        pytree.tree_structure(label),
                    )
                loss = loss_fn(out, label)
            losses = [loss] if isinstance(loss, torch.Tensor) else list(loss)
            if not all(isinstance(v, torch.Tensor) for v in losses):
                raise RoundPipeTypeError("loss_fn must return a tensor or a sequence of tensors")
            torch.autograd.backward([v for v in losses if v.requires_grad])
            run.batch.loss_list[m] = (
                [v.detach().to("cpu") for v in losses]
                if not isinstance(loss, torch.Tensor)
                else loss.detach().to("cpu")
            )
            del out, loss, losses
            _grads_handed_over(stage.layers)
            if run.return_outputs:
                ctx.outputs = (
                    _to_host(device, [t.detach() if isinstance(t, torch.Tensor) else t for t in h]),
                    hs,
                    False,
                )
                run.batch.output_events[m] = _output_events(device, True)
            del h
            ctx.grad_states = _to_host(device, _input_grads(x))
            del x, state
            run.tracker.forward_notify(fwd_gid)
            run.tracker.backward_notify(0)


class RoundPipeBatchedBackward(torch.autograd.Function):
    """Autograd node covering all microbatches: forward runs the forward pipeline,
    backward runs the backward pipeline and returns the input gradients."""

    @staticmethod
    def forward(ctx: Any, run: RoundPipeRun, tag: torch.Tensor, *all_inputs: Any) -> tuple:
        run.launch_forward(fused=False)
        run.join()
        outs: list[torch.Tensor] = []
        ctx.layout = []
        for m, (leaves, _spec, _) in enumerate(run.states):
            for i, t in enumerate(leaves):
                if isinstance(t, torch.Tensor):
                    ctx.layout.append((m, i))
                    outs.append(t)
        ctx.run = run
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*[t for t in outs if not _is_float(t)])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> tuple:
        run: RoundPipeRun | None = ctx.run
        if run is None:
            raise RoundPipeRuntimeError(
                "RoundPipe does not support backward through the same forward twice; "
                "call forward again (retain_graph is not supported)"
            )
        ctx.run = None
        for m, (leaves, _, _) in enumerate(run.states):
            run.contexts[m].grad_states = [None] * len(leaves)
        for (m, i), g in zip(ctx.layout, grad_outputs):
            run.contexts[m].grad_states[i] = g  # type: ignore[index]
        run.launch_backward()
        run.join()
        grads: list[Any] = []
        for m, g in enumerate(run.input_grads()):
            grads.extend(gi for gi, need in zip(g, run.input_grad_mask[m]) if need)
        return (None, None, *grads)
