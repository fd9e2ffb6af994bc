"""A ``slapo train`` run resolved once: its build target, device and precision.

What the flags leave open (``--device auto``, no ``--precision``, ``--target eager`` under
torchrun's replicas or with ``--pp``) is decided here, once per run, and the loop, the layout,
the memory estimate and the report read the answer from one :class:`ResolvedRun`.

Example:
    >>> run = resolve_run(TrainConfig())              # on a machine without a GPU
    >>> run.target, run.device.type, run.precision.name
    ('eager', 'cpu', 'fp32')
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..exceptions import InputError
from ..precision import DeviceError, Precision, PrecisionError, default_precision, resolve_device
from ..targets import TargetRecord, get_record
from .config import TrainConfig
from .uses import TARGET_USES, TargetUse, run_target

__all__ = ["ResolvedRun", "resolve_run"]


@dataclass(frozen=True)
class ResolvedRun:
    """The decisions of one run that its flags leave to the machine.

    Attributes:
        target: the ``slapo.build`` target (:func:`~slapo.train.uses.run_target`).
        device: where this process's model computes (``cuda:LOCAL_RANK`` or the CPU).
        precision: fp32, or mixed bf16/fp16 (float32 master weights and optimizer state).

    Example:
        >>> resolve_run(TrainConfig(precision="bf16")).precision.compute_dtype
        torch.bfloat16
    """

    target: str
    device: torch.device
    precision: Precision

    @property
    def use(self) -> TargetUse:
        """How the main job uses the target (:data:`~slapo.train.uses.TARGET_USES`)."""
        return TARGET_USES[self.target]

    @property
    def record(self) -> TargetRecord:
        """What the target is (:func:`slapo.targets.get_record`): process group, precisions,
        placement, memory model."""
        return get_record(self.target)

    @property
    def batch_device(self) -> torch.device:
        """Where the batches go: the model's device, or the host for a target that keeps the
        model state there and streams it (RoundPipe)."""
        return torch.device("cpu") if self.record.host_state else self.device

    @property
    def backend(self) -> str:
        """The process group's backend: NCCL between GPUs, gloo between CPU processes."""
        return "nccl" if self.device.type == "cuda" else "gloo"

    def build_options(self) -> dict[str, object]:
        """The device and precision options of ``slapo.build`` for this run's target.

        Example:
            >>> resolve_run(TrainConfig(precision="bf16")).build_options()["precision"].name
            'bf16'
        """
        options: dict[str, object] = {"precision": self.precision}
        if self.record.device_option:
            options["device"] = self.device
        return options

    def describe(self) -> str:
        """The device and precision in words, for the summary.

        Example:
            >>> resolve_run(TrainConfig(precision="bf16")).describe()
            'cpu, bf16 mixed precision (float32 master weights)'
        """
        where = f"host memory, streamed to {self.device.type}" if self.record.host_state else ""
        where = where or str(self.device)
        if not self.precision.mixed:
            return f"{where}, fp32"
        return f"{where}, {self.precision.name} mixed precision (float32 master weights)"


def resolve_run(cfg: TrainConfig) -> ResolvedRun:
    """Resolve ``cfg``'s target, device and precision; an impossible choice raises an
    :class:`~slapo.exceptions.InputError` naming the flag (``slapo train`` exits with status 2).

    Example:
        >>> # on a machine without a GPU; where one is visible this resolves instead: not run here
        >>> resolve_run(TrainConfig(device="cuda"))    # doctest: +SKIP
        Traceback (most recent call last):
        InputError: --device cuda: no CUDA GPU is visible to this process ...
    """
    replicas = int(os.environ.get("WORLD_SIZE", "1")) // cfg.tp
    target = run_target(cfg.target, cfg.pp, replicas)
    try:
        device = resolve_device(cfg.device)
    except DeviceError as exc:
        raise InputError(f"--device {cfg.device}: {_after_colon(exc)}") from exc
    try:
        given = cfg.precision
        precision = default_precision(device) if given is None else Precision.of(given)
        precision.check_device(device)
    except PrecisionError as exc:
        raise InputError(f"--precision {cfg.precision}: {_after_colon(exc)}") from exc
    return ResolvedRun(target=target, device=device, precision=precision)


def _after_colon(exc: Exception) -> str:
    text = str(exc)
    return text.split(": ", 1)[1] if ": " in text else text
