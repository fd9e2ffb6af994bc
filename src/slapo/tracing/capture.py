"""Example inputs: what a submodule is called with when the whole model runs on its inputs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .errors import TraceError

__all__ = ["as_args", "call_args", "capture_inputs"]


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
