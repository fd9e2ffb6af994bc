"""RoundPipe: train models larger than device memory by streaming layers round-robin to devices.

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

from .batch import RoundPipePackedData
from .context import (
    OptimizerCtx,
    doing_optimizer,
    doing_recompute,
    get_recompute_data,
    save_for_recompute,
)
from .device import DeviceMemoryError, get_devices, get_num_devices, init_devices
from .grad_scaler import GradScaler
from .optim import Adam, RoundPipeOptimizer
from .roundpipe import AutoRoundPipe, RoundPipe, RoundPipeBase
from .run_config import RoundPipeRunConfig
from .scheduler import ModelExecutePlan
from .threads import RoundPipeTimeoutError
from .wrapper import wrap_model_to_roundpipe

__all__ = [
    "Adam",
    "AutoRoundPipe",
    "DeviceMemoryError",
    "GradScaler",
    "ModelExecutePlan",
    "OptimizerCtx",
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
