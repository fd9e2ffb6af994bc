"""The measurement the estimator is checked against, on a real training step.

measured = parameter + buffer + gradient + optimizer-state bytes after a real step, plus the bytes
saved for backward in its forward: counted with ``torch.autograd.graph.saved_tensors_hooks``, one
count per storage (parameters excluded). A selective checkpoint keeps the outputs its policy saves
in a cache of its own, not through those hooks: they are read from torch's caching dispatch modes
(``torch.utils.checkpoint._CachingTorchDispatchMode``, observed as they are created). Independent
of ``slapo.memory``: real tensors, real allocation, storages told apart by data pointers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._pytree import tree_leaves


@dataclass
class Measured:
    params: int
    buffers: int
    grads: int
    optimizer_state: int
    saved: int

    @property
    def peak(self) -> int:
        return self.params + self.buffers + self.grads + self.optimizer_state + self.saved


def _bytes(tensors: Any) -> int:
    storages = {}
    for t in tensors:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


@contextlib.contextmanager
def selective_checkpoint_caches() -> Iterator[list[Any]]:
    """Every selective-checkpoint caching mode created meanwhile (its ``storage`` holds the
    tensors the policy saves)."""
    modes: list[Any] = []
    cls = torch_checkpoint._CachingTorchDispatchMode
    original = cls.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        modes.append(self)

    cls.__init__ = init
    try:
        yield modes
    finally:
        cls.__init__ = original


def _cached_tensors(modes: list[Any]) -> Iterator[torch.Tensor]:
    for mode in modes:
        for entry in tree_leaves(mode.storage, is_leaf=lambda x: hasattr(x, "get_val")):
            value = getattr(entry, "val", None)
            # a compiled region traces its caches with fake tensors: no memory of the real step
            if isinstance(value, torch.Tensor) and not is_fake(value):
                yield value


def measure_step(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> Measured:
    """Run one real training step of ``model`` on ``batch`` and count its bytes."""
    make_optimizer = make_optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    alive = []  # a counted storage stays alive until the end, so its address is never reused

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            saved[st.data_ptr()] = st.nbytes()
            alive.append(st)
        return t

    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with selective_checkpoint_caches() as modes:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**batch).loss
        for t in _cached_tensors(modes):
            pack(t)
    loss.backward()
    grads = _bytes(p.grad for p in model.parameters() if p.grad is not None)
    opt.step()
    state = _bytes(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return Measured(
        params=_bytes(model.parameters()),
        buffers=_bytes(model.buffers()),
        grads=grads,
        optimizer_state=state,
        saved=sum(saved.values()),
    )


def batch(vocab: int, size: int = 4, seq: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (size, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def measure_live_peak(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> int:
    """The most bytes alive at once in a real steady-state step (the second; the first creates
    the optimizer state): parameters, buffers and optimizer state, plus every storage the step's
    ops create while it lives (a dispatch mode sees each op's outputs; a finalizer each free).
    The output is held through backward, as ``slapo.train_step`` holds it."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    make_optimizer = make_optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])

    def step() -> None:
        out = model(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out

    step()
    base = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [
        *model.parameters(), *model.buffers(),
        *(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
    ]}  # fmt: skip
    live: dict[int, int] = {}
    now = [0, 0]  # bytes alive, most alive

    def freed(key: int) -> None:
        now[0] -= live.pop(key)

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor):
                    continue
                st = t.untyped_storage()
                if st.data_ptr() in base or id(st) in live:
                    continue
                live[id(st)] = st.nbytes()
                weakref.finalize(st, freed, id(st))
                now[0] += st.nbytes()
                now[1] = max(now[1], now[0])
            return out

    for p in batch.values():
        base.setdefault(p.untyped_storage().data_ptr(), 0)
    with Track():
        step()
    return sum(base.values()) + now[1]
