"""``sync`` and ``hook``: run an op on a module's input, output, or input gradient.

``sync`` applies a *tensor op*, either a registered collective such as ``"all_reduce"`` (see
:func:`register_sync_op`; the tensor-parallel package registers them) or a user function
``fn(tensor, **kwargs) -> tensor``, at one of three points:

* ``fwd_pre``: on the module's main input before forward;
* ``fwd_post``: on the module's main output after forward;
* ``bwd_post``: on the gradient of the module's main input, once backward through it is done.

The main input is the first positional tensor, or, for modules called with keywords only (as
transformers 5 calls its layers with ``hidden_states=``), the first of the usual input keywords.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..exceptions import PrimitiveError, SlapoError
from .base import Primitive, register_primitive

if TYPE_CHECKING:
    from ..schedule import Schedule

__all__ = ["register_sync_op", "SYNC_OPS", "primary_input", "replace_primary_output"]

SyncOp = Callable[..., torch.Tensor]
SYNC_OPS: dict[str, SyncOp] = {}
SYNC_MODES = ("fwd_pre", "fwd_post", "bwd_post")
_INPUT_KEYWORDS = ("hidden_states", "input", "x", "inputs_embeds", "input_ids")


def register_sync_op(name: str, op: SyncOp, override: bool = False) -> None:
    """Register ``op(tensor, group=..., **kwargs) -> tensor`` as ``sync(sync_op_or_fn=name)``."""
    if name in SYNC_OPS and not override:
        raise SlapoError(f"sync op '{name}' is already registered")
    SYNC_OPS[name] = op


def primary_input(
    args: tuple, kwargs: dict[str, Any]
) -> tuple[torch.Tensor | None, Callable[[torch.Tensor], tuple[tuple, dict[str, Any]]]]:
    """The module's main input tensor and a function that puts a new one in its place."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], lambda t: ((t, *args[1:]), kwargs)
    keys = [k for k in _INPUT_KEYWORDS if isinstance(kwargs.get(k), torch.Tensor)]
    keys = keys or [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    if not keys:
        return None, lambda t: (args, kwargs)
    key = keys[0]
    return kwargs[key], lambda t: (args, {**kwargs, key: t})


def replace_primary_output(output: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to the main tensor of a module output (a tensor, tuple, list or dict)."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    if type(output) in (tuple, list) and output and isinstance(output[0], torch.Tensor):
        return type(output)([fn(output[0]), *output[1:]])
    if isinstance(output, dict) and output:
        key = next(iter(output))
        if isinstance(output[key], torch.Tensor):
            output[key] = fn(output[key])
            return output
    raise SlapoError(
        f"sync(mode='fwd_post') found no tensor in the module output of type {type(output).__name__}"
    )


class _GradOp(torch.autograd.Function):
    """Identity in forward; applies ``fn`` to the gradient in backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.fn(grad), None


def _sync_group(sch: Schedule) -> Any:
    """The schedule's group, checked against the group its sharded parameters use."""
    from ..sharding.groups import resolve_group, same_group
    from ..sharding.spec import get_shard_spec

    path = sch.path or "<root>"
    group = resolve_group(sch.group, path)
    for name, param in sch.mod.named_parameters():
        spec = get_shard_spec(param)
        if spec is not None and not same_group(spec.group, group):
            raise PrimitiveError(
                f'sync on "{path}": the group does not match the one "{name}" was sharded over '
                f"(size {spec.world}); schedule both with the same group"
            )
    return group


def _resolve_op(sch: Schedule, sync_op_or_fn: str | Callable, kwargs: dict[str, Any]) -> Callable:
    if callable(sync_op_or_fn):
        return lambda t: sync_op_or_fn(t, **kwargs)
    if isinstance(sync_op_or_fn, str):
        op = SYNC_OPS.get(sync_op_or_fn)
        if op is None:
            known = ", ".join(sorted(SYNC_OPS)) or "(none registered)"
            raise PrimitiveError(
                f'sync on "{sch.path or "<root>"}": unknown op "{sync_op_or_fn}"; known ops: '
                f"{known}; or pass a function tensor -> tensor"
            )
        group = _sync_group(sch)
        return lambda t: op(t, group=group, **kwargs)
    raise PrimitiveError(
        f'sync on "{sch.path}": sync_op_or_fn must be an op name or a callable, got {sync_op_or_fn!r}'
    )


@register_primitive()
class SyncPrimitive(Primitive):
    """Run a collective or a function on the module's input, output or input gradient.

    ``mode`` is ``"fwd_pre"``, ``"fwd_post"`` or ``"bwd_post"``; ``sync_op_or_fn`` a registered op
    name (``slapo.primitives.sync.SYNC_OPS``) or ``fn(tensor, **kwargs) -> tensor``.

    Example:
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4)))
        >>> sch["0"].sync(mode="fwd_post", sync_op_or_fn=lambda t: t * 2)
    """

    name = "sync"

    @staticmethod
    def apply(
        sch: Schedule,
        mode: str = "fwd_post",
        sync_op_or_fn: str | Callable = "all_reduce",
        **kwargs: Any,
    ) -> None:
        if mode not in SYNC_MODES:
            raise PrimitiveError(
                f'sync on "{sch.path or "<root>"}": unknown mode "{mode}"; use one of {SYNC_MODES}'
            )
        op = _resolve_op(sch, sync_op_or_fn, kwargs)
        path = sch.path or "<root>"

        if mode == "fwd_post":
            from ..sharding.rules import apply_after_sync

            # A row-parallel layer adds its bias only once the partial sums are reduced.
            sch.mod.register_forward_hook(
                lambda mod, args, out: replace_primary_output(
                    out, lambda t: apply_after_sync(mod, op(t))
                )
            )
            return

        def pre_hook(
            mod: nn.Module, args: tuple, kw: dict[str, Any]
        ) -> tuple[tuple, dict[str, Any]]:
            tensor, put = primary_input(args, kw)
            if tensor is None:
                raise SlapoError(f'sync(mode="{mode}") on "{path}": the module got no tensor input')
            if mode == "fwd_pre":
                return put(op(tensor))
            if not tensor.requires_grad:  # no gradient will flow back through this input
                return args, kw
            return put(_GradOp.apply(tensor, op))

        sch.mod.register_forward_pre_hook(pre_hook, with_kwargs=True)


_HOOK_MODES = {"fw_pre": "fwd_pre", "fw_post": "fwd_post", "bw_post": "bwd_post"}


@register_primitive()
class HookPrimitive(Primitive):
    """Register a PyTorch hook (the older Slapo spelling): ``hook(mode, func)``.

    ``mode`` is ``"fwd_pre"`` (``func(module, args)``), ``"fwd_post"``
    (``func(module, args, output)``) or ``"bwd_post"`` (a full backward hook,
    ``func(module, grad_input, grad_output)``); ``fw_pre``/``fw_post``/``bw_post`` also work.

    Example:
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
            raise PrimitiveError(
                f'hook on "{sch.path or "<root>"}": unknown mode "{mode}"; use one of {SYNC_MODES}'
            )
