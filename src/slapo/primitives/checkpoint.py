"""``checkpoint``: recompute the module's activations in backward instead of keeping them."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..exceptions import PrimitiveError
from ..logger import get_logger
from ..random import checkpoint as rng_checkpoint
from ..schedule import Primitive, Schedule, register_primitive
from ..surgery import wrap_forward
from .subgraph_checkpoint import checkpoint_subgraph

# The arguments through which transformers layers read and write their key/value cache (the names
# differ between models and versions), and the value each takes with the cache off.
_CACHE_ARGS = {
    "use_cache": False,
    "past_key_values": None,
    "past_key_value": None,
    "layer_past": None,
}
_warned = False


@functools.cache
def _positions(func: Callable[..., Any]) -> dict[str, int]:
    """Where each cache argument sits among the positional arguments of ``func`` (a method)."""
    try:
        params = list(inspect.signature(func).parameters.values())[1:]  # after self
    except (TypeError, ValueError):
        return {}
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {
        p.name: i for i, p in enumerate(params) if p.kind in positional and p.name in _CACHE_ARGS
    }


def _without_cache(
    path: str, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with the key/value cache turned off; warns once per process."""
    func = getattr(forward, "__func__", None)
    positions = _positions(func) if func is not None else {}
    args, kwargs, changed = list(args), dict(kwargs), []
    for name, off in _CACHE_ARGS.items():
        if name in kwargs:
            value, put = kwargs[name], kwargs.__setitem__
            where: Any = name
        elif positions.get(name, len(args)) < len(args):
            where = positions[name]
            value, put = args[where], args.__setitem__
        else:
            continue
        # A cache object may define __len__ (an empty one is falsy): test it against None.
        if bool(value) if name == "use_cache" else value is not None:
            put(where, off)
            changed.append(f"{name}={off}")
    global _warned
    if changed and not _warned:
        _warned = True
        get_logger().warning(
            'checkpoint: "%s" got a key/value cache; while gradients are recorded, checkpointed '
            "modules run with %s (the recompute in backward would write the cache a second "
            "time), as under transformers' gradient checkpointing. Under torch.no_grad() (eval, "
            "generate) the cache is kept. Pass use_cache=False (or set config.use_cache = False) "
            "to train without this note; it is shown once.",
            path,
            ", ".join(changed),
        )
    return tuple(args), kwargs


def _checkpointed(path: str) -> Callable[..., Any]:
    def run(forward: Any, *args: Any, **kwargs: Any) -> Any:
        # Checkpointing buys nothing when no graph is recorded (eval, no_grad); torch would warn.
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        args, kwargs = _without_cache(path, forward, args, kwargs)
        return rng_checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


@register_primitive()
class CheckpointPrimitive(Primitive):
    """Activation checkpointing of the module: its inner activations are recomputed in backward.

    Non-reentrant, restores the RNG states (torch's and the ``fork_rng`` tracker's), so dropout
    masks match on recompute. Parameter names do not change. After ``trace``, pass a subgraph to
    checkpoint only that part of the graph.

    While gradients are recorded, a checkpointed transformers layer runs without its key/value
    cache (``use_cache=False``, ``past_key_values=None``; one warning), as under transformers'
    ``gradient_checkpointing_enable()``: the recompute would append to the cache a second time.
    Under ``torch.no_grad()`` (eval, ``generate``) nothing is checkpointed and the cache works.

    Example:
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
        >>> sch["0"].checkpoint()
    """

    name = "checkpoint"

    @staticmethod
    def apply(sch: Schedule, subgraph: Any = None, **kwargs: Any) -> None:
        if subgraph is not None:
            return checkpoint_subgraph(sch, subgraph, **kwargs)
        if kwargs:
            raise PrimitiveError(
                f'checkpoint() got unexpected arguments {sorted(kwargs)} on "{sch.path}"'
            )
        sch.require_unapplied("checkpoint")
        wrap_forward(sch.mod, "checkpoint", _checkpointed(sch.path or type(sch.mod).__name__))
        return None
