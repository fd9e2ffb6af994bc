"""Peak tensor memory of a training run, comparable between runs in one process."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PeakMemory"]


class PeakMemory:
    """Peak tensor memory of a training run, comparable between runs in one process.

    On CUDA, the allocator's peak. On CPU (where the process's resident size keeps what an earlier
    run freed), the model state (parameters, gradients, optimizer state) plus the most bytes saved
    for backward in one step, counted with ``saved_tensors_hooks``; a checkpointed block's inner
    tensors are recomputed in backward and so not counted.

    Example:
        >>> with PeakMemory(model, optimizer) as mem:
        ...     model(**batch).loss.backward(); mem.next_step()
        >>> mem.peak_mb > 0
        True
    """

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer
        self.peak_mb = self.activation_mb = 0.0
        self._step_bytes = 0
        self._seen: set[int] = set()
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        t = _local(t)
        ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else 0
        if ptr not in self._seen and ptr not in self._params:
            self._seen.add(ptr)
            self._step_bytes += t.untyped_storage().nbytes()
        return t

    def next_step(self) -> None:
        """Close one step: keep its saved bytes if they are the most so far."""
        self.activation_mb = max(self.activation_mb, self._step_bytes / 2**20)
        self._step_bytes = 0
        self._seen.clear()

    def __enter__(self) -> PeakMemory:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated() / 2**20
            return self
        self._params = {_local(p).untyped_storage().data_ptr() for p in self.model.parameters()}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if torch.cuda.is_available():
            self.peak_mb = torch.cuda.max_memory_allocated() / 2**20 - self._base
            return
        self._hooks.__exit__(*exc)
        self.next_step()
        state = sum(2 * _local(p).numel() * p.element_size() for p in self.model.parameters())
        for per_param in getattr(self.optimizer, "state", {}).values():
            state += sum(_local(v).numel() * v.element_size() for v in per_param.values()
                         if isinstance(v, torch.Tensor))  # fmt: skip
        self.peak_mb = state / 2**20 + self.activation_mb


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2 and tensor-parallel parameters), else ``t``."""
    # deferred: torch.distributed.tensor takes 0.65 s to import; `import slapo` does not need it
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
