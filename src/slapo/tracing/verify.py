"""A check of the dimensions an exported graph keeps symbolic: export may keep a dimension free
and still bake a size derived from it (a chunk count). The traced module is run once more on the
captured call cut one shorter along every free dimension, beside the original; where they differ,
those dimensions are fixed in the guard, so other sizes raise instead of computing garbage."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from .guard import SignatureGuard, _Arg

__all__ = ["pin_unsound_dims"]


def pin_unsound_dims(
    gm: fx.GraphModule, mod: nn.Module, args: tuple, kwargs: dict[str, Any], attr: str
) -> bool:
    """Run ``gm`` and ``mod`` on ``(args, kwargs)`` resized along every free dimension (one
    shorter, and about three times longer, the data repeated); if they differ, fix every free
    dimension in ``gm``'s guard (``attr``) to the captured size. Returns whether it did.

    Example:
        >>> # called by export_module; see tests/tracing/test_trace_fidelity.py
    """
    guard = getattr(gm, attr, None)
    if not isinstance(guard, SignatureGuard) or _hooked(mod):
        return False
    sizes = _free_sizes(guard, args, kwargs)
    shorter = {s: n - 1 for s, n in sizes.items() if n >= 3}  # export's range starts at 2
    longer = {s: 3 * n + 1 for s, n in sizes.items()}  # past chunk boundaries (Mamba2)
    for probe in (shorter, longer):
        if probe and not _same_on(gm, mod, _resize(guard, args, kwargs, probe)):
            guard.args = [_pinned(arg, sizes) for arg in guard.args]
            return True
    return False


def _same_on(gm: fx.GraphModule, mod: nn.Module, call: tuple[tuple, dict[str, Any]]) -> bool:
    """Whether ``gm`` gives what ``mod`` gives on ``call`` (True where ``mod`` refuses it)."""
    try:
        expected = _run(mod, *call)
    except Exception:  # noqa: BLE001  (not a call the module takes: no verdict)
        return True
    try:
        return _close(_run(gm, *call), expected)
    except Exception:  # noqa: BLE001  (the graph fails where the module does not)
        return False


def _hooked(mod: nn.Module) -> bool:
    """A module with hooks (sync's collectives) is not run again: its hooks would fire."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in mod.modules())


def _tensor_leaves(guard: SignatureGuard, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
    """``(leaf expectation, value)`` of every captured tensor, in the guard's order."""
    values = [*args, *kwargs.values()]
    pairs = []
    for arg, value in zip(guard.args, values, strict=True):
        flat = pytree.tree_leaves(value)
        pairs += [(leaf, x) for leaf, x in zip(arg.leaves, flat) if leaf.is_tensor]
    return pairs


def _free_sizes(guard: SignatureGuard, args: tuple, kwargs: dict[str, Any]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for leaf, x in _tensor_leaves(guard, args, kwargs):
        for dim, symbol, _, _ in leaf.symbols:
            sizes.setdefault(symbol, int(x.shape[dim]))
    return sizes


def _resize(
    guard: SignatureGuard, args: tuple, kwargs: dict[str, Any], sizes: dict[str, int]
) -> tuple[tuple, dict[str, Any]]:
    """The call with every tensor resized to ``sizes`` along its dimensions of those symbols:
    cut, or repeated (position ids and masks stay valid values)."""
    resized: dict[int, torch.Tensor] = {}
    for leaf, x in _tensor_leaves(guard, args, kwargs):
        y = x
        for dim, symbol, _, _ in leaf.symbols:
            if symbol in sizes:
                y = _to_size(y, dim, sizes[symbol])
        resized[id(x)] = y

    def swap(v: Any) -> Any:
        return resized.get(id(v), v) if isinstance(v, torch.Tensor) else v

    return pytree.tree_map(swap, (args, kwargs))


def _to_size(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    reps = [1] * x.dim()
    reps[dim] = -(-size // x.shape[dim])
    return x.repeat(*reps).narrow(dim, 0, size).contiguous()


def _run(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors ``module`` returns, with a fixed seed and the global RNG state kept."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = module(*args, **kwargs)
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _close(out: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    if len(out) != len(expected):
        return False
    for a, b in zip(out, expected, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point() and not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            return False
        if not a.is_floating_point() and not torch.equal(a, b):
            return False
    return True


def _pinned(arg: _Arg, sizes: dict[str, int]) -> _Arg:
    """``arg`` with its free dimensions fixed to the captured sizes."""
    leaves = tuple(
        dataclasses.replace(
            leaf,
            static=(*leaf.static, *((d, sizes[s]) for d, s, _, _ in leaf.symbols if s in sizes)),
            symbols=(),
        )
        for leaf in arg.leaves
    )
    return dataclasses.replace(arg, leaves=leaves)
