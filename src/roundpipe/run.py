"""Core runtime: stage jobs executed on device workers, and the autograd bridge.

One call of a RoundPipe model becomes a :class:`RoundPipeRun`. Its forward stages, the
fused last stage and the backward stages are queued on devices round-robin, in a global
order in which every job only depends on earlier jobs, so the pipeline cannot deadlock.
Activations and gradients travel between stages through host memory.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from .batch import Batch
from .context import ForwardCtx, RecomputeCtx
from .device import DeviceManager, get_devices, get_next_device
from .profile import annotate
from .run_config import FullRoundPipeRunConfig
from .scheduler import ModelExecutePlan, ModelTracker
from .threads import RunState
from .transfer import async_d2h, async_h2d, download_layer, upload_layers
from .utils import derive_seed

if TYPE_CHECKING:
    from .roundpipe import RoundPipe

__all__ = [
    "RoundPipeBatchedBackward",
    "RoundPipeRun",
    "RoundPipeRunContext",
    "run_backward",
    "run_forward",
    "run_forward_backward",
]

_cpu_rng_lock = threading.RLock()

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
                raise ValueError("save_for_recompute: saved tensors must not require grad")
        with self._lock:
            if layer_id in self.recompute_data:
                raise RuntimeError(f"save_for_recompute called twice by layer {layer_id}")
            leaves, spec = pytree.tree_flatten(data)
            self.recompute_data[layer_id] = pytree.tree_unflatten(async_d2h(device, [], leaves), spec)

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
        return pytree.tree_unflatten(async_h2d(device, [], leaves), spec)


class RoundPipeRun:
    """Everything one call of a RoundPipe model needs: batch, plan, progress, errors."""

    def __init__(self, model: RoundPipe, config: FullRoundPipeRunConfig, batch: Batch,
                 plan: ModelExecutePlan, enable_grad: bool, kind: str) -> None:
        self.model = model
        self.config = config
        self.batch = batch
        self.plan = plan
        self.enable_grad = enable_grad
        self.state = RunState(f"{model.name} {kind}")
        self.tracker = ModelTracker(plan, self.state)
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
            (list(leaves), spec, True) for leaves, spec in zip(batch.flatten_states, batch.flatten_specs)
        ]
        self.loss_fn: Callable | None = None
        self.return_outputs = False

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
            saved = gen.get_state()
            gen.manual_seed(seed)
            try:
                yield
            finally:
                gen.set_state(saved)
            return
        # CPU virtual devices share the global CPU generator: serialize seeded sections
        with _cpu_rng_lock:
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            try:
                yield
            finally:
                torch.set_rng_state(saved)

    def layer_attrs(self, layers: range) -> list[Any]:
        return [self.model.layer_attrs[i] for i in layers]

    def host_layers(self, layers: range) -> list[torch.nn.Module]:
        return [self.model.layers[i] for i in layers]

    # -- launching -------------------------------------------------------------------------
    def launch_forward(self, fused: bool) -> None:
        """Queue forward stages (and, when ``fused``, the fused stage and backward stages)."""
        n_fwd = len(self.plan.fwd_plan) - (1 if fused else 0)
        for gid in range(n_fwd):
            get_next_device().launch_forward(gid, self)
        if fused:
            get_next_device().launch_forward_backward(self)
            for gid in range(1, len(self.plan.bwd_plan)):
                get_next_device().launch_backward(gid, self)

    def launch_backward(self) -> None:
        """Queue all backward stages (non-fused training)."""
        for gid in range(len(self.plan.bwd_plan)):
            get_next_device().launch_backward(gid, self)

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


def _upload(device: DeviceManager, run: RoundPipeRun, layers: range, with_grad: bool, what: str) -> Any:
    return upload_layers(run.host_layers(layers), run.layer_attrs(layers), device, with_grad,
                         f"{run.model.name} {what} layers {layers.start}-{layers.stop - 1}")


def _save_fn(run: RoundPipeRun, ctx: RoundPipeRunContext, layer_id: int, device: DeviceManager) -> Callable[..., None]:
    return lambda *data: ctx.save_for_recompute(layer_id, device, *data)


def run_forward(device: DeviceManager, run: RoundPipeRun, layer_group_id: int) -> None:
    """Forward one layer group over all microbatches (no autograd graph is kept)."""
    layers = run.plan.fwd_plan[layer_group_id]
    for attr in run.layer_attrs(layers):
        attr.forward_fence(run.state)
    stage = _upload(device, run, layers, False, "forward")
    try:
        for m in range(run.num_microbatch):
            run.tracker.forward_wait_for(layer_group_id, m)
            ctx = run.contexts[m]
            leaves, spec, is_args = run.states[m]
            x = async_h2d(device, [], leaves)
            for li, layer in zip(layers, stage.layers):
                if run.enable_grad and run.tracker.backward_need_input(li):
                    host = leaves if li == layers.start else async_d2h(device, [], x)
                    ctx.save_input(li, (host, spec, is_args))
                fwd_ctx = ForwardCtx(_save_fn(run, ctx, li, device)) if run.enable_grad else None
                with torch.no_grad(), annotate(f"fwd layer {li} mb {m}"), run.rng(device, li, m), \
                        run.timer.time_fwd("fwd", li, device.compute_stream), \
                        (fwd_ctx or contextlib.nullcontext()):
                    out = call_layer(layer, x, spec, is_args)
                x, spec = pytree.tree_flatten(out)
                is_args = False
            run.states[m] = (async_d2h(device, [], x), spec, False)
            run.tracker.forward_notify(layer_group_id)
        download_layer(stage, device, with_buffer=True, with_grad=False)
    finally:
        stage.free()


def _prepare_inputs(run: RoundPipeRun, device: DeviceManager, layers: range, m: int, state: State) -> list[Any]:
    """Upload a stage input and mark the leaves whose gradients backward must produce."""
    leaves, _, _ = state
    x = async_h2d(device, [], leaves)
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
        raise RuntimeError(f"backward got {len(grads)} gradients for {len(outputs)} stage outputs; "
                           "a layer's output structure changed between forward and recompute")
    ts, gs = [], []
    for o, g in zip(outputs, grads):
        if isinstance(o, torch.Tensor) and o.requires_grad and g is not None:
            ts.append(o)
            gs.append(g.to(o.device) if g.device != o.device else g)
    if ts:
        torch.autograd.backward(ts, gs)


def _input_grads(x: list[Any]) -> list[Any]:
    return [t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in x]


def _recompute_layer(run: RoundPipeRun, device: DeviceManager, ctx: RoundPipeRunContext, li: int,
                     layer: torch.nn.Module, x: list[Any], spec: Any, is_args: bool) -> Any:
    data = ctx.fetch_recompute_data(li, device)
    with annotate(f"recompute layer {li} mb {ctx.microbatch_id}"), run.rng(device, li, ctx.microbatch_id), \
            RecomputeCtx(data):
        return call_layer(layer, x, spec, is_args)


def _release_copy_back(attrs: list[Any]) -> None:
    """Signal that this run's backward holds its copy of the layers.

    Called once microbatch 0 arrived: by then every forward stage of this run uploaded
    these layers too (the backward job may have uploaded early, before the forward stage
    of the same layers on another device), so a pending optimizer copy-back can no longer
    make forward and backward see different values.
    """
    for attr in attrs:
        attr.backward_uploaded()


def run_backward(device: DeviceManager, run: RoundPipeRun, layer_group_id: int) -> None:
    """Recompute one backward layer group from its saved input and back-propagate."""
    layers = run.plan.bwd_plan[layer_group_id]
    attrs = run.layer_attrs(layers)
    for attr in attrs:
        attr.backward_fence(run.state)
    stage = _upload(device, run, layers, True, "backward")
    try:
        with run.timer.time_bwd(layers, device.compute_stream):
            for m in range(run.num_microbatch):
                run.tracker.backward_wait_for(layer_group_id, m)
                if m == 0:
                    _release_copy_back(attrs)
                ctx = run.contexts[m]
                state = ctx.saved_inputs.pop(layers.start)
                grads_out = ctx.grad_states
                x = _prepare_inputs(run, device, layers, m, state)
                _, spec, is_args = state
                if run.config.recompute_grain == "stage":
                    h, hs, ha = x, spec, is_args
                    with torch.enable_grad():
                        for li, layer in zip(layers, stage.layers):
                            out = _recompute_layer(run, device, ctx, li, layer, h, hs, ha)
                            h, hs = pytree.tree_flatten(out)
                            ha = False
                    _backward(h, grads_out)
                else:
                    boundary: list[State] = []
                    h, hs, ha = x, spec, is_args
                    with torch.no_grad():
                        for li, layer in zip(layers, stage.layers):
                            boundary.append((h, hs, ha))
                            out = _recompute_layer(run, device, ctx, li, layer, h, hs, ha)
                            h, hs = pytree.tree_flatten(out)
                            ha = False
                    g = grads_out
                    for k in reversed(range(len(layers))):
                        bh, bs, ba = boundary[k]
                        if k > 0:
                            bh = [t.detach().requires_grad_(True) if _is_float(t) else t for t in bh]
                        with torch.enable_grad():
                            out = _recompute_layer(run, device, ctx, layers[k], stage.layers[k], bh, bs, ba)
                        _backward(pytree.tree_leaves(out), g)
                        g = _input_grads(bh)
                    x = boundary[0][0]
                ctx.grad_states = async_d2h(device, [], _input_grads(x))
                run.tracker.backward_notify(layer_group_id)
        download_layer(stage, device, with_buffer=False, with_grad=True)
    finally:
        stage.free()


def run_forward_backward(device: DeviceManager, run: RoundPipeRun) -> None:
    """Fused last stage: forward, loss and backward per microbatch, no recompute."""
    fwd_gid = len(run.plan.fwd_plan) - 1
    layers = run.plan.bwd_plan[0]
    attrs = run.layer_attrs(layers)
    for attr in attrs:
        attr.forward_backward_fence(run.state)
    stage = _upload(device, run, layers, True, "fused")
    loss_fn = run.loss_fn
    assert loss_fn is not None
    try:
        with run.timer.time_bwd(layers, device.compute_stream):
            for m in range(run.num_microbatch):
                run.tracker.forward_wait_for(fwd_gid, m)
                if m == 0:
                    _release_copy_back(attrs)
                ctx = run.contexts[m]
                state = run.states[m]
                x = _prepare_inputs(run, device, layers, m, state)
                _, spec, is_args = state
                h, hs, ha = x, spec, is_args
                with torch.enable_grad():
                    for li, layer in zip(layers, stage.layers):
                        with annotate(f"fused layer {li} mb {m}"), run.rng(device, li, m):
                            out = call_layer(layer, h, hs, ha)
                        h, hs = pytree.tree_flatten(out)
                        ha = False
                    label = run.batch.label_list[m]
                    if label is not None:
                        label = pytree.tree_unflatten(async_h2d(device, [], pytree.tree_leaves(label)),
                                                      pytree.tree_structure(label))
                    loss = loss_fn(out, label)
                losses = [loss] if isinstance(loss, torch.Tensor) else list(loss)
                if not all(isinstance(v, torch.Tensor) for v in losses):
                    raise TypeError("loss_fn must return a tensor or a sequence of tensors")
                torch.autograd.backward([v for v in losses if v.requires_grad])
                run.batch.loss_list[m] = [v.detach().to("cpu") for v in losses] \
                    if not isinstance(loss, torch.Tensor) else loss.detach().to("cpu")
                if run.return_outputs:
                    ctx.outputs = (async_d2h(device, [], [t.detach() if isinstance(t, torch.Tensor) else t for t in h]),
                                   hs, False)
                ctx.grad_states = async_d2h(device, [], _input_grads(x))
                run.tracker.forward_notify(fwd_gid)
                run.tracker.backward_notify(0)
        download_layer(stage, device, with_buffer=True, with_grad=True)
    finally:
        stage.free()


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
            raise RuntimeError("RoundPipe does not support backward through the same forward twice; "
                               "call forward again (retain_graph is not supported)")
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
