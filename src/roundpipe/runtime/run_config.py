"""Runtime configuration objects shared across RoundPipe components."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from ..devices.device import get_num_devices
from ..errors import RoundPipeTypeError, RoundPipeValueError
from .plan import ModelExecutePlan
from .split_spec import check_spec, is_spec

__all__ = ["FullRoundPipeRunConfig", "RoundPipeRunConfig"]

_FIELDS = (
    "requires_grad",
    "output_device",
    "preserve_rng_state",
    "recompute_grain",
    "num_microbatch",
    "split_input",
    "split_label",
    "merge_output",
    "execute_plan",
)


class RoundPipeRunConfig:
    """Configuration for running RoundPipe models; ``None`` means "inherit".

    Set it per model (``RoundPipe(model, model_run_config=...)``) and/or per call
    (``model(x, roundpipe_run_config=...)``); per-call values win.

    Args:
        requires_grad: store state for backward. Default: ``torch.is_grad_enabled()``.
        output_device: where outputs are placed. Default: CPU.
        preserve_rng_state: replay the same random numbers (dropout) in recompute. Default True.
        recompute_grain: ``"stage"`` recomputes a whole backward stage then runs its backward;
            ``"layer"`` recomputes and back-propagates layer by layer. Default ``"stage"``.
        num_microbatch: microbatches per call. Default: number of devices + 1.
        split_input: ``None`` (automatic: tensors whose dim 0 is the batch size are chunked,
            the rest replicated), a spec mirroring ``(args, kwargs)`` or a prefix of it (e.g.
            an ``(args_spec, kwargs_spec)`` pair) whose leaves are
            ``torch.distributed.pipelining``'s ``TensorChunkSpec(dim)`` or ``_Replicate``, a
            split dim (int) or ``None`` (replicate), or a callable ``(args, kwargs, n)``
            returning ``(args_list, kwargs_list)`` or a list of ``(args, kwargs)`` pairs.
        split_label: ``None`` (automatic), a spec mirroring the label, or a callable
            ``(label, n) -> list`` of ``n`` labels.
        merge_output: ``None``/``True`` (concatenate along dim 0, average floating scalars,
            sum integer ones), ``False`` (the output structure with a
            :class:`~roundpipe.batch.RoundPipePackedData` of per-microbatch values at each
            leaf, for chaining models), a merge spec mirroring the output (leaves:
            ``TensorChunkSpec``, ``_Replicate`` / ``None``, ``sum_reducer``,
            :data:`~roundpipe.batch.avg_reducer`), or a callable ``list[output] -> output``.
        execute_plan: a fixed :class:`~roundpipe.scheduler.ModelExecutePlan`. Default: auto.

    Example:
        >>> cfg = RoundPipeRunConfig(num_microbatch=4, recompute_grain="layer")
        >>> cfg.num_microbatch
        4
    """

    def __init__(
        self,
        requires_grad: bool | None = None,
        output_device: torch.device | str | None = None,
        preserve_rng_state: bool | None = None,
        recompute_grain: Literal["stage", "layer"] | None = None,
        num_microbatch: int | None = None,
        split_input: Any = None,
        split_label: Any = None,
        merge_output: bool | Callable[[list[Any]], Any] | Any = None,
        execute_plan: ModelExecutePlan | None = None,
    ) -> None:
        for name, value in (
            ("requires_grad", requires_grad),
            ("preserve_rng_state", preserve_rng_state),
        ):
            if value is not None and not isinstance(value, bool):
                raise RoundPipeTypeError(f"{name} must be bool or None, got {type(value).__name__}")
        if recompute_grain is not None and recompute_grain not in ("stage", "layer"):
            raise RoundPipeValueError(
                f"recompute_grain must be 'stage' or 'layer', got {recompute_grain!r}"
            )
        if num_microbatch is not None and (
            not isinstance(num_microbatch, int)
            or isinstance(num_microbatch, bool)
            or num_microbatch < 1
        ):
            raise RoundPipeValueError(
                f"num_microbatch must be a positive int, got {num_microbatch!r}"
            )
        if output_device is not None:
            try:
                output_device = torch.device(output_device)
            except (RuntimeError, TypeError) as e:
                raise RoundPipeValueError(
                    f"output_device is not a device: {output_device!r}"
                ) from e
        if not isinstance(merge_output, bool) and is_spec(merge_output, for_merge=True):
            check_spec(merge_output, "merge_output", for_merge=True)
        for name, spec in (("split_input", split_input), ("split_label", split_label)):
            if is_spec(spec):
                check_spec(spec, name)
        if execute_plan is not None:
            if not isinstance(execute_plan, ModelExecutePlan):
                raise RoundPipeTypeError(
                    f"execute_plan must be a ModelExecutePlan, got {type(execute_plan).__name__}"
                )
        self.requires_grad = requires_grad
        self.output_device = output_device
        self.preserve_rng_state = preserve_rng_state
        self.recompute_grain = recompute_grain
        self.num_microbatch = num_microbatch
        self.split_input = split_input
        self.split_label = split_label
        self.merge_output = merge_output
        self.execute_plan = execute_plan

    def __repr__(self) -> str:
        set_fields = ", ".join(
            f"{k}={getattr(self, k)!r}" for k in _FIELDS if getattr(self, k) is not None
        )
        return f"RoundPipeRunConfig({set_fields})"


class FullRoundPipeRunConfig:
    """A per-call config merged over the model config, with every default resolved.

    Example:
        >>> cfg = RoundPipeRunConfig(num_microbatch=2)
        >>> full = FullRoundPipeRunConfig(cfg, RoundPipeRunConfig())
        >>> full.num_microbatch, full.recompute_grain
        (2, 'stage')
    """

    requires_grad: bool
    output_device: torch.device
    preserve_rng_state: bool
    recompute_grain: Literal["stage", "layer"]
    num_microbatch: int

    def __init__(
        self, function_run_config: RoundPipeRunConfig, model_run_config: RoundPipeRunConfig
    ) -> None:
        for name, cfg in (
            ("function_run_config", function_run_config),
            ("model_run_config", model_run_config),
        ):
            if not isinstance(cfg, RoundPipeRunConfig):
                raise RoundPipeTypeError(
                    f"{name} must be a RoundPipeRunConfig, got {type(cfg).__name__}"
                )
        for k in _FIELDS:
            v = getattr(function_run_config, k)
            setattr(self, k, v if v is not None else getattr(model_run_config, k))
        if self.requires_grad is None:
            self.requires_grad = torch.is_grad_enabled()
        if self.output_device is None:
            self.output_device = torch.device("cpu")
        if self.preserve_rng_state is None:
            self.preserve_rng_state = True
        if self.recompute_grain is None:
            self.recompute_grain = "stage"
        if self.num_microbatch is None:
            self.num_microbatch = get_num_devices() + 1
        if self.merge_output is None:
            self.merge_output = True
