"""Dropout with masks drawn in bulk: four decisions per 64-bit draw of torch's generator.

On CPU, ``bernoulli_`` (what dropout draws its mask with) costs about 1.4 ms per half a million
elements on two cores: a quarter to a third of a small transformer's training step. Drawing 64
random bits per four elements and comparing each 16-bit lane with a threshold gives a mask with
the same Bernoulli law, the drop probability rounded to a multiple of 1/65536, at about a quarter
of the cost (compiled, 360 K elements, 2 threads: 0.56 ms against 1.99 ms). The bits come from torch's default generator
of the tensor's device, so ``torch.manual_seed``, ``fork_rng`` and checkpoint recompute (which
restore that generator) reproduce the masks.

:func:`bulk_dropout` is the function; the ``compile`` primitive's ``rng="bulk"`` makes every
dropout of a compiled region (``nn.Dropout``, ``F.dropout``, SDPA's attention dropout) use it;
:func:`bulk_dropout_masks` makes eager code draw the same masks, which is how a compiled
``rng="bulk"`` region is checked against its eager code.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LANES", "bulk_dropout", "bulk_dropout_masks", "bulk_keep_mask", "quantized_p"]

#: Decisions per 64-bit draw: 16-bit lanes, so the drop probability is a multiple of 1/65536.
LANES = 4
_LEVELS = 1 << 16
_aten = torch.ops.aten


def quantized_p(p: float) -> float:
    """The drop probability :func:`bulk_dropout` realizes for ``p``: ``p`` rounded to 1/65536.

    Example:
        >>> abs(quantized_p(0.1) - 0.1) < 2**-17
        True
    """
    return round(p * _LEVELS) / _LEVELS


def bulk_keep_mask(
    shape: torch.Size | tuple[int, ...], p: float, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A boolean mask of ``shape``, each element True (kept) with probability ``1 - p``.

    Each 64-bit word drawn from the default generator of ``device`` decides four elements: an
    element is dropped when its 16-bit lane (little-endian order within the word) is below
    ``round(p * 65536)``. Traceable: inductor fuses the comparison into its consumers.

    Example:
        >>> _ = torch.manual_seed(0); keep = bulk_keep_mask((1000,), 0.25)
        >>> 0.2 < 1 - keep.float().mean().item() < 0.3
        True
    """
    dropped_levels = round(p * _LEVELS)
    if dropped_levels >= _LEVELS:  # the threshold would not fit a 16-bit lane
        return torch.zeros(shape, dtype=torch.bool, device=device)
    numel = math.prod(shape)
    words = (numel + LANES - 1) // LANES
    # [-2**63, 2**63 - 1): every 64-bit pattern but one, uniformly
    bits = torch.randint(-(2**63), 2**63 - 1, (words,), dtype=torch.int64, device=device)
    lanes = bits.view(torch.int16)[:numel].view(shape)  # signed lanes: -32768 .. 32767
    return lanes >= dropped_levels - _LEVELS // 2


def bulk_dropout(
    x: torch.Tensor, p: float, train: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.native_dropout`` with a :func:`bulk_keep_mask`: ``(output, keep mask)``.

    The output is ``x * mask / (1 - p)`` as in torch; with ``train=False`` (or ``p == 0``) it is
    ``x`` and nothing is drawn.

    Example:
        >>> out, keep = bulk_dropout(torch.ones(8), 0.5)
        >>> set(out.tolist()) <= {0.0, 2.0}
        True
    """
    if not train or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    if p >= 1:
        return torch.zeros_like(x), torch.zeros_like(x, dtype=torch.bool)
    keep = bulk_keep_mask(x.shape, p, x.device)
    return x * keep * (1.0 / (1.0 - p)), keep


class _BulkMasks(TorchDispatchMode):
    """Eager dropout (``native_dropout``, or ``bernoulli_`` on a fresh tensor as CPU dropout and
    SDPA's math path draw) takes its mask from :func:`bulk_keep_mask`."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _aten.native_dropout.default:
            return bulk_dropout(*args, **kwargs)
        if func is _aten.bernoulli_.float and kwargs.get("generator") is None:
            target, keep_p = args[0], (args[1] if len(args) > 1 else kwargs.get("p", 0.5))
            return target.copy_(bulk_keep_mask(target.shape, 1.0 - keep_p, target.device))
        return func(*args, **kwargs)


@contextlib.contextmanager
def bulk_dropout_masks() -> Iterator[None]:
    """Eager code in this context draws its dropout masks as a compiled ``rng="bulk"`` region does.

    Every op runs through a Python dispatch mode, so the code runs slower: this is a reference for
    tests and debugging, not a way to train.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
        >>> with bulk_dropout_masks():
        ...     loss = model(torch.ones(2, 4)).sum()  # the masks of sch.compile(rng="bulk")
    """
    with _BulkMasks():
        yield
