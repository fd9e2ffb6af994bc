"""Loss scaling for mixed precision that works with RoundPipe's asynchronous step.

The main thread (and the device workers running ``loss_fn``) scale losses while the optimizer
thread may still be unscaling the previous step's gradients and computing the next scale. What
the caller sees follows program order, never the timing of that thread:

* a step's losses are scaled with the scale the previous ``update()`` computed (as
  ``torch.amp.GradScaler``): the first ``scale()`` after an ``update()`` waits for it if the
  optimizer thread has not finished it yet;
* ``get_scale()`` reports the scale of the step in progress, i.e. after ``update()`` still the
  one that step's losses were multiplied by, so ``loss.item() / scaler.get_scale()`` is the true
  loss wherever the user guide reads it (before ``model.step`` or after ``scaler.update()``). The
  step's scale is replaced by the new one at the next ``scale()``, at ``update(is_async=False)``
  and at ``get_scale(up_to_date=True)`` (these wait for the pending update).

The scale a step's losses used is handed to the optimizer thread with ``model.step`` (it
unscales with it); the factors set on the main thread are mirrored there in launch order.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..devices.threads import AnnotatedEvent, wait_until
from ..errors import RoundPipeRuntimeError, RoundPipeTypeError, RoundPipeValueError
from .stream import (
    launch_optim_kernel,
    on_optim_stream,
    raise_pending_error,
    synchronize_optim,
)

__all__ = ["GradScaler", "snapshot_scalers"]

_live: weakref.WeakSet = weakref.WeakSet()


def snapshot_scalers() -> Callable[[], None]:
    """Capture, for every live scaler, the scale the losses of the step being launched were
    multiplied by; the returned callable installs it as the unscale factor on the optimizer
    thread and starts the step's overflow bookkeeping (called by ``RoundPipeBase.step``).

    A scaler with an update not yet adopted (no ``scale()`` since ``update()``) keeps the
    optimizer thread's scale: by the time the step runs there, that update has set it.
    """
    snaps = [(s, s._step_scale()) for s in list(_live)]

    def restore() -> None:
        for s, v in snaps:
            if v is not None:
                s._optim_scale = v
            s._unscaled.clear()
            s._found_inf = False

    return restore


class GradScaler:
    """Gradient scaler API-compatible with ``torch.amp.GradScaler``, safe across threads.

    Use ``scale`` in ``loss_fn`` (or on the main thread), ``step`` inside the function given to
    ``model.step``, and ``update`` from the main thread after ``model.step``. Every value read
    on the main thread is a function of the calls made before it (see the module docstring):
    ``get_scale()`` right after ``update()`` is the scale the step's losses were multiplied by.

    Example:
        >>> scaler = GradScaler(init_scale=2.0 ** 8)
        >>> scaler.scale(torch.tensor(1.0))
        tensor(256.)
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if init_scale <= 0:
            raise RoundPipeValueError(f"init_scale must be positive, got {init_scale}")
        _check_growth_factor(growth_factor)
        _check_backoff_factor(backoff_factor)
        _check_growth_interval(growth_interval)
        self.enabled = enabled
        # optimizer thread's copies (set there in launch order)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        # main thread's view of them: what the caller set last, in program order
        self._factors = {
            "_growth_factor": float(growth_factor),
            "_backoff_factor": float(backoff_factor),
            "_growth_interval": growth_interval,
        }
        self._cond = threading.Condition()
        self.next_scale = torch.tensor(float(init_scale))  # the latest update's result
        self._current = float(init_scale)  # main: the scale of the step in progress
        self._launched = 0  # update() calls made (main thread)
        self._done = 0  # of which the optimizer thread finished (next_scale is the last's)
        self._adopted = 0  # updates _current already reflects
        self._optim_scale = float(init_scale)  # optimizer thread: scale to unscale with
        self._growth_tracker = 0
        self._found_inf = False
        self._unscaled: set[int] = set()
        self.scaler_updated = AnnotatedEvent("grad scaler updated", initially_set=True)
        _live.add(self)

    # -- main thread -------------------------------------------------------------------------
    def _adopt(self) -> None:
        """Make the latest ``update()``'s scale the current one, waiting for it if needed."""
        with self._cond:
            target = self._launched
            if self._adopted >= target:
                return
        wait_until(lambda: self._done >= target, "the GradScaler's pending update()", self._cond)
        with self._cond:
            if self._adopted < self._done:
                self._current = float(self.next_scale)
                self._adopted = self._done

    def _step_scale(self) -> float | None:
        """The current step's scale, or None when an update is pending (not adopted)."""
        with self._cond:
            return self._current if self._adopted >= self._launched else None

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply outputs by the step's scale (no-op when disabled).

        The first call after an ``update()`` waits until that update's scale is known.
        """
        if not self.enabled:
            return outputs
        if on_optim_stream():
            s = self._optim_scale
        else:
            self._adopt()
            with self._cond:
                s = self._current
        return _multiply(outputs, s)

    def update(self, new_scale: float | torch.Tensor | None = None, is_async: bool = True) -> None:
        """Update the scale after a step, from the main thread.

        The update is queued on the optimizer thread behind the step it follows: a skipped
        (overflowing) step multiplies the scale by ``backoff_factor``, ``growth_interval``
        unskipped steps in a row multiply it by ``growth_factor``; ``new_scale`` sets it
        instead. The next step's ``scale()`` uses the result (waiting for it if needed).

        ``is_async=True`` returns at once; ``get_scale()`` keeps reporting the finished step's
        scale until the next step scales a loss (``loss.item() / scaler.get_scale()`` is that
        step's true loss). ``is_async=False`` returns once the new scale is in place and makes
        it the current one (``get_scale()`` shows it, as ``torch.amp.GradScaler``'s does).

        Example:
            >>> scaler = GradScaler(init_scale=2.0 ** 8)
            >>> scaler.update(new_scale=2.0 ** 10)
            >>> scaler.get_scale(), scaler.get_scale(up_to_date=True)
            (256.0, 1024.0)
            >>> scaler.update(new_scale=2.0 ** 12, is_async=False)
            >>> scaler.get_scale()
            4096.0
        """
        if not isinstance(is_async, bool):
            raise RoundPipeTypeError(f"is_async must be a bool, got {type(is_async).__name__}")
        if not self.enabled:
            return
        if new_scale is not None and (
            isinstance(new_scale, bool) or not isinstance(new_scale, (float, int, torch.Tensor))
        ):
            raise RoundPipeTypeError(
                f"new_scale must be a float or tensor, got {type(new_scale).__name__}"
            )
        if on_optim_stream():
            raise RoundPipeRuntimeError(
                "GradScaler.update() must be called from the main thread, after model.step(...) "
                "returned, not inside the step function (which runs on the optimizer thread)"
            )
        if isinstance(new_scale, torch.Tensor):
            new_scale = float(new_scale)  # later in-place changes must not reach the scaler
        with self._cond:
            self._launched += 1
            self.scaler_updated.clear()
        launch_optim_kernel(self.update_kernel, new_scale)
        if not is_async:
            self._adopt()
            raise_pending_error()

    # -- optimizer thread --------------------------------------------------------------------
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale and check them for inf/NaN."""
        if not self.enabled:
            return
        if not on_optim_stream():
            launch_optim_kernel(self.unscale_, optimizer)
            synchronize_optim()
            return
        if id(optimizer) in self._unscaled:
            raise RoundPipeRuntimeError(
                "unscale_() has already been called on this optimizer since the last update()"
            )
        inv = 1.0 / self._optim_scale
        found = False
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if not bool(torch.isfinite(p.grad).all()):
                        found = True
                    p.grad.mul_(inv)
        self._found_inf = self._found_inf or found
        self._unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (if not done) and call ``optimizer.step`` unless gradients overflowed."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if not on_optim_stream():
            launch_optim_kernel(self.step, optimizer, *args, **kwargs)
            return None
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        if self._found_inf:
            return None
        return optimizer.step(*args, **kwargs)

    def update_kernel(self, new_scale: float | torch.Tensor | None) -> None:
        """Compute the next scale from this step's overflow state (optimizer thread)."""
        try:
            if new_scale is not None:
                scale = float(new_scale)
            elif self._found_inf:
                scale = self._optim_scale * self._backoff_factor
                self._growth_tracker = 0
            else:
                scale = self._optim_scale
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    scale *= self._growth_factor
                    self._growth_tracker = 0
            self._optim_scale = scale
            with self._cond:
                self.next_scale = torch.tensor(scale)
            self._unscaled.clear()
            self._found_inf = False
        finally:
            with self._cond:
                self._done += 1
                if self._done >= self._launched:
                    self.scaler_updated.set()
                self._cond.notify_all()

    # -- accessors -----------------------------------------------------------------------------
    def get_scale(self, up_to_date: bool = False) -> float:
        """The scale of the step in progress (1.0 when disabled).

        On the main thread: the scale this step's losses were (or will be) multiplied by;
        right after ``update()`` still the finished step's, so ``loss.item() / get_scale()`` is
        its true loss. ``up_to_date=True`` waits for a pending ``update()`` and returns (and
        makes current) its result, the scale the next step uses. On the optimizer thread: the
        scale it unscales the step's gradients with.

        Example:
            >>> scaler = GradScaler(init_scale=8.0, growth_interval=1)
            >>> loss = scaler.scale(torch.tensor(0.5))     # this step: scale 8
            >>> scaler.update()                             # clean step: the next one grows
            >>> loss.item() / scaler.get_scale()
            0.5
            >>> scaler.get_scale(up_to_date=True)
            16.0
        """
        if not self.enabled:
            return 1.0
        if on_optim_stream():
            return self._optim_scale
        if up_to_date:
            self._adopt()
            raise_pending_error()
        with self._cond:
            return self._current

    def _get_factor(self, name: str, up_to_date: bool) -> Any:
        if on_optim_stream():
            return getattr(self, name)
        if up_to_date:
            synchronize_optim()
        with self._cond:
            return self._factors[name]

    def _set_factor(self, name: str, value: Any) -> None:
        with self._cond:
            self._factors[name] = value
        launch_optim_kernel(setattr, self, name, value)  # in launch order with the steps

    def get_growth_factor(self, up_to_date: bool = False) -> float:
        """Scale growth factor: on the main thread the last one set (``up_to_date`` also waits
        for the optimizer thread to use it)."""
        return self._get_factor("_growth_factor", up_to_date)

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the scale growth factor (from the next ``update()`` on)."""
        _check_growth_factor(new_factor)
        self._set_factor("_growth_factor", float(new_factor))

    def get_backoff_factor(self, up_to_date: bool = False) -> float:
        """Scale backoff factor: on the main thread the last one set (``up_to_date`` also waits
        for the optimizer thread to use it)."""
        return self._get_factor("_backoff_factor", up_to_date)

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the scale backoff factor (from the next ``update()`` on)."""
        _check_backoff_factor(new_factor)
        self._set_factor("_backoff_factor", float(new_factor))

    def get_growth_interval(self, up_to_date: bool = False) -> int:
        """Growth interval: on the main thread the last one set (``up_to_date`` also waits for
        the optimizer thread to use it)."""
        return self._get_factor("_growth_interval", up_to_date)

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (from the next ``update()`` on)."""
        _check_growth_interval(new_interval)
        self._set_factor("_growth_interval", new_interval)

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self.enabled

    def state_dict(self) -> dict[str, Any]:
        """State in ``torch.amp.GradScaler``'s format, after every launched step and update
        (``"scale"`` is the one the next step uses)."""
        if not self.enabled:
            return {}
        synchronize_optim()
        return {
            "scale": self._optim_scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._growth_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state produced by :meth:`state_dict` or ``torch.amp.GradScaler``; its scale
        becomes the current one."""
        synchronize_optim()
        scale = float(state_dict["scale"])
        self._optim_scale = scale
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])
        with self._cond:
            self.next_scale = torch.tensor(scale)
            self._current = scale
            self._adopted = self._done = self._launched
            self._factors = {
                "_growth_factor": self._growth_factor,
                "_backoff_factor": self._backoff_factor,
                "_growth_interval": self._growth_interval,
            }


def _multiply(outputs: torch.Tensor | Iterable[torch.Tensor], s: float) -> Any:
    if isinstance(outputs, torch.Tensor):
        return outputs * s
    if isinstance(outputs, (list, tuple)):
        return type(outputs)(_multiply(o, s) for o in outputs)
    raise RoundPipeTypeError(
        f"outputs must be a tensor or a list/tuple of tensors, got {type(outputs).__name__}"
    )


def _check_growth_factor(value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 1.0:
        raise RoundPipeValueError(f"growth_factor must be a number > 1.0, got {value!r}")


def _check_backoff_factor(value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise RoundPipeValueError(f"backoff_factor must be a number in (0, 1), got {value!r}")


def _check_growth_interval(value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RoundPipeValueError(f"growth_interval must be a positive int, got {value!r}")
