"""Where and in what precision a model trains: :class:`Precision` and :func:`resolve_device`.

Mixed precision the way the engines do it: the weights the optimizer steps (the master weights)
and the optimizer state stay float32; the forward and backward compute in ``bfloat16`` or
``float16``. Each target applies it with its engine's own mechanism (``torch.autocast`` for eager,
DDP and pipeline stages; FSDP2's ``MixedPrecisionPolicy``; DeepSpeed's ``bf16``/``fp16`` config
sections; RoundPipe's low-precision model with float32 optimizer copies). float16 also scales the
loss (a ``GradScaler``, sharded where ranks must skip the same steps), since its gradients
underflow otherwise; bfloat16 has float32's range and needs no scaling.

Example:
    >>> p = Precision.of("bf16")
    >>> p.compute_dtype, p.master_dtype, p.mixed, p.loss_scaling
    (torch.bfloat16, torch.float32, True, False)
    >>> with p.autocast("cpu"):
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.bfloat16
    >>> resolve_device("cpu")
    device(type='cpu')
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch

from .exceptions import SlapoError

__all__ = [
    "DEVICES",
    "PRECISIONS",
    "DeviceError",
    "Precision",
    "PrecisionError",
    "default_precision",
    "resolve_device",
]

#: The precisions a model trains in: float32 throughout, or mixed with bf16 or fp16 compute.
PRECISIONS = ("fp32", "bf16", "fp16")
#: ``--device`` values: ``auto`` is ``cuda:LOCAL_RANK`` where a GPU is, else the CPU.
DEVICES = ("auto", "cuda", "cpu")

_COMPUTE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALIASES = {
    "float32": "fp32", "32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "16": "fp16",
}  # fmt: skip


class PrecisionError(SlapoError, ValueError):
    """An unknown precision, or one the device cannot compute in."""


class DeviceError(SlapoError, ValueError):
    """A device that is not there (``cuda`` on a machine without a GPU) or not known."""


@dataclass(frozen=True)
class Precision:
    """The precision a model trains in: ``"fp32"``, or mixed ``"bf16"``/``"fp16"``.

    Attributes:
        name: one of :data:`PRECISIONS`.

    Example:
        >>> Precision.of(torch.float16).loss_scaling
        True
        >>> Precision.of(None) == Precision("fp32")
        True
    """

    name: str = "fp32"

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise PrecisionError(
                f"precision must be one of {PRECISIONS} (or a torch dtype), got {self.name!r}"
            )

    @classmethod
    def of(cls, value: Precision | str | torch.dtype | None) -> Precision:
        """A :class:`Precision` from a name (``"bf16"``, ``"bfloat16"``), a dtype or None (fp32).

        Example:
            >>> Precision.of(torch.bfloat16).name, Precision.of("half").name
            ('bf16', 'fp16')
        """
        if value is None:
            return cls()
        if isinstance(value, Precision):
            return value
        if isinstance(value, torch.dtype):
            names = {dtype: name for name, dtype in _COMPUTE.items()}
            if value not in names:
                raise PrecisionError(
                    f"precision={value}: training computes in float32, bfloat16 or float16"
                )
            return cls(names[value])
        if not isinstance(value, str):
            raise PrecisionError(
                f"precision= takes a name {PRECISIONS}, a torch dtype or None, got "
                f"{type(value).__name__}"
            )
        text = value.strip().lower()
        return cls(_ALIASES.get(text, text))

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the forward and backward compute in."""
        return _COMPUTE[self.name]

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of the weights the optimizer steps and of its state: always float32."""
        return torch.float32

    @property
    def mixed(self) -> bool:
        """Whether compute runs in a lower precision than the master weights."""
        return self.name != "fp32"

    @property
    def loss_scaling(self) -> bool:
        """Whether the loss is scaled against gradient underflow (float16 only)."""
        return self.name == "fp16"

    @property
    def compute_bytes(self) -> int:
        """Bytes of one element in the compute dtype (4 or 2)."""
        return torch.empty((), dtype=self.compute_dtype).element_size()

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` to the compute dtype on ``device_type``; nothing for fp32.

        Example:
            >>> with Precision.of("fp32").autocast("cpu"):
            ...     torch.ones(1).dtype
            torch.float32
        """
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.compute_dtype)

    def grad_scaler(
        self, device_type: str, process_group: Any = None, sharded: bool = False
    ) -> Any:
        """The loss scaler of this precision: None but for float16. ``sharded=True`` gives one
        whose inf/NaN checks agree over ``process_group`` (every rank then skips the same
        steps): ``ShardedGradScaler``; else ``torch.amp.GradScaler``.

        Example:
            >>> Precision.of("bf16").grad_scaler("cpu") is None
            True
            >>> type(Precision.of("fp16").grad_scaler("cpu")).__name__
            'GradScaler'
        """
        if not self.loss_scaling:
            return None
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(device=device_type, process_group=process_group)
        return torch.amp.GradScaler(device_type)

    def check_device(self, device: torch.device | str) -> None:
        """Raise a :class:`PrecisionError` when ``device`` cannot compute in this precision.

        Example:
            >>> Precision.of("bf16").check_device("cpu")
        """
        device = torch.device(device)
        if device.type == "cuda" and self.name == "bf16" and not torch.cuda.is_bf16_supported():
            raise PrecisionError(
                "precision bf16: this GPU has no bfloat16 (compute capability below 8.0); use "
                "fp16 (with loss scaling) or fp32"
            )

    def __str__(self) -> str:
        return self.name


def default_precision(device: torch.device | str) -> Precision:
    """bf16 on a GPU that has it, else fp32 (the CPU's float32 is its fastest path for training).

    Example:
        >>> default_precision("cpu")
        Precision(name='fp32')
    """
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return Precision("bf16")
    return Precision("fp32")


def resolve_device(
    choice: str | torch.device | None = "auto", local_rank: int | None = None
) -> torch.device:
    """The device a process trains on: ``auto`` is ``cuda:LOCAL_RANK`` where a GPU is, else the
    CPU; ``cuda`` without a GPU raises a :class:`DeviceError` naming the choice.

    Example:
        >>> resolve_device("auto").type in ("cuda", "cpu")
        True
    """
    if isinstance(choice, torch.device):
        choice = str(choice)
    text = (choice or "auto").strip().lower()
    kind = text.split(":", 1)[0]
    if kind not in DEVICES:
        raise DeviceError(f"device must be one of {DEVICES} (or cuda:N), got {choice!r}")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if kind == "auto":
            return torch.device("cpu")
        raise DeviceError(
            f"device {choice!r}: no CUDA GPU is visible to this process (torch "
            f"{torch.__version__}, CUDA {torch.version.cuda or 'not built'}); use cpu or auto"
        )
    if ":" in text:
        return torch.device(text)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_rank % torch.cuda.device_count())
