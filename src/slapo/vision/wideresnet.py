"""Wide residual networks (Zagoruyko & Komodakis, "Wide Residual Networks", 2016): WRN-d-k.

A 3x3 stem convolution to 16 channels, then three groups of ``n = (d - 4) / 6`` pre-activation
basic blocks of widths ``16k``, ``32k`` and ``64k`` (the second and third groups halve the spatial
size in their first block), then BN-ReLU, global average pooling and a linear classifier. A block
is BN-ReLU-conv3x3-BN-ReLU-dropout-conv3x3 plus a shortcut: the identity, or a 1x1 convolution of
the block's activated input when the width or the stride changes. Convolutions have no bias (a
BatchNorm follows each one) and He-normal (fan-out) weights.

The module paths are ``conv``, ``layer1`` .. ``layer3`` (each an ``nn.Sequential`` of
:class:`BasicBlock`: ``bn1``, ``conv1``, ``bn2``, ``dropout``, ``conv2``, ``shortcut``), ``bn``
and ``fc``; the ready schedule (``slapo.model_schedule``, family ``"wideresnet"``) names them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..exceptions import SlapoError

__all__ = ["WideResNetConfig", "HeConv2d", "BasicBlock", "WideResNet", "wideresnet_loss"]


@dataclass(frozen=True)
class WideResNetConfig:
    """The sizes of a WRN-d-k; ``model_type`` picks the ready schedule.

    Example:
        >>> WideResNetConfig(depth=16, widen_factor=4).widths
        (16, 64, 128, 256)
    """

    model_type: ClassVar[str] = "wideresnet"

    depth: int = 16
    widen_factor: int = 4
    num_classes: int = 10
    dropout: float = 0.0
    in_channels: int = 3

    def __post_init__(self) -> None:
        for name in ("depth", "widen_factor", "num_classes", "in_channels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SlapoError(f"WideResNet: {name} must be a positive int, got {value!r}")
        if self.depth < 10 or (self.depth - 4) % 6:
            raise SlapoError(
                f"WideResNet: depth must be 6n + 4 with n >= 1 (10, 16, 22, 28, 40, ...), got "
                f"{self.depth}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise SlapoError(f"WideResNet: dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def blocks_per_group(self) -> int:
        return (self.depth - 4) // 6

    @property
    def widths(self) -> tuple[int, int, int, int]:
        """The stem's width, then each group's."""
        k = self.widen_factor
        return 16, 16 * k, 32 * k, 64 * k


class HeConv2d(nn.Conv2d):
    """``nn.Conv2d`` initialized as the paper's networks are: He normal, by fan out.

    The initialization lives in ``reset_parameters`` so that a model built under
    ``slapo.init_empty_weights()`` gets it too when it is materialized.
    """

    def reset_parameters(self) -> None:
        nn.init.kaiming_normal_(self.weight, mode="fan_out", nonlinearity="relu")
        if self.bias is not None:
            nn.init.zeros_(self.bias)


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return HeConv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """A pre-activation block: BN-ReLU-conv3x3-BN-ReLU-dropout-conv3x3, plus the shortcut.

    Example:
        >>> block = BasicBlock(16, 32, stride=2)
        >>> block(torch.randn(2, 16, 8, 8)).shape
        torch.Size([2, 32, 4, 4])
    """

    def __init__(self, cin: int, cout: int, stride: int = 1, dropout: float = 0.0) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = _conv3x3(cin, cout, stride)
        self.bn2 = nn.BatchNorm2d(cout)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = _conv3x3(cout, cout)
        # The identity where the shape holds; a strided 1x1 projection where it changes.
        reshape = cin != cout or stride != 1
        self.shortcut = HeConv2d(cin, cout, 1, stride=stride, bias=False) if reshape else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = F.relu(self.bn1(x))
        out = self.conv2(self.dropout(F.relu(self.bn2(self.conv1(act)))))
        # A projection shortcut reads the activated input, as the authors' implementation does.
        skip = x if self.shortcut is None else self.shortcut(act)
        return skip + out


class WideResNet(nn.Module):
    """WRN-``depth``-``widen_factor`` for images of any size (global average pooling at the end).

    ``forward(images)`` returns the logits, ``(batch, num_classes)``; see
    :func:`wideresnet_loss` for the training loss.

    Example:
        >>> model = WideResNet(depth=10, widen_factor=2, num_classes=10)
        >>> model(torch.randn(4, 3, 8, 8)).shape
        torch.Size([4, 10])
        >>> model.config.model_type
        'wideresnet'
    """

    def __init__(
        self,
        depth: int = 16,
        widen_factor: int = 4,
        num_classes: int = 10,
        dropout: float = 0.0,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        self.config = WideResNetConfig(depth, widen_factor, num_classes, dropout, in_channels)
        stem, *widths = self.config.widths
        self.conv = _conv3x3(in_channels, stem)
        cin = stem
        for index, (width, stride) in enumerate(zip(widths, (1, 2, 2)), start=1):
            setattr(self, f"layer{index}", self._group(cin, width, stride))
            cin = width
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, num_classes)

    def _group(self, cin: int, width: int, stride: int) -> nn.Sequential:
        n, p = self.config.blocks_per_group, self.config.dropout
        first = BasicBlock(cin, width, stride, p)
        return nn.Sequential(first, *(BasicBlock(width, width, 1, p) for _ in range(n - 1)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        out = self.layer3(self.layer2(self.layer1(self.conv(images))))
        out = F.relu(self.bn(out))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


def wideresnet_loss(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of ``model``'s logits for ``images`` against class ``labels``.

    Example:
        >>> model = WideResNet(depth=10, widen_factor=1)
        >>> loss = wideresnet_loss(model, torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3]))
        >>> loss.backward()
    """
    return F.cross_entropy(model(images), labels)
