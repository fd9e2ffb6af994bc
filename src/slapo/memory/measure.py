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
    >>> import torch, transformers
    >>> config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4)
    >>> model = transformers.GPT2LMHeadModel(config)
    >>> ids = torch.zeros(2, 16, dtype=torch.long)
    >>> batch = {"input_ids": ids, "labels": ids}
    >>> live = LiveSaved(skip={p.untyped_storage().data_ptr() for p in model.parameters()})
    >>> with live:
    ...     model(**batch).loss.backward()
    >>> live.peak > 0          # bytes
    True

:class:`EngineBytes` measures what a data-parallel engine holds besides the parameters,
gradients and optimizer state, read from the engine itself: DDP's gradient buckets, the
parameters FSDP2 holds gathered at once, DeepSpeed's fp32 partition. That is the estimate's
``engine``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
from torch import nn

from ..exceptions import SlapoError

__all__ = ["EngineBytes", "LiveSaved", "MeasureError"]


class MeasureError(SlapoError, RuntimeError):
    """A measurement used out of order (e.g. a :class:`LiveSaved` entered twice)."""


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
        >>> import slapo, torch, transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4)
        >>> sch = slapo.create_schedule(transformers.GPT2LMHeadModel(config))
        >>> sch["transformer.h.0"].cut_pipeline_stage()
        >>> ids = labels = torch.zeros(8, 128, dtype=torch.long)
        >>> # the pipeline engine runs one process per stage (torchrun): not run here
        >>> engine, _ = slapo.build(sch, target="pipeline", num_microbatches=4)  # doctest: +SKIP
        >>> live = LiveSaved(skip={p.untyped_storage().data_ptr() for p in engine.parameters()})  # doctest: +SKIP
        >>> with live:  # doctest: +SKIP
        ...     engine.step(ids, target=labels)      # 4 microbatches, 1F1B
        >>> live.peak / 2**20                         # MiB of the microbatches in flight  # doctest: +SKIP
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
            raise MeasureError("LiveSaved is already entered; exit it before entering it again")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(*exc)


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """The bytes of each distinct storage behind ``tensors`` (DTensors: this rank's part), by
    data pointer; empty (freed) storages left out."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = _local(t).untyped_storage()
        if st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return seen


def _modules(model: Any) -> list[nn.Module]:
    """Every module of ``model``: an ``nn.Module``, or the pipeline engine's stage modules."""
    if isinstance(model, nn.Module):
        return list(model.modules())
    stages = getattr(model, "stage_modules", None) or {}
    return [m for stage in stages.values() for m in stage.modules()]


class EngineBytes:
    """What a data-parallel engine holds besides the parameters, gradients and optimizer state,
    read from the engine: the ``engine`` bytes of :func:`slapo.estimate_layout`.

    * DDP (``model.reducer``): its gradient buckets (``buckets``), held for the whole run;
    * FSDP2 (``fully_shard`` modules in ``model``, or in a pipeline engine's stages): the most
      bytes of parameters held gathered at once (``gathered``), sampled by :meth:`sample` (pass
      it to :class:`LiveSaved` to sample at every saved tensor); :meth:`skip` names their
      storages, which a :class:`LiveSaved` must not count as saved for backward;
    * DeepSpeed ZeRO (``model.optimizer`` with fp32 partitions): its fp32 master copy of this
      rank's partition (``fp32_partition``).

    Any other model (an eager module, the pipeline engine with DDP-style replicas, whose
    gradient all-reduce keeps no buffer between steps) holds none: :meth:`parts` is empty.

    Example:
        >>> import slapo, torch, transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4)
        >>> sch = slapo.create_schedule(transformers.GPT2LMHeadModel(config))
        >>> ids = torch.zeros(8, 128, dtype=torch.long)
        >>> batch = {"input_ids": ids, "labels": ids}
        >>> # DDP on 2 ranks (torchrun): not run here
        >>> ddp_model, _ = slapo.build(sch, target="ddp")  # doctest: +SKIP
        >>> params = {p.untyped_storage().data_ptr() for p in ddp_model.parameters()}  # doctest: +SKIP
        >>> engine = EngineBytes(ddp_model)  # doctest: +SKIP
        >>> live = LiveSaved(skip=lambda: params | engine.skip(), sample=engine.sample)  # doctest: +SKIP
        >>> with live:  # doctest: +SKIP
        ...     slapo.train_step(ddp_model, batch)
        >>> engine.parts()  # doctest: +SKIP
        {'buckets': 1612800}
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.gathered_peak = 0
        self._ptrs: set[int] = set()
        self._fsdp: tuple[list[Any], list[Any]] | None = None

    @property
    def kind(self) -> str | None:
        """``"ddp"``, ``"fsdp"``, ``"deepspeed"``, or None (no engine buffers)."""
        if self._zero() is not None:
            return "deepspeed"
        if getattr(self.model, "reducer", None) is not None:
            return "ddp"
        return "fsdp" if self._fsdp_groups()[0] else None

    def _zero(self) -> Any:
        zero = getattr(self.model, "optimizer", None)
        return zero if hasattr(zero, "single_partition_of_fp32_groups") else None

    def _fsdp_groups(self) -> tuple[list[Any], list[Any]]:
        """FSDP2's parameter groups and their parameters (found once the modules exist)."""
        if self._fsdp is not None:
            return self._fsdp
        try:  # deferred: loads torch.distributed.tensor
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover - a torch without FSDP2
            return [], []
        groups = []
        for mod in _modules(self.model):
            if isinstance(mod, FSDPModule):
                group = mod._get_fsdp_state()._fsdp_param_group
                groups += [group] if group is not None else []
        params = [fp for g in groups for fp in g.fsdp_params]
        if groups:
            self._fsdp = (groups, params)
        return groups, params

    def gathered(self) -> tuple[int, set[int]]:
        """Bytes and data pointers of the parameters FSDP2 holds gathered right now: a unit's
        flat all-gather buffer (a prefetch waiting, or a copy-out not yet freed) and the
        unsharded parameters."""
        groups, params = self._fsdp_groups()
        if not groups:
            return 0, set()
        tensors = []
        for g in groups:
            for result in (
                g._all_gather_result,
                getattr(g.comm_ctx.all_gather_state, "all_gather_result", None),
            ):
                if result is not None:
                    tensors.append(result.all_gather_output)
        for fp in params:
            tensors += list(getattr(fp, "all_gather_outputs", None) or [])
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                tensors.append(unsharded)
        seen = _storages(tensors)
        return sum(seen.values()), set(seen)

    def sample(self) -> None:
        """Read the gathered parameters now: their bytes count toward :attr:`gathered_peak`,
        their storages are what :meth:`skip` returns until the next sample."""
        nbytes, self._ptrs = self.gathered()
        self.gathered_peak = max(self.gathered_peak, nbytes)

    def skip(self) -> set[int]:
        """The data pointers of the gathered parameters at the last :meth:`sample`."""
        return self._ptrs

    def parts(self) -> dict[str, int]:
        """The engine's bytes by name, read now (``gathered``: the most sampled so far)."""
        zero = self._zero()
        if zero is not None:
            return {"fp32_partition": sum(_storages(zero.single_partition_of_fp32_groups).values())}
        reducer = getattr(self.model, "reducer", None)
        if reducer is not None:
            buckets = reducer._get_zeros_like_grad_buckets()
            return {"buckets": sum(b.buffer().numel() * b.buffer().element_size() for b in buckets)}
        if self._fsdp_groups()[0]:
            return {"gathered": self.gathered_peak}
        return {}
