"""RoundPipe: train models larger than device memory by streaming layers round-robin to devices.

The code lives in sub-packages that show the architecture: ``wrapping`` (the model wrappers),
``models`` (presets), ``runtime`` (run, plan, config, batches, contexts), ``devices`` (device
backends, link, transfer, memory, threads) and ``optim`` (Adam and its C++ kernel, the optimizer
stream, the grad scaler). The module paths seed 004 documents (``roundpipe.batch``, ...) still import
(:mod:`roundpipe.seed_paths`).

Importing this package touches no device: devices (CUDA, or CPU virtual devices with
``ROUNDPIPE_VIRTUAL_DEVICES=N``) are created on first use or by :func:`init_devices`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from roundpipe import RoundPipe, RoundPipeRunConfig
    >>> model = RoundPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), pin_model="off",
    ...                   model_run_config=RoundPipeRunConfig(num_microbatch=2))
    >>> opt = torch.optim.Adam(model.optim_parameters(), lr=1e-3)
    >>> loss = model.forward_backward((torch.randn(4, 4),), label=torch.randn(4, 1),
    ...     loss_fn=lambda out, y: nn.functional.mse_loss(out, y) / 2)
    >>> model.step(lambda: (opt.step(), opt.zero_grad()))
    >>> model.synchronize()
"""

from __future__ import annotations

import sys

from .devices.device import DeviceMemoryError, get_devices, get_num_devices, init_devices
from .devices.threads import RoundPipeTimeoutError
from .optim.adam import Adam, RoundPipeOptimizer
from .optim.grad_scaler import GradScaler
from .runtime.batch import MicrobatchMergeError, RoundPipePackedData
from .runtime.context import (
    OptimizerCtx,
    RecomputeDataError,
    doing_optimizer,
    doing_recompute,
    get_recompute_data,
    save_for_recompute,
)
from .runtime.plan import InvalidPlanError, ModelExecutePlan
from .runtime.run_config import RoundPipeRunConfig
from .seed_paths import register_seed_paths
from .wrapping.model import AutoRoundPipe, RoundPipe, RoundPipeBase
from .wrapping.wrap import wrap_model_to_roundpipe

register_seed_paths(sys.modules[__name__])

__all__ = [
    "Adam",
    "AutoRoundPipe",
    "DeviceMemoryError",
    "GradScaler",
    "InvalidPlanError",
    "MicrobatchMergeError",
    "ModelExecutePlan",
    "OptimizerCtx",
    "RecomputeDataError",
    "RoundPipe",
    "RoundPipeBase",
    "RoundPipeOptimizer",
    "RoundPipePackedData",
    "RoundPipeRunConfig",
    "RoundPipeTimeoutError",
    "doing_optimizer",
    "doing_recompute",
    "get_devices",
    "get_num_devices",
    "get_recompute_data",
    "init_devices",
    "save_for_recompute",
    "wrap_model_to_roundpipe",
]
