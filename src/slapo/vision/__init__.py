"""Vision models written for Slapo's schedules (no torchvision needed).

Example:
    >>> import slapo
    >>> from slapo.vision import WideResNet
    >>> model = WideResNet(depth=16, widen_factor=4)
    >>> sch = slapo.model_schedule.apply_schedule(model, ckpt_ratio=0.5)
"""

from __future__ import annotations

from .wideresnet import BasicBlock, HeConv2d, WideResNet, WideResNetConfig, wideresnet_loss

__all__ = ["BasicBlock", "HeConv2d", "WideResNet", "WideResNetConfig", "wideresnet_loss"]
