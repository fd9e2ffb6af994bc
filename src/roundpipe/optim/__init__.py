"""The optimizer side: :class:`Adam` (a C++ kernel with a PyTorch fallback) stepping on the
host, the optimizer stream that runs steps asynchronously, and :class:`GradScaler`.

Modules: ``adam`` (the seed's ``roundpipe.optim`` names, re-exported here), ``builder`` (the seed's
``roundpipe.optim_builder``), ``stream`` (``roundpipe.optim_stream``), ``grad_scaler``, and the
kernel's source in ``csrc/``.

Example:
    >>> from roundpipe.optim import Adam  # the seed's path
"""

from __future__ import annotations

from .adam import Adam, RoundPipeOptimizer

__all__ = ["Adam", "RoundPipeOptimizer"]
