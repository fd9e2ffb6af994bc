"""Example inputs: what a submodule is called with when the whole model runs on its inputs."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..surgery import label
from .errors import TraceError

__all__ = ["as_args", "call_args", "capture_inputs", "with_concrete_args"]


class _Captured(Exception):
    """Stops the capture run as soon as the target module got its inputs."""


def as_args(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for a call on ``inputs``: a dict is keyword arguments, a tuple or list
    positional ones, anything else the one positional argument.

    Example:
        >>> as_args({"x": 1}), as_args([1, 2]), as_args(3)
        (((), {'x': 1}), ((1, 2), {}), ((3,), {}))
    """
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple):
        return inputs, {}
    if isinstance(inputs, list):
        return tuple(inputs), {}
    return (inputs,), {}


def call_args(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Like :func:`as_args`, and ``{"args": ..., "kwargs": ...}`` gives both explicitly.

    Example:
        >>> call_args({"args": [1], "kwargs": {"y": 2}})
        ((1,), {'y': 2})
    """
    if isinstance(example_inputs, dict) and set(example_inputs) == {"args", "kwargs"}:
        return tuple(example_inputs["args"]), dict(example_inputs["kwargs"])
    return as_args(example_inputs)


def capture_inputs(
    root: nn.Module, target: nn.Module, root_inputs: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Run ``root`` on ``root_inputs`` and return the ``(args, kwargs)`` ``target`` is called with.

    The run stops at the target's first call, keeps no autograd graph and leaves the global RNG
    state untouched, so a later training step is unaffected.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> args, kwargs = capture_inputs(model, model[1], (torch.randn(2, 4),))
        >>> args[0].shape
        torch.Size([2, 4])
    """
    seen: dict[str, Any] = {}

    def hook(mod: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        seen["args"], seen["kwargs"] = args, kwargs
        raise _Captured

    handle = target.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    args, kwargs = as_args(root_inputs)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            root(*args, **kwargs)
    except _Captured:
        pass
    finally:
        handle.remove()
    if "args" not in seen:
        raise TraceError(
            f"{type(target).__name__} was never called when running the model on its example "
            "inputs; pass example_inputs= for this module"
        )
    return seen["args"], seen["kwargs"]


def with_concrete_args(
    mod: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    concrete_args: dict[str, Any] | None,
    path: str = "",
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call ``(args, kwargs)`` of ``mod`` with the arguments ``concrete_args`` names fixed
    to its values: what torch.export traces for ``trace(tracer="dynamo", concrete_args=...)``.

    A name ``mod.forward`` does not declare goes into its ``**kwargs``. An entry whose value is
    ``inspect.Parameter.empty`` (Slapo code builds ``concrete_args`` from the signature's
    defaults, ``**kwargs`` and required arguments included) leaves that argument as captured.

    Example:
        >>> class Masked(nn.Module):
        ...     def forward(self, x, mask=None, **kwargs):
        ...         return x if mask is None else x * mask
        >>> with_concrete_args(Masked(), (1, 2), {}, {"mask": None, "kwargs": inspect._empty})
        ((1,), {'mask': None})
        >>> with_concrete_args(Masked(), (1,), {"mask": 2}, {"mask": None})
        ((1,), {'mask': None})
        >>> with_concrete_args(Masked(), (1,), {}, {"use_cache": False})
        ((1,), {'use_cache': False})
    """
    fixed = {k: v for k, v in (concrete_args or {}).items() if v is not inspect.Parameter.empty}
    if not fixed:
        return args, kwargs
    where = f'trace of "{label(path)}" ({type(mod).__name__})'
    sig = inspect.signature(mod.forward)
    params = sig.parameters
    # The call keeps its structure otherwise: the graph takes calls made as this one is.
    positional = [
        n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    has_varkw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    args, kwargs = list(args), dict(kwargs)
    # Fixed ones at the end of the positional arguments are passed by name instead: the graph
    # then also takes calls that leave them out (or pass them by name).
    while 0 < len(args) <= len(positional):
        last = params[positional[len(args) - 1]]
        if last.name not in fixed or last.kind == last.POSITIONAL_ONLY:
            break
        kwargs[last.name] = args.pop()
    for name, value in fixed.items():
        param = params.get(name)
        if name in positional and positional.index(name) < len(args):
            args[positional.index(name)] = value
        elif (param is None and has_varkw) or (
            param is not None and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
        ):
            kwargs[name] = value
        else:
            raise TraceError(
                f"{where}: concrete_args names {name!r}, but forward{sig} takes no named "
                f"argument {name!r}; fix only its named arguments (or drop the entry)"
            )
    return tuple(args), kwargs
