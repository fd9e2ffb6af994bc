"""``checkpoint``: recompute the module's activations in backward instead of keeping them."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..exceptions import PrimitiveError, SlapoError
from ..logger import get_logger
from ..random import CHECKPOINT_POLICIES, checkpoint_policy
from ..random import checkpoint as rng_checkpoint
from ..schedule import Primitive, Schedule, register_primitive
from ..surgery import forward_wraps, wrap_forward
from .fuse import _is_subgraph
from .subgraph_checkpoint import checkpoint_subgraph

# The arguments through which transformers layers read and write their key/value cache, and the
# value each takes with the cache off. The names moved between releases (5.0-5.23:
# ``past_key_value(s)``, 5.24: ``cache``; GPT-2 style ``layer_past`` throughout); transformers' own
# gradient checkpointing (``GradientCheckpointingLayer``) switches off every one of them, and so
# do we, so that no supported release depends on another's spelling.
_CACHE_ARGS = {
    "use_cache": False,
    "cache": None,
    "past_key_values": None,
    "past_key_value": None,
    "layer_past": None,
}
# ``cache`` is a common word: outside transformers it is switched off only when it holds a
# transformers cache object (a ``transformers.cache_utils.Cache``).
_GENERIC_NAMES = frozenset({"cache"})
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


def _is_transformers_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers key/value cache (``transformers.cache_utils.Cache``)."""
    # By the class's home rather than isinstance: slapo does not import transformers.
    return any(
        c.__name__ == "Cache" and c.__module__ == "transformers.cache_utils"
        for c in type(value).__mro__
    )


def _switched_off(name: str, value: Any, hf_layer: bool) -> bool:
    """Whether the call's argument ``name`` holds a cache (or ``use_cache=True``) to switch off."""
    if name == "use_cache":
        return bool(value)
    if name in _GENERIC_NAMES and not hf_layer:
        return _is_transformers_cache(value)
    # A cache object may define __len__ (an empty one is falsy): test it against None.
    return value is not None


