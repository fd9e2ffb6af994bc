"""The ``sync`` ops: tensor ops that ``sch.sync(...)`` runs on a module's main input or output, or
on the gradient of its main input.

Sharding owns them: importing this module registers the autograd collectives (``all_reduce``,
``all_gather``, ``reduce_scatter``, ``scatter``) and every two-letter reshard spec
(``"RS->SR"``, ...); :func:`register_sync_op` adds more. The ``sync`` primitive
(``slapo.primitives.sync``) looks them up here, together with the helpers that find a module's
main input and output and apply an op to a gradient.

Example:
    >>> from slapo.sharding.sync_ops import SYNC_OPS
    >>> "all_reduce" in SYNC_OPS, "RS->SR" in SYNC_OPS
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..exceptions import PrimitiveError, SlapoError
from .collectives import all_gather, all_reduce, reduce_scatter, scatter
from .groups import resolve_group, same_group
from .reshard import SPECS, reshard
from .spec import get_shard_spec

__all__ = [
    "SYNC_OPS",
    "SyncOp",
    "on_grad",
    "primary_input",
    "register_sync_op",
    "replace_primary_output",
    "sync_group",
]

SyncOp = Callable[..., torch.Tensor]  # op(tensor, group=..., **kwargs) -> tensor
SYNC_OPS: dict[str, SyncOp] = {}
# The keywords that carry a module's main input when it is called with keywords only (as
# transformers 5 calls its layers with ``hidden_states=``), most likely first.
_INPUT_KEYWORDS = ("hidden_states", "input", "x", "inputs_embeds", "input_ids")


def register_sync_op(name: str, op: SyncOp, override: bool = False) -> None:
    """Register ``op(tensor, group=..., **kwargs) -> tensor`` as ``sync(sync_op_or_fn=name)``.

    Example:
        >>> register_sync_op("double", lambda t, group=None: t * 2, override=True)
    """
    if name in SYNC_OPS and not override:
        raise SlapoError(f"sync op '{name}' is already registered")
    SYNC_OPS[name] = op


def primary_input(
    args: tuple, kwargs: dict[str, Any]
) -> tuple[torch.Tensor | None, Callable[[torch.Tensor], tuple[tuple, dict[str, Any]]]]:
    """The module's main input tensor and a function that puts a new one in its place.

    The main input is the first positional tensor, or else the first of the usual input keywords.

    Example:
        >>> x, put = primary_input((), {"hidden_states": torch.ones(2), "mask": None})
        >>> put(x * 2)[1]["hidden_states"]
        tensor([2., 2.])
    """
    if args and isinstance(args[0], torch.Tensor):
        return args[0], lambda t: ((t, *args[1:]), kwargs)
    keys = [k for k in _INPUT_KEYWORDS if isinstance(kwargs.get(k), torch.Tensor)]
    keys = keys or [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    if not keys:
        return None, lambda t: (args, kwargs)
    key = keys[0]
    return kwargs[key], lambda t: (args, {**kwargs, key: t})


def replace_primary_output(output: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to the main tensor of a module output (a tensor, tuple, list or dict).

    Example:
        >>> replace_primary_output((torch.ones(2), "aux"), lambda t: t * 3)
        (tensor([3., 3.]), 'aux')
    """
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


def on_grad(tensor: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``tensor`` unchanged, except that its gradient passes through ``fn`` in backward.

    (``_GradOp`` is looked up when called: the pipeline target swaps it while tracing.)

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> on_grad(x, lambda g: g * 5).sum().backward()
        >>> x.grad
        tensor([5., 5.])
    """
    return _GradOp.apply(tensor, fn)


def sync_group(group: Any, mod: nn.Module, where: str) -> Any:
    """The group that ``group`` names, checked against the group ``mod``'s sharded parameters use.

    Example:
        >>> sync_group(None, nn.Linear(2, 2), "fc") is None
        True
    """
    resolved = resolve_group(group, where)
    for name, param in mod.named_parameters():
        spec = get_shard_spec(param)
        if spec is not None and not same_group(spec.group, resolved):
            raise PrimitiveError(
                f'sync on "{where}": the group does not match the one "{name}" was sharded over '
                f"(size {spec.world}); schedule both with the same group"
            )
    return resolved


def _register_builtins() -> None:
    for op in (all_reduce, all_gather, reduce_scatter, scatter):
        register_sync_op(op.__name__, op, override=True)
    for spec in SPECS:

        def op(tensor: torch.Tensor, group: Any = None, _spec: str = spec) -> torch.Tensor:
            return reshard(tensor, _spec, group=group)

        register_sync_op(spec, op, override=True)


_register_builtins()
