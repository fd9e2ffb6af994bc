"""What the optimizer knows of a RoundPipe model: the base class that marks one.

:class:`~roundpipe.optim.adam.RoundPipeOptimizer` only accepts a model that keeps optimizer
copies of its parameters and steps them itself (``optim_parameters()``, ``step()``,
``zero_grad()``, ``name``). The wrappers that do (:class:`~roundpipe.RoundPipeBase` and its
subclasses) live a floor up in :mod:`roundpipe.wrapping`; this marker sits here so the optimizer
can recognise them without importing upward.

Example:
    >>> from torch import nn
    >>> from roundpipe import RoundPipe
    >>> isinstance(RoundPipe(nn.Linear(2, 2), pin_model="off"), OptimCopyOwner)
    True
    >>> isinstance(nn.Linear(2, 2), OptimCopyOwner)
    False
"""

from __future__ import annotations

from torch import nn

__all__ = ["OptimCopyOwner"]


class OptimCopyOwner(nn.Module):
    """Base of every module that owns optimizer copies of its parameters and steps them
    (``RoundPipeBase``); it adds no behaviour of its own."""