def _without_cache(
    path: str,
    positions: dict[str, int],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    hf_layer: bool = False,
    keep_cache: bool = False,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with the key/value cache turned off; warns once per process.

    ``positions``: where the cache arguments sit among the positional ones (:func:`_positions`).
    ``hf_layer``: the module is a transformers class. ``keep_cache``: the layer only reads the
    cache (transformers' ``_can_checkpoint_with_cache``), so only ``use_cache`` is switched off.
    """
    args, kwargs, changed = list(args), dict(kwargs), []
    for name, off in _CACHE_ARGS.items():
        if keep_cache and name != "use_cache":
            continue
        if name in kwargs:
            value, put = kwargs[name], kwargs.__setitem__
            where: Any = name
        elif positions.get(name, len(args)) < len(args):
            where = positions[name]
            value, put = args[where], args.__setitem__
        else:
            continue
        if _switched_off(name, value, hf_layer):
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


_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


def _stat_norms(mod: nn.Module) -> list[nn.Module]:
    """The norms inside ``mod`` that update running statistics in training (BatchNorm)."""
    return [
        m
        for m in mod.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats
    ]


@contextlib.contextmanager
def _swapped_stats(swaps: list[tuple[nn.Module, dict[str, torch.Tensor]]]) -> Iterator[None]:
    """Give each norm the buffers of ``swaps`` for the duration; its own come back after."""
    kept = [(norm, {n: norm._buffers[n] for n in bufs}) for norm, bufs in swaps]
    for norm, bufs in swaps:
        norm._buffers.update(bufs)
    try:
        yield
    finally:
        for norm, bufs in kept:
            norm._buffers.update(bufs)


def _stats_once(forward: Callable[..., Any], norms: list[nn.Module]) -> Callable[..., Any]:
    """``forward`` for one checkpointed call: its first run (the forward) updates the norms'
    running statistics, any later one (a recompute in backward) updates copies of them.

    Copies rather than no statistics: the recompute must save the same tensors as the forward
    (torch checks). They are made here, outside the checkpoint, whose selective mode would
    count them among the recomputed ops.
    """
    scratch = [
        (norm, {n: t.clone() for n in _RUNNING_STATS if (t := norm._buffers.get(n)) is not None})
        for norm in norms
    ]
    calls = 0

    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return forward(*args, **kwargs)
        with _swapped_stats(scratch):
            return forward(*args, **kwargs)

    return run


def _checkpointed(
    path: str, mod: nn.Module, policy: Callable[..., Any] | None
) -> Callable[..., Any]:
    # Read the signature of the forward now, not at each call: under torch.compile the bound
    # method's introspection would break the graph.
    cls = type(mod)
    positions = _positions(cls.forward)
    hf_layer = cls.__module__.startswith("transformers.")
    keep_cache = bool(getattr(cls, "_can_checkpoint_with_cache", False))

    def run(forward: Any, *args: Any, **kwargs: Any) -> Any:
        # Checkpointing buys nothing when no graph is recorded (eval, no_grad); torch would warn.
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        args, kwargs = _without_cache(path, positions, args, kwargs, hf_layer, keep_cache)
        # Compiled, the graph updates the buffers once, however it recomputes.
        norms = [] if torch.compiler.is_compiling() else _stat_norms(mod)
        if norms:
            forward = _stats_once(forward, norms)
        return rng_checkpoint(forward, *args, use_reentrant=False, policy=policy, **kwargs)

    return run


def resolve_policy(where: str, policy: Any) -> Callable[..., Any] | None:
    """The policy function of ``checkpoint(policy=...)`` on ``where``; None: full checkpoint."""
    if policy is None:
        return None
    try:
        return checkpoint_policy(policy)
    except SlapoError as exc:
        raise PrimitiveError(f'checkpoint on "{where}": {exc}') from None


@register_primitive()
class CheckpointPrimitive(Primitive):
    """Activation checkpointing of the module: its inner activations are recomputed in backward.

    Non-reentrant, restores the RNG states (torch's and the ``fork_rng`` tracker's), so dropout
    masks match on recompute. Parameter names do not change. After ``trace``, pass a subgraph to
    checkpoint only that part of the graph.

    ``policy`` makes it a selective checkpoint (torch's selective-checkpoint contexts): the
    outputs of the ops it names are kept and only the rest is recomputed. ``"save_matmuls"``
    keeps matrix products and attention kernels and recomputes the cheap elementwise and norm
    ops; ``"save_attention"`` keeps attention kernels only; a list of aten ops (e.g.
    ``[torch.ops.aten.mm, torch.ops.aten.addmm]``) or a policy function
    (``slapo.random.checkpoint_policy``) also works. In a compiled module (``compile``) the
    compiler applies the policy with no runtime cost; eagerly every op of the module passes
    through a Python dispatch mode, which costs time on small models.

    While gradients are recorded, a checkpointed transformers layer runs without its key/value
    cache (``use_cache=False``, ``cache=None`` / ``past_key_values=None`` as the release names it;
    one warning), as under transformers' ``gradient_checkpointing_enable()``: the recompute would
    append to the cache a second time. A layer class that only reads its cache
    (``_can_checkpoint_with_cache = True``) keeps it, as transformers keeps it.
    Under ``torch.no_grad()`` (eval, ``generate``) nothing is checkpointed and the cache works.

    A BatchNorm inside the module updates its running statistics once per step, in the forward:
    the recompute in backward works on copies of them (torch's checkpoint would update them twice).

    Example:
        >>> import slapo
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
        >>> sch["0"].checkpoint()
        >>> sch["1"].checkpoint(policy="save_matmuls")  # or checkpoint("save_matmuls")
    """

    name = "checkpoint"

    @staticmethod
    def apply(sch: Schedule, subgraph: Any = None, policy: Any = None, **kwargs: Any) -> Any:
        where = sch.path or type(sch.mod).__name__
        if subgraph is not None and not _is_subgraph(subgraph):  # checkpoint("save_matmuls")
            if policy is not None:
                raise PrimitiveError(f'checkpoint on "{where}": the policy is given twice')
            subgraph, policy = None, subgraph
        policy_fn = resolve_policy(where, policy)
        if "compile" in forward_wraps(sch.mod):
            raise PrimitiveError(
                f'checkpoint on "{where}" after compile(): the compiled code would be recomputed '
                "from outside, eagerly. Apply checkpoint first, then compile: the compiler then "
                "plans the recompute itself"
            )
        if subgraph is not None:
            return checkpoint_subgraph(sch, subgraph, policy=policy_fn, **kwargs)
        if kwargs:
            raise PrimitiveError(
                f'checkpoint() got unexpected arguments {sorted(kwargs)} on "{where}"; it takes '
                "an optional subgraph and policy= (one of "
                f"{', '.join(sorted(CHECKPOINT_POLICIES))}, a list of aten ops or a function)"
            )
        sch.require_unapplied("checkpoint")
        wrap_forward(sch.mod, "checkpoint", _checkpointed(where, sch.mod, policy_fn))
        return None
