"""Profiling utilities for RoundPipe.

``ROUNDPIPE_PROFILE=torch`` wraps regions in ``torch.profiler.record_function``;
``ROUNDPIPE_PROFILE=nvtx`` emits NVTX ranges (CUDA only). Anything else disables annotation.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import AbstractContextManager as ContextManager

import torch

PROFILER_TYPE: str | None = os.environ.get("ROUNDPIPE_PROFILE") or None


def annotate(name: str, color: str | None = None) -> ContextManager:
    """Return a context manager that labels a region in profiler timelines.

    Example:
        >>> with annotate("forward layer 0"):
        ...     pass
    """
    if PROFILER_TYPE == "torch":
        return torch.profiler.record_function(name)
    if PROFILER_TYPE == "nvtx" and torch.cuda.is_available():
        return torch.cuda.nvtx.range(name)
    return contextlib.nullcontext()
