"""``LiveSaved``: the most bytes saved for backward alive at once, measured on a real run.

Every tensor autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``) is
counted when it is packed, one count per storage (the storages to skip, the parameters, are not
counted), and uncounted when its storage is freed (``weakref.finalize`` on the storage). The
figure is the most bytes counted at once, what the estimate's ``activations`` predicts:

* in one process, all that a step saves is alive at the end of its forward: the live peak is the
  step's saved bytes;
* a pipeline schedule frees a microbatch's saved tensors as its backward runs: 1F1B keeps at
  most ``pp - stage`` microbatches in flight, GPipe all of them; the live peak counts those,
  not every microbatch of the step;
* a selective checkpoint keeps the outputs its policy saves in a cache of its own;
  ``slapo.checkpoint`` hands them to the pack hook active around it, so they count too (a full
  checkpoint's inner tensors are recomputed in backward and never counted).

Example:
    >>> live = LiveSaved(skip={p.untyped_storage().data_ptr() for p in model.parameters()})
    >>> with live:
    ...     model(**batch).loss.backward()
    >>> live.peak > 0          # bytes
    True
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection
from typing import Any

import torch

__all__ = ["LiveSaved"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2 and tensor-parallel tensors), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class LiveSaved:
    """The most bytes saved for backward alive at once while it is entered (see the module doc).

    Args:
        skip: the data pointers of storages not to count (the parameters: they are held anyway),
            or a function returning them at each pack (parameters gathered on the fly, FSDP's).
        sample: called at every pack and unpack, for a caller tracking other bytes over time.

    Attributes:
        now: bytes counted and not freed yet.
        peak: the most bytes counted at once since it was made (or since :meth:`reset_peak`).

    Entered more than once (e.g. once per step), the counts carry over: a storage saved in one
    entry and freed in a later one stays counted until then.

    Example:
        >>> live = LiveSaved(skip={p.untyped_storage().data_ptr() for p in engine.parameters()})
        >>> with live:
        ...     engine.step(ids, target=labels)      # 4 microbatches, 1F1B
        >>> live.peak / 2**20                         # MiB of the microbatches in flight
        3.1
    """

    def __init__(
        self,
        skip: Collection[int] | Callable[[], Collection[int]] = (),
        sample: Callable[[], None] | None = None,
    ) -> None:
        self.skip = skip
        self.sample = sample
        self.alive: dict[int, int] = {}  # id(storage) -> bytes
        self.now = self.peak = 0
        self._hooks: Any = None

    def _freed(self, key: int) -> None:
        self.now -= self.alive.pop(key, 0)

    def _skipped(self) -> Collection[int]:
        return self.skip() if callable(self.skip) else self.skip

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Count ``t``'s storage (once, until it is freed); returns ``t`` as the pack hook does."""
        if self.sample is not None:
            self.sample()
        local = _local(t)
        if local.device.type == "meta":
            return t  # no memory behind it
        st = local.untyped_storage()
        key, nbytes = id(st), st.nbytes()
        if key in self.alive or not nbytes or st.data_ptr() in self._skipped():
            return t
        self.alive[key] = nbytes
        # the storage's Python object lives as long as the storage itself: its id stays unique
        weakref.finalize(st, self._freed, key)
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        return t

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """The unpack hook: ``t`` itself (the count changes only when a storage is freed)."""
        if self.sample is not None:
            self.sample()
        return t

    def reset_peak(self) -> None:
        """Start the peak over from the bytes alive now."""
        self.peak = self.now

    @property
    def counting(self) -> bool:
        """Whether the hooks are installed (between ``__enter__`` and ``__exit__``)."""
        return self._hooks is not None

    def __enter__(self) -> LiveSaved:
        if self._hooks is not None:
            raise RuntimeError("LiveSaved is already entered")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(*exc)
