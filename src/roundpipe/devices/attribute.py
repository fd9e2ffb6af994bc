"""Per-layer and per-parameter bookkeeping that orders device, main and optimizer threads.

The asynchronous step keeps a separate optimizer copy of every trainable parameter (a frozen
one has none: it is uploaded, never downloaded nor copied back). Per layer:

* the optimizer takes the layer's gradients when step ``k`` starts (``grads_taken = k``);
  a later backward must wait for that before writing new gradients;
* updated values are copied back into the model parameters only once step ``k`` finished
  AND the next backward has uploaded the layer (or a flush asked for it), so one forward +
  backward uses the same, one-step-stale values (``copied = k``). Whichever of the
  optimizer thread, the device worker or the main thread completes the condition does the
  copy, so the optimizer thread never blocks waiting for a future backward;
* a forward / backward upload waits until at most one step is pending (``copied >= launched - 1``).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from ..errors import RoundPipeRuntimeError
from .threads import RunState, wait_until

__all__ = ["LayerAttribute", "ParamAttribute"]


class ParamAttribute:
    """Optimizer copy and gradient lock of one model parameter (possibly shared by layers).

    Only a parameter that requires grad when it is wrapped gets an optimizer copy (``optim``);
    a frozen one (e.g. the base weights of a LoRA model) has ``optim = None``: it is uploaded
    for compute but never gets a copy, optimizer state, a gradient download or a copy-back.
    """

    def __init__(self) -> None:
        self.optim: nn.Parameter | None = None
        self.grad_lock = threading.Lock()
        self.layer_ids: set[int] = set()

    @classmethod
    def has(cls, t: torch.Tensor) -> bool:
        """Whether ``t`` carries a ParamAttribute."""
        return isinstance(getattr(t, "_roundpipe_attr", None), ParamAttribute)

    @classmethod
    def get(cls, t: torch.Tensor) -> ParamAttribute:
        """The ParamAttribute attached to ``t``."""
        attr = getattr(t, "_roundpipe_attr", None)
        if not isinstance(attr, ParamAttribute):
            raise KeyError("tensor has no RoundPipe ParamAttribute")
        return attr

    @classmethod
    def set(
        cls, t: nn.Parameter, layer_id: int | None, optim_dtype: torch.dtype | None = None
    ) -> ParamAttribute:
        """Attach (or extend) a ParamAttribute; on first use, a trainable ``t`` gets its
        optimizer copy (a frozen one none: it is never stepped).

        Example:
            >>> frozen = nn.Parameter(torch.ones(2), requires_grad=False)
            >>> ParamAttribute.set(frozen, 0).optim is None
            True
            >>> ParamAttribute.set(nn.Parameter(torch.ones(2)), 0).optim.shape
            torch.Size([2])
        """
        if cls.has(t):
            attr = cls.get(t)
        else:
            attr = cls()
            t._roundpipe_attr = attr  # type: ignore[attr-defined]
            if t.requires_grad:
                data = t.detach().to(dtype=optim_dtype or t.dtype, copy=True)
                attr.optim = nn.Parameter(data)
        if layer_id is not None:
            attr.layer_ids.add(layer_id)
        return attr


class LayerAttribute:
    """Synchronization state of one layer (or one group of parameters)."""

    def __init__(self, name: str, params: list[nn.Parameter]) -> None:
        self.name = name
        self.params = params
        self.cond = threading.Condition()
        self.param_lock = threading.Lock()  # host param values: upload vs copy-back
        self.launched = 0
        self.copied = 0
        self.grads_taken = 0
        self.bwd_count = 0
        self.flush_upto = 0
        self._pending_copy: tuple[int, int] | None = None
        self._copy_lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"LayerAttribute({self.name}, launched={self.launched}, copied={self.copied}, "
            f"grads_taken={self.grads_taken})"
        )

    # -- device side ---------------------------------------------------------------------
    def forward_fence(self, state: RunState | None = None) -> None:
        """Wait until the parameters are at most one step stale."""
        wait_until(
            lambda: self.copied >= self.launched - 1, f"parameters of {self.name}", self.cond, state
        )

    def backward_fence(self, state: RunState | None = None) -> None:
        """Wait as :meth:`forward_fence`, and for the optimizer to take the previous grads."""
        wait_until(
            lambda: self.copied >= self.launched - 1 and self.grads_taken >= self.launched,
            f"gradients of {self.name}",
            self.cond,
            state,
        )

    def forward_backward_fence(self, state: RunState | None = None) -> None:
        """Fence for the fused forward-backward stage."""
        self.backward_fence(state)

    def backward_uploaded(self) -> None:
        """A backward pass has uploaded this layer: a pending copy-back may proceed."""
        with self.cond:
            self.bwd_count += 1
            self.cond.notify_all()
        self._maybe_copy()

    # -- main thread ---------------------------------------------------------------------
    def launch_step(self, flush_now: bool) -> tuple[int, int]:
        """Register a new step; returns (step number, backward count at launch)."""
        with self.cond:
            self.flush_upto = max(self.flush_upto, self.launched)  # older steps: copy now
            self.launched += 1
            if flush_now:
                self.flush_upto = self.launched
            self.cond.notify_all()
            result = self.launched, self.bwd_count
        self._maybe_copy()
        return result

    def flush(self) -> None:
        """Let every pending copy-back run now."""
        with self.cond:
            self.flush_upto = self.launched
            self.cond.notify_all()
        self._maybe_copy()

    def wait_copied(self) -> None:
        """Wait until every launched step was copied back."""
        wait_until(lambda: self.copied >= self.launched, f"copy-back of {self.name}", self.cond)

    # -- optimizer thread ----------------------------------------------------------------
    def take_grads(self, step: int) -> None:
        """Move accumulated model gradients into the optimizer copies (adding to them)."""
        try:
            for p in self.params:
                attr = ParamAttribute.get(p)
                with attr.grad_lock:
                    g = p.grad
                    p.grad = None
                if g is None:
                    continue
                if attr.optim is None:
                    raise RoundPipeRuntimeError(
                        f"{self.name}: a parameter of shape {tuple(p.shape)} received a gradient "
                        "but has no optimizer copy: it was frozen (requires_grad=False) when the "
                        "model was wrapped. Set requires_grad before wrapping the model with "
                        "RoundPipe (then build the optimizer over model.optim_parameters())"
                    )
                if attr.optim.grad is None:
                    # the model no longer references g: hand it over without a copy
                    attr.optim.grad = g.to(attr.optim.dtype)
                else:
                    attr.optim.grad.add_(g)
        finally:
            with self.cond:
                self.grads_taken = max(self.grads_taken, step)
                self.cond.notify_all()

    def finish_step(self, step: int, bwd_at_launch: int) -> None:
        """Step ``step`` finished: copy back now if allowed, else leave it pending."""
        with self.cond:
            self._pending_copy = (step, bwd_at_launch)
        self._maybe_copy()

    # -- whoever completes the condition ---------------------------------------------------
    def _maybe_copy(self) -> None:
        with self.cond:
            pending = self._pending_copy
            if pending is None:
                return
            step, bwd_at_launch = pending
            if not (self.bwd_count > bwd_at_launch or self.flush_upto >= step):
                return
        with self._copy_lock:
            with self.cond:
                pending, self._pending_copy = self._pending_copy, None
            if pending is None:  # another thread copied meanwhile
                return
            try:
                with self.param_lock, torch.no_grad():
                    for p in self.params:
                        optim = ParamAttribute.get(p).optim
                        if optim is not None:  # frozen parameters never change
                            p.copy_(optim)
            finally:
                with self.cond:
                    self.copied = max(self.copied, pending[0])
                    self.cond.notify_all()


def unique_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters of ``module`` without duplicates, in registration order."""
    seen: set[int] = set()
    out = []
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def make_layer_attribute(
    name: str, module: nn.Module, layer_id: int | None, optim_dtype: torch.dtype | None
) -> LayerAttribute:
    """Create the LayerAttribute of ``module`` and the ParamAttributes of its parameters."""
    params = unique_params(module)
    for p in params:
        ParamAttribute.set(p, layer_id, optim_dtype)
    return LayerAttribute(name, params)
