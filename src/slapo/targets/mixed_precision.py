"""Mixed precision on the build targets: autocast forwards and loss-scaled optimizers.

The targets apply a :class:`slapo.precision.Precision` with their engine's own mechanism; what
several share lives here:

* :func:`autocast_forward`: the module's forward runs under ``torch.autocast`` (eager, DDP,
  pipeline stages). Its parameters stay float32: they are the master weights the optimizer
  steps, and autocast casts them to the compute dtype per op.
* :func:`with_loss_scaling`: for float16, a loss scaler on the model (``slapo.train_step``
  scales the loss before its backward) and a :class:`LossScaledOptimizer` whose ``step()`` is
  ``scaler.step(optimizer); scaler.update()``: a step whose gradients overflowed is skipped and
  the scale halved. On several ranks the scaler is a ``ShardedGradScaler`` whose inf/NaN check
  is all-reduced, so every rank skips the same steps.

Example:
    >>> model = nn.Linear(4, 4)
    >>> autocast_forward(model, Precision.of("bf16"), "cpu")
    >>> model(torch.randn(2, 4)).dtype, model.weight.dtype
    (torch.bfloat16, torch.float32)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..exceptions import TargetError
from ..precision import Precision
from ..surgery import forward_wraps, wrap_forward

__all__ = [
    "GRAD_SCALER_ATTR",
    "LossScaledOptimizer",
    "autocast_forward",
    "device_type_of",
    "grad_scaler_of",
    "precision_of",
    "with_loss_scaling",
]

#: The attribute of a built model that holds its loss scaler (float16 only).
GRAD_SCALER_ATTR = "slapo_grad_scaler"
_AUTOCAST = "autocast"
_PRECISION_ATTR = "slapo_precision"


def autocast_forward(
    module: nn.Module, precision: Precision, device_type: str | None = None
) -> None:
    """Run ``module``'s forward under ``precision.autocast(device_type)`` (nothing for fp32).

    ``device_type=None`` takes it at each call from the first tensor argument (else the
    module's first parameter): a pipeline stage whose shapes are found on fake CPU tensors and
    which then runs on a GPU autocasts both runs alike. Its parameter names, ``isinstance`` checks and hooks stay (the class is swapped, see
    :func:`slapo.surgery.wrap_forward`). Applying it twice with the same precision does
    nothing; with another one it raises a :class:`TargetError`.

    Example:
        >>> autocast_forward(nn.Linear(2, 2), Precision.of("fp32"), "cpu")  # fp32: unchanged
    """
    if not precision.mixed:
        return
    if _AUTOCAST in forward_wraps(module):
        held = getattr(module, _PRECISION_ATTR, None)
        if held == precision:
            return
        raise TargetError(
            f"{type(module).__name__} already runs under autocast in {held}; build it once, "
            f"or from a fresh model, to train it in {precision}"
        )

    def wrapper(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with precision.autocast(device_type or _device_type(module, args, kwargs)):
            return forward(*args, **kwargs)

    wrap_forward(module, _AUTOCAST, wrapper)
    object.__setattr__(module, _PRECISION_ATTR, precision)


def _device_type(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    device = None
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            device = value.device
            break
    if device is None:
        param = next(module.parameters(), None)
        device = None if param is None else param.device
    # the meta device (a model not yet materialized) computes nothing: its dtypes follow the CPU's
    return "cpu" if device is None or device.type == "meta" else device.type


def device_type_of(model: Any) -> str:
    """The device type a built model's parameters are on (``"cpu"`` for none, or meta).

    Example:
        >>> device_type_of(nn.Linear(2, 2))
        'cpu'
    """
    params = model.parameters() if hasattr(model, "parameters") else iter(())
    param = next(iter(params), None)
    if param is None:
        return "cpu"
    local = param.to_local() if hasattr(param, "to_local") else param
    return "cpu" if local.device.type == "meta" else local.device.type


def precision_of(model: Any) -> Precision:
    """The precision a built model was given (fp32 when none).

    Example:
        >>> precision_of(nn.Linear(2, 2)).name
        'fp32'
    """
    held = getattr(model, _PRECISION_ATTR, None)
    return held if isinstance(held, Precision) else Precision()


def grad_scaler_of(model: Any) -> Any:
    """The loss scaler ``slapo.train_step`` scales ``model``'s loss with (None: no scaling).

    Example:
        >>> grad_scaler_of(nn.Linear(2, 2)) is None
        True
    """
    return getattr(model, GRAD_SCALER_ATTR, None)


class LossScaledOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose ``step()`` applies loss-scaled gradients through ``scaler``:
    ``scaler.step(optimizer)`` (unscale, skip the step on inf/NaN) then ``scaler.update()``.

    It is the optimizer it wraps for everything else: ``param_groups`` (the same list, which
    learning-rate schedulers edit), ``state``, ``zero_grad``. ``state_dict()`` is the inner
    optimizer's plus the scaler's state under ``"grad_scaler"``; ``load_state_dict`` takes both.

    Args:
        optimizer: the torch optimizer over the model's (float32) parameters.
        scaler: a ``torch.amp.GradScaler`` or ``ShardedGradScaler``.

    Example:
        >>> model = nn.Linear(4, 1)
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        >>> opt = LossScaledOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler)
        >>> scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        >>> opt.step(); opt.zero_grad()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TargetError(
                f"loss scaling wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        # Optimizer.__init__ would build state of its own: share the inner optimizer's instead
        self.optimizer, self.scaler = optimizer, scaler
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        for hooks in (
            "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
        ):  # fmt: skip
            setattr(self, hooks, {})
        self._patch_step_function()

    def __repr__(self) -> str:
        return f"LossScaledOptimizer({self.optimizer!r}, scale={self.scaler.get_scale()})"

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The inner optimizer's per-parameter state."""
        return self.optimizer.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Unscale the gradients, step unless one is inf/NaN, update the scale."""
        if closure is not None:
            raise TargetError(
                "LossScaledOptimizer.step: a closure would run an unscaled backward; run "
                "slapo.train_step (or scaler.scale(loss).backward()) before step()"
            )
        result = self.scaler.step(self.optimizer)
        self.scaler.update()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {**self.optimizer.state_dict(), "grad_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        scaler_state = state.pop("grad_scaler", None)
        self.optimizer.load_state_dict(state)
        if scaler_state:
            self.scaler.load_state_dict(scaler_state)


def with_loss_scaling(
    model: Any,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision,
    device_type: str,
    process_group: Any = None,
    sharded: bool = False,
) -> tuple[Any, Any]:
    """``(model, optimizer)`` set up for ``precision``'s loss scaling: for float16 the model
    carries a scaler (:func:`grad_scaler_of`) and the optimizer becomes a
    :class:`LossScaledOptimizer`; otherwise both are returned as they are. ``sharded=True``
    (several ranks) makes a ``ShardedGradScaler`` over ``process_group`` (None: every rank).

    Example:
        >>> model, opt = with_loss_scaling(nn.Linear(2, 2), None, Precision.of("bf16"), "cpu")
        >>> grad_scaler_of(model) is None
        True
    """
    object.__setattr__(model, _PRECISION_ATTR, precision)
    scaler = precision.grad_scaler(device_type, process_group=process_group, sharded=sharded)
    if scaler is None:
        return model, optimizer
    object.__setattr__(model, GRAD_SCALER_ATTR, scaler)
    if optimizer is None:
        return model, None
    return model, LossScaledOptimizer(optimizer, scaler)
