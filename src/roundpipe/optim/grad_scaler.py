"""Loss scaling for mixed precision that works with RoundPipe's asynchronous step.

The main thread scales losses while the optimizer thread may still be unscaling the
previous step's gradients. So the scale used for the losses of an iteration is captured
when ``model.step`` is launched and handed to the optimizer thread; updates computed there
are published back to the main thread for later iterations.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..devices.threads import AnnotatedEvent
from .stream import (
    launch_optim_kernel,
    on_optim_stream,
    raise_pending_error,
    synchronize_optim,
)

__all__ = ["GradScaler", "snapshot_scalers"]

_live: weakref.WeakSet = weakref.WeakSet()


def snapshot_scalers() -> Callable[[], None]:
    """Capture the main-thread scale of every live scaler; the returned callable installs
    it as the unscale factor on the optimizer thread (called by ``RoundPipeBase.step``)."""
    snaps = [(s, s._main_used_scale) for s in list(_live)]

    def restore() -> None:
        for s, v in snaps:
            s._optim_scale = v
            s._unscaled.clear()
            s._found_inf = False

    return restore


class GradScaler:
    """Gradient scaler API-compatible with ``torch.amp.GradScaler``, safe across threads.

    Use ``scale`` on the main thread, ``step`` inside the function given to
    ``model.step``, and ``update`` from the main thread after ``model.step``.

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
            raise ValueError(f"init_scale must be positive, got {init_scale}")
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1.0, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.enabled = enabled
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._lock = threading.Lock()
        self.next_scale = torch.tensor(float(init_scale))  # published to the main thread
        self._main_used_scale = float(init_scale)  # main thread: scale applied to outputs
        self._optim_scale = float(init_scale)  # optimizer thread: scale to unscale with
        self._growth_tracker = 0
        self._found_inf = False
        self._unscaled: set[int] = set()
        self.scaler_updated = AnnotatedEvent("grad scaler updated", initially_set=True)
        _live.add(self)

    # -- main thread -------------------------------------------------------------------------
    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply outputs by the current scale (no-op when disabled)."""
        if not self.enabled:
            return outputs
        if on_optim_stream():
            s = self._optim_scale
        else:
            with self._lock:
                s = float(self.next_scale)
            self._main_used_scale = s
        if isinstance(outputs, torch.Tensor):
            return outputs * s
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(
            f"outputs must be a tensor or a list/tuple of tensors, got {type(outputs).__name__}"
        )

    def update(self, new_scale: float | torch.Tensor | None = None, is_async: bool = True) -> None:
        """Update the scale after a step, from the main thread.

        The update is queued on the optimizer thread behind the step it follows: a skipped
        (overflowing) step multiplies the scale by ``backoff_factor``, ``growth_interval``
        unskipped steps in a row multiply it by ``growth_factor``; ``new_scale`` sets it
        instead. ``is_async=True`` returns at once (the next iteration may still scale with the
        previous value, as ``model.step``'s asynchronous mode does with parameters);
        ``is_async=False`` returns once the new scale is in place (``get_scale()`` shows it).

        Example:
            >>> scaler = GradScaler(init_scale=2.0 ** 8)
            >>> scaler.update(new_scale=2.0 ** 10, is_async=False)
            >>> scaler.get_scale()
            1024.0
        """
        if not isinstance(is_async, bool):
            raise TypeError(f"is_async must be a bool, got {type(is_async).__name__}")
        if not self.enabled:
            return
        if new_scale is not None and (
            isinstance(new_scale, bool) or not isinstance(new_scale, (float, int, torch.Tensor))
        ):
            raise TypeError(f"new_scale must be a float or tensor, got {type(new_scale).__name__}")
        self.scaler_updated.clear()
        launch_optim_kernel(self.update_kernel, new_scale)
        if not is_async and not on_optim_stream():  # on the optimizer thread it ran inline
            self.scaler_updated.wait_checked()
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
            raise RuntimeError(
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
            with self._lock:
                self.next_scale = torch.tensor(scale)
            self._unscaled.clear()
            self._found_inf = False
        finally:
            self.scaler_updated.set()

    # -- accessors -----------------------------------------------------------------------------
    def get_scale(self) -> float:
        """Current scale (the optimizer thread sees the one it unscales with)."""
        if not self.enabled:
            return 1.0
        if on_optim_stream():
            return self._optim_scale
        with self._lock:
            return float(self.next_scale)

    def _sync(self, up_to_date: bool) -> None:
        if up_to_date and not on_optim_stream():
            synchronize_optim()

    def get_growth_factor(self, up_to_date: bool = False) -> float:
        """Scale growth factor (``up_to_date`` waits for the optimizer thread)."""
        self._sync(up_to_date)
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the scale growth factor."""
        launch_optim_kernel(setattr, self, "_growth_factor", float(new_factor))

    def get_backoff_factor(self, up_to_date: bool = False) -> float:
        """Scale backoff factor (``up_to_date`` waits for the optimizer thread)."""
        self._sync(up_to_date)
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the scale backoff factor."""
        launch_optim_kernel(setattr, self, "_backoff_factor", float(new_factor))

    def get_growth_interval(self, up_to_date: bool = False) -> int:
        """Growth interval (``up_to_date`` waits for the optimizer thread)."""
        self._sync(up_to_date)
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval."""
        launch_optim_kernel(setattr, self, "_growth_interval", int(new_interval))

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self.enabled

    def state_dict(self) -> dict[str, Any]:
        """State in ``torch.amp.GradScaler``'s format."""
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
        """Load a state produced by :meth:`state_dict` or ``torch.amp.GradScaler``."""
        synchronize_optim()
        self._optim_scale = float(state_dict["scale"])
        self._main_used_scale = self._optim_scale
        self.next_scale = torch.tensor(self._optim_scale)
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])
