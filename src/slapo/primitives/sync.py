"""``sync`` and ``hook``: run an op on a module's input, output, input gradient, or parameter
gradients.

``sync`` applies a *tensor op*, either a registered collective such as ``"all_reduce"`` (the sync
ops live in ``slapo.sharding.sync_ops``; :func:`~slapo.sharding.sync_ops.register_sync_op` adds
more) or a user function ``fn(tensor, **kwargs) -> tensor``, at one of four points:

* ``fwd_pre``: on the module's main input before forward;
* ``fwd_post``: on the module's main output after forward;
* ``bwd_post``: on the gradient of the module's main input, once backward through it is done
  (``inputs="all"``: of every floating-point input, e.g. a mixture of experts' hidden states and
  routing weights);
* ``bwd_param``: on the gradient of each of the module's own replicated (unsharded) parameters,
  before it is accumulated. Tensor parallelism needs it for a replicated parameter that consumes
  sharded activations, such as a norm over each attention head between the column-parallel and
  the row-parallel projections: each rank's gradient covers its own heads, and ``"all_reduce"``
  sums them (:func:`~slapo.sharding.sync_ops.on_param_grads`).

The older Slapo spelling ``sync(mode="forward"|"backward"|"both")`` (Megatron-style tensor
parallelism) also works: ``"forward"`` is ``fwd_post`` (all-reduce the output of a row-parallel
part), ``"backward"`` is ``bwd_post`` (all-reduce the input gradient of a column-parallel part),
and ``"both"`` applies the two.

The main input is the first positional tensor, or, for modules called with keywords only (as
transformers 5 calls its layers with ``hidden_states=``), the first of the usual input keywords.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..exceptions import PrimitiveError, SlapoError
from ..schedule import Primitive, Schedule, register_primitive
from ..sharding.rules import apply_after_sync
from ..sharding.sync_ops import (
    SYNC_OPS,
    on_param_grads,
    primary_input,
    replace_primary_output,
    sync_group,
)
from ..sharding.sync_point import SyncPoint, is_symbolic, sync_at
from ..surgery import label
from ..tracing.hooks import traceable_hook

SYNC_MODES = ("fwd_pre", "fwd_post", "bwd_post", "bwd_param")
# The older spelling (seed 003), each with the modes above that it applies, in this order.
SEED_SYNC_MODES = {
    "forward": ("fwd_post",),
    "backward": ("bwd_post",),
    "both": ("fwd_post", "bwd_post"),
}


def _resolve_op(sch: Schedule, sync_op_or_fn: str | Callable, kwargs: dict[str, Any]) -> Callable:
    if callable(sync_op_or_fn):
        return lambda t: sync_op_or_fn(t, **kwargs)
    if isinstance(sync_op_or_fn, str):
        op = SYNC_OPS.get(sync_op_or_fn)
        if op is None:
            known = ", ".join(sorted(SYNC_OPS)) or "(none registered)"
            raise PrimitiveError(
                f'sync on "{label(sch.path)}": unknown op "{sync_op_or_fn}"; known ops: '
                f"{known}; or pass a function tensor -> tensor"
            )
        group = sync_group(sch.group, sch.mod, label(sch.path))
        return lambda t: op(t, group=group, **kwargs)
    raise PrimitiveError(
        f'sync on "{sch.path}": sync_op_or_fn must be an op name or a callable, got {sync_op_or_fn!r}'
    )


@register_primitive()
class SyncPrimitive(Primitive):
    """Run a collective or a function on the module's input, output, input gradient or
    parameter gradients.

    ``mode`` is ``"fwd_pre"``, ``"fwd_post"``, ``"bwd_post"`` or ``"bwd_param"`` (the gradients of
    the module's own replicated parameters); ``sync_op_or_fn`` a registered op
    name (``slapo.sharding.sync_ops.SYNC_OPS``) or ``fn(tensor, **kwargs) -> tensor``. The older
    modes ``"forward"`` (= ``fwd_post``), ``"backward"`` (= ``bwd_post``) and ``"both"`` (the two)
    are accepted too; with the default op they are Megatron's output and input-gradient
    all-reduces.

    Example:
        >>> import slapo
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4)))
        >>> sch["0"].sync(mode="fwd_post", sync_op_or_fn=lambda t: t * 2)
        >>> sch["0"].sync(mode="both", sync_op_or_fn=lambda t: t)
        >>> sch["0"].sync(mode="bwd_param", sync_op_or_fn=lambda g: g * 0.5)  # or "all_reduce"
    """

    name = "sync"

    @staticmethod
    def apply(
        sch: Schedule,
        mode: str = "fwd_post",
        sync_op_or_fn: str | Callable = "all_reduce",
        *,
        inputs: str = "main",
        **kwargs: Any,
    ) -> None:
        if inputs not in ("main", "all"):
            raise PrimitiveError(
                f'sync on "{label(sch.path)}": inputs must be "main" or "all", got {inputs!r}'
            )
        modes = SEED_SYNC_MODES.get(mode, (mode,)) if isinstance(mode, str) else (mode,)
        if any(m not in SYNC_MODES for m in modes):
            raise PrimitiveError(
                f'sync on "{label(sch.path)}": unknown mode "{mode}"; use one of '
                + ", ".join(f'"{m}"' for m in SYNC_MODES + tuple(SEED_SYNC_MODES))
            )
        op = _resolve_op(sch, sync_op_or_fn, kwargs)
        if inputs == "all" and modes != ("bwd_post",):
            raise PrimitiveError(
                f'sync on "{label(sch.path)}": inputs="all" goes with mode="bwd_post" only'
            )
        for one in modes:
            _register(sch, one, op, every_input=inputs == "all")


def _register(sch: Schedule, mode: str, op: Callable, every_input: bool = False) -> None:
    """Hook ``op`` into ``sch.mod`` at the point ``mode`` (one of ``SYNC_MODES``).

    The hooks also run when a trace goes through the module (flattened, or a decomposed layer
    inlined into its caller): they then record the op as a call in the traced graph
    (:mod:`slapo.sharding.sync_point`), so the synchronisation survives tracing.
    """
    path = label(sch.path)
    if mode == "bwd_param":
        if not on_param_grads(sch.mod, op):
            raise PrimitiveError(
                f'sync(mode="bwd_param") on "{path}" ({type(sch.mod).__name__}): the module has '
                "no replicated parameter of its own; name the module that holds the parameter"
            )
        return
    point = SyncPoint(mode, op, sch.path)

    if mode == "fwd_post":
        # A row-parallel layer adds its bias only once the partial sums are reduced.
        sch.mod.register_forward_hook(
            traceable_hook(
                lambda mod, args, out: replace_primary_output(
                    out, lambda t: apply_after_sync(mod, sync_at(t, point))
                )
            )
        )
        return

    def pre_hook(mod: nn.Module, args: tuple, kw: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if every_input:  # e.g. experts: the routing weights' gradient is partial as well
            return _map_float_tensors(args, point), _map_float_tensors(kw, point)
        tensor, put = primary_input(args, kw)
        if tensor is None:
            raise SlapoError(f'sync(mode="{mode}") on "{path}": the module got no tensor input')
        return put(sync_at(tensor, point))

    sch.mod.register_forward_pre_hook(traceable_hook(pre_hook), with_kwargs=True)


def _map_float_tensors(values: Any, point: SyncPoint) -> Any:
    """``values`` (a tuple or dict) with ``point`` applied to each floating-point tensor."""

    def one(value: Any) -> Any:
        floating = isinstance(value, torch.Tensor) and value.is_floating_point()
        return sync_at(value, point) if floating or is_symbolic(value) else value

    if isinstance(values, dict):
        return {key: one(value) for key, value in values.items()}
    return tuple(one(value) for value in values)


_HOOK_MODES = {"fw_pre": "fwd_pre", "fw_post": "fwd_post", "bw_post": "bwd_post"}


@register_primitive()
class HookPrimitive(Primitive):
    """Register a PyTorch hook (the older Slapo spelling): ``hook(mode, func)``.

    ``mode`` is ``"fwd_pre"`` (``func(module, args)``), ``"fwd_post"``
    (``func(module, args, output)``) or ``"bwd_post"`` (a full backward hook,
    ``func(module, grad_input, grad_output)``); ``fw_pre``/``fw_post``/``bw_post`` also work.

    Example:
        >>> import slapo
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4)))
        >>> sch["0"].hook("fwd_post", lambda mod, args, out: out * 2)
    """

    name = "hook"

    @staticmethod
    def apply(sch: Schedule, mode: str, func: Callable) -> None:
        mode = _HOOK_MODES.get(mode, mode)
        if not callable(func):
            raise PrimitiveError(f'hook on "{sch.path}": func must be callable, got {func!r}')
        if mode == "fwd_pre":
            sch.mod.register_forward_pre_hook(func)
        elif mode == "fwd_post":
            sch.mod.register_forward_hook(func)
        elif mode == "bwd_post":
            sch.mod.register_full_backward_hook(func)
        else:
            modes = tuple(_HOOK_MODES.values())  # bwd_param is sync's own
            raise PrimitiveError(
                f'hook on "{label(sch.path)}": unknown mode "{mode}"; use one of {modes}'
            )
