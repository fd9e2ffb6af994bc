"""``slapo.estimate_memory``: the peak memory of one training step, from a fake run.

The schedule's module runs one training step (forward, backward, optimizer step) with fake
parameters (``torch._subclasses.FakeTensorMode``): every parameter, buffer, activation, gradient
and optimizer state has its real shape, dtype and device, and no data, so a model of any size is
estimated in a second without allocating it. The step is the schedule's own, primitives included:
a checkpointed block keeps only its inputs, a selective-checkpoint policy keeps what it saves, a
``replace``d module saves what its forward saves, and a tensor-parallel rank holds its shards
(with a real process group, each rank estimates its own share; the collectives run fake too).

============  ===================================================================================
params        every parameter's storage (one per tied group; a tensor-parallel rank: its shards)
buffers       every buffer's storage
grads         the gradients the backward leaves
optimizer     the state the optimizer given creates in a step (AdamW: ``exp_avg`` and
_state        ``exp_avg_sq`` per trainable parameter, and a step count; SGD with momentum: one
              buffer; without: none). The optimizer itself runs its step on the fake tensors.
activations   the bytes kept from the forward for the backward: every tensor autograd saves
              (``saved_tensors_hooks``, one count per storage, parameters excluded) and every
              other tensor the forward created that is still alive when it returns (e.g. a
              selective checkpoint's cache), the outputs excepted
peak          ``params + buffers + grads + optimizer_state + activations``: all of it at once, as
              at the end of a backward with ``zero_grad(set_to_none=False)``; the figure the
              tests check against measurement (bytes saved for backward of a real step, plus
              parameter, gradient and optimizer bytes)
live_peak     the most bytes alive at once in a steady-state step (the optimizer state already
              there), temporaries, blocks recomputed in backward and the output held through it
              (as ``slapo.train_step`` holds it) included: what a device allocator's peak
              approaches (it also rounds and caches blocks). A checkpointed model's exceeds its
              ``peak``: ``required`` is the larger of the two, what a memory budget must hold
============  ===================================================================================

Mixed precision (``precision="bf16"`` or ``"fp16"``) runs the fake step the way the engine runs
it. By default as the eager, DDP and pipeline targets do: the parameters stay float32 (the master
weights; their gradients and the optimizer state are float32 too) and the forward runs under
``torch.autocast``, so the activations are in the compute dtype and include the compute-dtype
copies of the weights that autocast casts and the backward needs (``weight_copies``, a part of
``activations``). With ``cast_params=True`` the module computes with parameters in the compute
dtype (FSDP2's gathered parameters, DeepSpeed's and RoundPipe's cast module): their gradients
are in that dtype, and the optimizer steps float32 master copies of them (an ``engine`` part).

On CUDA the caching allocator reserves more than the tensors' bytes: :attr:`MemoryEstimate.reserved`
rounds each tensor to the allocator's block sizes and adds a fragmentation allowance
(:func:`slapo.memory.units.reserved_bytes`). Fake tensors on ``cuda`` need a CUDA build of torch:
on one without, an estimate for ``device="cuda"`` runs its fake step on the CPU (``stand_in``)
and autocasts with the CPU's op lists, which keep a few ops (softmax, layer norm) in the compute
dtype where CUDA's autocast computes them in float32.

The batch stays real (it is small): control flow that reads it (a model skipping its attention
mask when nothing is padded) is then exactly the real run's. Compiled code (``torch.compile``, the
``compile`` primitive, the fused kernels) runs uncompiled in the fake run (compiled kernels cannot
run on fake tensors), so its estimate is the eager code's: the compiler's own choice of what to
save for backward may keep somewhat less (a compiled, selectively checkpointed llama block: 8%
fewer activation bytes, its measured peak 4% below the estimate).

Example:
    >>> import torch, transformers
    >>> import slapo
    >>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
    ...     vocab_size=64, use_cache=False)
    >>> model = transformers.LlamaForCausalLM(config)
    >>> ids = torch.randint(0, config.vocab_size, (2, 32))
    >>> sch = slapo.create_schedule(model)
    >>> sch["model.layers.0"].checkpoint()
    >>> est = slapo.estimate_memory(sch, {"input_ids": ids, "labels": ids})
    >>> print(est)                      # a table: parameters, gradients, ..., peak, by module
    memory estimate: LlamaForCausalLM on cpu, optimizer AdamW
      parameters ...
      activations by block:
        model.embed_tokens ...
    >>> est.fits("8GiB")                # the larger of peak and live_peak fits 8 GiB
    True
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..exceptions import SlapoError
from ..precision import Precision, PrecisionError
from .stand_ins import fake_step_stand_ins
from .units import allocator_rounding, format_bytes, parse_bytes, reserved_bytes

__all__ = [
    "MASTER_WEIGHTS",
    "EstimateError",
    "MemoryEstimate",
    "estimate_memory",
    "fake_layout_groups",
    "fake_process_group",
]

#: The ``engine_parts`` name of the float32 master copies an engine that casts its module keeps.
MASTER_WEIGHTS = "fp32 master weights"


class EstimateError(SlapoError, RuntimeError):
    """The memory estimate cannot be made: bad arguments, or the fake training step failed."""


@dataclass(frozen=True)
class MemoryEstimate:
    """The predicted memory of one training step, in bytes (see :mod:`slapo.memory.estimate`).

    Attributes:
        params, buffers, grads, optimizer_state, activations: the parts; :attr:`peak` is their sum.
        live_peak: the most bytes alive at once in a steady-state step, temporaries included.
        by_module: activation bytes by the innermost module running when they were saved or
            created (``""`` is the root), in forward order.
        model, optimizer: class names, for the report.
        device: the device type the model's parameters train on ("cpu", "cuda", ...).
        rank, world_size: this process in its process group (None, 1 without one).
        engine: bytes a parallel engine holds besides the parts (DDP's gradient buckets,
            FSDP's gathered parameters, DeepSpeed's fp32 partition), by name in ``engine_parts``
            (:func:`slapo.estimate_layout`).
        device_resident: RoundPipe only: the most bytes one device holds at once.
        target, layout, stage: the build target, ``{"dp", "pp", "tp"}`` sizes (and ``cp``,
            ``ep`` where over 1) and the pipeline stage (None without one) this rank's estimate
            is of.
        precision: the precision the step trains in (``"fp32"``, ``"bf16"``, ``"fp16"``).
        weight_copies: of ``activations``, the compute-dtype copies of weights that autocast
            made and the backward keeps (0 without autocast).
        rounding: per part, the bytes CUDA's caching allocator adds to its tensors by rounding
            them to its block sizes (:func:`slapo.memory.units.allocator_rounding`).
        forward_peak, backward_peak: the most bytes alive at once in the forward, and in the
            backward (the optimizer state already there): ``live_peak`` is the larger of them
            or the optimizer step's own peak, which a layout's engine changes
            (:func:`slapo.memory.apply_layout` models it). ``None``: unknown, taken as
            ``live_peak``.
        grads_at_peak: of ``grads``, the bytes alive at ``backward_peak`` (none when it is at
            the loss, before any gradient exists); ``None``: unknown, taken as all.
        backward_other_peak, grads_at_other_peak: the most bytes alive in the backward but its
            gradients (the optimizer state there), and the gradients alive then: where a rank
            holding a share of the gradients peaks (FSDP), even where the whole model's backward
            peaks later, at its end with every gradient.
        peak_temporaries: ``{"forward": {module: bytes}, "backward": {...}}``: what else was
            alive at each peak (neither activations nor gradients: the loss's logits, autocast's
            weight copies), by the module that made it; a pipeline stage holds its own modules'.
        stand_in: the device type the fake step ran on in place of ``device`` (the CPU for a
            ``cuda`` estimate on a torch without CUDA), else None.

    Example:
        >>> import torch, slapo
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
        >>> batch = (torch.ones(8, 64), torch.zeros(8, 64))     # (inputs, target)
        >>> est = slapo.estimate_memory(model, batch, loss_fn=torch.nn.functional.mse_loss)
        >>> est.peak == est.params + est.buffers + est.grads + est.optimizer_state + est.activations
        True
        >>> est.fits("8GiB")
        True
    """

    params: int
    buffers: int
    grads: int
    optimizer_state: int
    activations: int
    live_peak: int
    by_module: dict[str, int] = field(default_factory=dict)
    model: str = ""
    optimizer: str = ""
    device: str = "cpu"
    rank: int | None = None
    world_size: int = 1
    engine: int = 0
    engine_parts: dict[str, int] = field(default_factory=dict)
    device_resident: int | None = None
    target: str = "eager"
    layout: dict[str, int] = field(default_factory=lambda: {"dp": 1, "pp": 1, "tp": 1})
    stage: int | None = None
    precision: str = "fp32"
    weight_copies: int = 0
    rounding: dict[str, int] = field(default_factory=dict)
    stand_in: str | None = None
    forward_peak: int | None = None
    backward_peak: int | None = None
    grads_at_peak: int | None = None
    backward_other_peak: int | None = None
    grads_at_other_peak: int | None = None
    peak_temporaries: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        """Every part at once: parameters, buffers, gradients, optimizer state, activations and
        the engine's buffers."""
        return (
            self.params + self.buffers + self.grads + self.optimizer_state + self.activations
            + self.engine
        )  # fmt: skip

    @property
    def required(self) -> int:
        """What a memory budget must hold: the larger of :attr:`peak` and :attr:`live_peak`."""
        return max(self.peak, self.live_peak)

    @property
    def reserved(self) -> int:
        """What CUDA's caching allocator reserves for :attr:`required`: each tensor rounded to
        the allocator's block sizes (512 B; a tensor over 1 MiB to 2 MiB; :attr:`rounding`),
        plus :data:`~slapo.memory.units.RESERVED_ALLOWANCE` (5%) for fragmentation, in whole
        2 MiB segments. The temporaries of ``live_peak`` are counted unrounded.

        Example:
            >>> import torch, slapo
            >>> model, mse = torch.nn.Linear(64, 64), torch.nn.functional.mse_loss
            >>> est = slapo.estimate_memory(model, (torch.ones(8, 64),) * 2, loss_fn=mse)
            >>> est.reserved >= est.required, est.reserved      # one 2 MiB segment
            (True, 2097152)
        """
        return reserved_bytes(self.required, sum(self.rounding.values()))

    def fits(self, budget: int | float | str) -> bool:
        """Whether :attr:`required` fits ``budget`` (bytes, or text such as ``"8GiB"``)."""
        return self.required <= parse_bytes(budget)

    def as_dict(self) -> dict[str, Any]:
        """Every field, ``peak``, ``required`` and ``reserved`` included, as JSON-ready values."""
        return {
            **asdict(self), "peak": self.peak, "required": self.required,
            "reserved": self.reserved,
        }  # fmt: skip

    def by_block(self) -> dict[str, int]:
        """:attr:`by_module` summed per block: a path is cut after its first index
        (``model.layers.3.mlp.up_proj`` -> ``model.layers.3``), other paths after two names.

        Example:
            >>> import torch, slapo
            >>> inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
            >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), inner)
            >>> batch, mse = (torch.ones(2, 8), torch.zeros(2, 8)), torch.nn.functional.mse_loss
            >>> est = slapo.estimate_memory(model, batch, loss_fn=mse)
            >>> list(est.by_module), list(est.by_block())      # "1.0" and "1.1" in block "1"
            (['0', '1.0', '1.1', ''], ['0', '1', '(root)'])
        """
        out: dict[str, int] = {}
        for path, nbytes in self.by_module.items():
            parts = path.split(".") if path else []
            cut = next((i + 1 for i, p in enumerate(parts) if p.isdigit()), min(len(parts), 2))
            key = ".".join(parts[:cut]) or "(root)"
            out[key] = out.get(key, 0) + nbytes
        return out

    def table(self, top: int = 12) -> str:
        """A readable report: the parts, the peaks, and the ``top`` blocks by activations."""
        where = "" if self.rank is None else f", rank {self.rank} of {self.world_size}"
        if self.target != "eager" or any(self.layout.get(k, 1) > 1 for k in ("pp", "cp", "ep")):
            sizes = " x ".join(f"{k}{v}" for k, v in self.layout.items())
            where += f", target {self.target} {sizes}"
            where += "" if self.stage is None else f" (stage {self.stage})"
        rows = [
            ("parameters", self.params), ("buffers", self.buffers), ("gradients", self.grads),
            ("optimizer state", self.optimizer_state), ("activations", self.activations),
            *self.engine_parts.items(),
        ]  # fmt: skip
        width = 28
        lines = [
            f"memory estimate: {self.model} on {self.device}{self._placement_words()}, "
            f"optimizer {self.optimizer}{where}"
        ]
        lines += [f"  {name:<{width}}{format_bytes(n):>12}" for name, n in rows]
        if self.weight_copies:
            copies = format_bytes(self.weight_copies)
            lines.insert(6, f"    {'of which weight copies':<{width - 2}}{copies:>12}")
        lines.append("  " + "-" * (width + 12))
        lines.append(f"  {'peak (all of the above)':<{width}}{format_bytes(self.peak):>12}")
        lines.append(
            f"  {'live peak (with temporaries)':<{width}}{format_bytes(self.live_peak):>12}"
        )
        lines.append(
            f"  {'required (larger of the two)':<{width}}{format_bytes(self.required):>12}"
        )
        if self.device == "cuda":
            reserved = format_bytes(self.reserved)
            lines.append(f"  {'reserved (CUDA allocator)':<{width}}{reserved:>12}")
        if self.device_resident is not None:
            resident = format_bytes(self.device_resident)
            lines.append(f"  {'resident on one device':<{width}}{resident:>12}")
        blocks = self.by_block()
        if blocks:
            lines.append("  activations by block:")
            ranked = sorted(blocks.items(), key=lambda kv: -kv[1])[:top]
            keep = {name for name, _ in ranked}
            for name, nbytes in blocks.items():  # forward order
                if name in keep:
                    lines.append(f"    {name:<{width - 2}}{format_bytes(nbytes):>12}")
            if len(blocks) > len(keep):
                rest = sum(n for name, n in blocks.items() if name not in keep)
                others = f"({len(blocks) - len(keep)} more)"
                lines.append(f"    {others:<{width - 2}}{format_bytes(rest):>12}")
        return "\n".join(lines)

    def _placement_words(self) -> str:
        words = "" if self.precision == "fp32" else f", {self.precision} (fp32 master weights)"
        if self.stand_in is not None:
            words += f" (fake step on {self.stand_in}: no CUDA in this torch)"
        return words

    def __str__(self) -> str:
        return self.table()


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[Any]:
    """Stand in for ``world_size`` ranks in this one process, as rank ``rank``: a process group
    whose collectives communicate nothing (torch's "fake" backend). A tensor-parallel schedule
    built over it shards as on a real rank, so :func:`estimate_memory` gives that rank's share.

    Example:
        >>> import torch, transformers
        >>> import slapo
        >>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        ...     vocab_size=64, use_cache=False)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> ids = torch.randint(0, config.vocab_size, (2, 32))
        >>> batch = {"input_ids": ids, "labels": ids}
        >>> with fake_process_group(2) as group:
        ...     sch = slapo.model_schedule.apply_schedule(model, group=group)
        ...     est = slapo.estimate_memory(sch, batch)     # one rank of 2
        >>> est.params < slapo.estimate_memory(transformers.LlamaForCausalLM(config), batch).params
        True
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed import fake_pg  # noqa: F401  (registers "fake")

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise EstimateError(f"world_size must be a positive int, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise EstimateError(f"rank must lie in [0, {world_size}), got {rank!r}")
    if dist.is_initialized():
        raise EstimateError(
            "fake_process_group: a process group is already initialized in this process; "
            "estimate on its ranks instead (every rank calls estimate_memory)"
        )
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_layout_groups(
    tp: int = 1, cp: int = 1, ep: int = 1, tp_rank: int = 0
) -> Iterator[dict[str, Any]]:
    """Stand in for one rank of a layout with tensor-, context- and expert-parallel groups, in
    this one process: a fake world of ``tp * cp * ep`` ranks (:func:`fake_process_group`) and a
    group of each size over 1 (None for a size of 1), this process rank ``tp_rank`` of its tp
    group and rank 0 of the others (their ranks hold the same shapes: a cp rank as many tokens
    as any other, an ep rank as many experts).

    Example:
        >>> import torch, transformers
        >>> import slapo
        >>> from slapo.sharding.context_parallel import context_parallel
        >>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        ...     vocab_size=64, use_cache=False)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> ids = torch.randint(0, config.vocab_size, (2, 32))
        >>> batch = {"input_ids": ids, "labels": ids}
        >>> with fake_layout_groups(tp=2, cp=2) as groups:
        ...     cp = context_parallel(model, groups["cp"])
        ...     est = slapo.estimate_memory(model, cp.model_batch(batch))   # one rank of 4
        >>> sorted(groups)
        ['cp', 'ep', 'tp']
    """
    import torch.distributed as dist

    sizes = {"tp": tp, "cp": cp, "ep": ep}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise EstimateError(f"{name} must be a positive int, got {size!r}")
    if not 0 <= tp_rank < tp:
        raise EstimateError(f"tp_rank must lie in [0, {tp}), got {tp_rank!r}")
    with fake_process_group(tp * cp * ep, tp_rank):
        # disjoint strides: this process is rank tp_rank of its tp group, rank 0 of the others
        strides = {"tp": 1, "cp": tp, "ep": tp * cp}
        groups: dict[str, Any] = {}
        for name, size in sizes.items():
            first = 0 if name == "tp" else tp_rank
            ranks = [first + i * strides[name] for i in range(size)]
            groups[name] = dist.new_group(ranks) if size > 1 else None
        yield groups


# ----- the fake training step --------------------------------------------------------------------
def _optimizer_classes() -> dict[str, type]:
    return {
        name.lower(): cls
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
        and cls is not torch.optim.Optimizer
    }  # fmt: skip


def _module_of(sch: Any) -> nn.Module:
    from ..schedule import Schedule

    if isinstance(sch, Schedule):
        return sch.mod
    if isinstance(sch, nn.Module):
        wrapped = getattr(sch, "module", None)
        if isinstance(wrapped, nn.Module) and type(sch).__name__ in (
            "DistributedDataParallel", "FullyShardedDataParallel", "DataParallel",
        ):  # fmt: skip
            raise EstimateError(
                f"estimate_memory got a {type(sch).__name__} wrapper, whose hooks would run "
                "real collectives on fake gradients: pass the schedule (sch) or sch.mod instead"
            )
        return sch
    raise EstimateError(
        f"estimate_memory needs a Schedule (slapo.create_schedule(model)) or an nn.Module, got "
        f"{type(sch).__name__}"
    )


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in a model output (tensors, mappings, lists and tuples of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 6 and isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value, depth + 1)
    elif depth < 6 and isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, depth + 1)


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested: no plain storage
        return None


def _make_counter() -> Any:
    # deferred: TorchDispatchMode is not needed by `import slapo`
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Counter(TorchDispatchMode):
        """Every storage the step's ops create: bytes alive now, the most alive at once, and the
        module that was running when each was created. Storages that existed before the step
        (parameters, buffers, the batch) and views of them are not counted. ``copies`` are the
        storages cast from a parameter's (``params``): autocast's weight copies."""

        def __init__(self, known: set[int], where: Callable[[], str], params: set[int]) -> None:
            super().__init__()
            self.known, self.where, self.params = known, where, params
            self.alive: dict[int, tuple[Any, int]] = {}  # id(storage) -> (weak ref, bytes)
            self.origin: dict[int, str] = {}
            self.copies: set[int] = set()
            self.now = self.peak = 0
            # creation order of each storage, and the last creation that raised the peak:
            # which storages were alive at the peak (a gradient made before it still is)
            self.born: dict[int, int] = {}
            self.created = self.peak_at = 0
            # per storage: [born, died (the last creation before it was freed), bytes, module]
            self.records: list[list[Any]] = []
            self.trace: list[int] = []
            self.record_of: dict[int, int] = {}  # id(storage) -> its record while alive

        def _gone(self, key: int, _ref: Any) -> None:
            _, nbytes = self.alive.pop(key, (None, 0))
            index = self.record_of.pop(key, None)
            if index is not None:
                self.records[index][1] = self.created
            self.now -= nbytes

        def alive_at(self, peak_at: int, leave_out: set[int]) -> dict[str, int]:
            """Bytes alive when creation ``peak_at`` happened, by the module that made them,
            but for the records ``leave_out``."""
            out: dict[str, int] = {}
            for i, (born, died, nbytes, where) in enumerate(self.records):
                if born <= peak_at and (died is None or died >= peak_at) and i not in leave_out:
                    out[where] = out.get(where, 0) + nbytes
            return out

        def add(self, t: torch.Tensor) -> None:
            st = _storage(t)
            key = id(st)
            if st is None or key in self.alive or key in self.known:
                return
            nbytes = st.nbytes()
            self.alive[key] = (weakref.ref(st, functools.partial(self._gone, key)), nbytes)
            self.origin[key] = self.where()
            self.created += 1
            self.born[key] = self.created
            self.record_of[key] = len(self.records)
            self.records.append([self.created, None, nbytes, self.origin[key]])
            self.now += nbytes
            self.trace.append(self.now)  # bytes alive after each creation
            if self.now > self.peak:
                self.peak, self.peak_at = self.now, self.created

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.add(t)
            if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor):
                source = _storage(args[0]) if isinstance(args[0], torch.Tensor) else None
                if source is not None and id(source) in self.params:
                    self.copies.add(id(_storage(out)))
            return out

    return Counter


@contextlib.contextmanager
def _uncompiled() -> Iterator[None]:
    """Run ``torch.compile``d code eagerly: compiled kernels on fake tensors can crash."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is not None:
        with set_stance("force_eager"):
            yield
        return
    from torch import _dynamo  # torch < 2.6

    with _dynamo.config.patch(disable=True):
        yield


@contextlib.contextmanager
def _restore_tensor_attributes(model: nn.Module) -> Iterator[None]:
    """Undo tensors a forward caches on its modules (``self._cache = ...``): after the fake
    step, a real step must never meet a fake tensor."""
    before = {
        (id(m), k): v for m in model.modules() for k, v in vars(m).items()
        if isinstance(v, torch.Tensor)
    }  # fmt: skip
    try:
        yield
    finally:
        for m in model.modules():
            for k, v in list(vars(m).items()):
                if not isinstance(v, torch.Tensor) or before.get((id(m), k)) is v:
                    continue
                if (id(m), k) in before:
                    vars(m)[k] = before[(id(m), k)]
                else:
                    del vars(m)[k]


def _module_stack(model: nn.Module) -> tuple[list[str], list[Any]]:
    """Hooks keeping the path of every module whose forward is running; returns (stack, handles)."""
    stack: list[str] = []
    handles = []
    for path, mod in model.named_modules():

        def pre(_m: nn.Module, _args: Any, path: str = path) -> None:
            stack.append(path)

        def post(_m: nn.Module, _args: Any, _out: Any) -> None:
            if stack:
                stack.pop()

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, always_call=True))
    return stack, handles


def _fake_optimizer(
    optimizer: Any, kwargs: dict[str, Any], fake_of: dict[int, torch.Tensor], trainable: list
) -> tuple[Any, str]:
    """The optimizer given, over the fake parameters; returns it and its name."""
    if optimizer is None:
        return None, "none"
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = []
        for group in optimizer.param_groups:
            foreign = [p for p in group["params"] if id(p) not in fake_of]
            if foreign:
                raise EstimateError(
                    f"the {type(optimizer).__name__} given holds {len(foreign)} tensor(s) that are "
                    "not parameters of the model: pass the optimizer built for this model, or its "
                    "class (optimizer=torch.optim.AdamW, optimizer_kwargs={...})"
                )
            options = {k: v for k, v in group.items() if k != "params"}
            groups.append({**options, "params": [fake_of[id(p)] for p in group["params"]]})
        try:
            return type(optimizer)(groups, **optimizer.defaults), type(optimizer).__name__
        except TypeError:  # an optimizer whose defaults are not all constructor arguments
            return type(optimizer)(groups), type(optimizer).__name__
    if isinstance(optimizer, str):
        classes = _optimizer_classes()
        if optimizer.lower() == "none":
            return None, "none"
        if optimizer.lower() not in classes:
            raise EstimateError(
                f"unknown optimizer={optimizer!r}; name one of torch.optim's "
                f"({', '.join(sorted(classes))}), pass its class, or None"
            )
        optimizer = classes[optimizer.lower()]
    if not callable(optimizer):
        raise EstimateError(
            f"optimizer must be a torch.optim class or name, an optimizer, a factory "
            f"params -> optimizer, or None; got {optimizer!r}"
        )
    name = getattr(optimizer, "__name__", type(optimizer).__name__)
    try:
        return optimizer(trainable, **kwargs), name
    except TypeError as exc:
        raise EstimateError(f"cannot create optimizer {name} with {kwargs}: {exc}") from exc


def _fake_state(
    model: nn.Module, mode: Any, device: torch.device | None, param_dtype: torch.dtype | None
) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor], list[torch.Tensor]]:
    """Fake twins of the model's parameters and buffers: (by name, param id -> fake, buffers).
    ``param_dtype`` (None: their own) is the dtype of the floating-point parameters' twins."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if id(t) not in made:
            moved = t.device.type == "meta" or (device is not None and t.device != device)
            if moved or dtype != t.dtype:
                where = device or (torch.device("cpu") if t.device.type == "meta" else t.device)
                with mode:
                    f = torch.empty_strided(t.size(), t.stride(), dtype=dtype, device=where)
                made[id(t)] = f.requires_grad_(t.requires_grad)
            else:
                made[id(t)] = mode.from_tensor(t)
        return made[id(t)]

    def dtype_of(p: torch.Tensor) -> torch.dtype:
        return param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype

    by_name = {n: fake(p, dtype_of(p)) for n, p in model.named_parameters(remove_duplicate=False)}
    fake_of = {id(p): made[id(p)] for p in model.parameters()}
    buffers = [fake(b, b.dtype) for b in model.buffers()]
    by_name.update({n: fake(b, b.dtype) for n, b in model.named_buffers(remove_duplicate=False)})
    return by_name, fake_of, buffers


def _master_copies(trainable: list[torch.Tensor], mode: Any) -> dict[int, torch.Tensor]:
    """float32 copies of the trainable fake parameters (by the fake's id): the master weights
    an engine that casts the module keeps for its optimizer."""
    masters = {}
    for p in trainable:
        with mode:
            masters[id(p)] = torch.empty_strided(
                p.size(), p.stride(), dtype=torch.float32, device=p.device
            ).requires_grad_(True)
    return masters


def _default_device(model: nn.Module) -> torch.device | None:
    """Where a model whose weights are on the meta device would train: None keeps each tensor's."""
    devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    if devices and all(d.type == "meta" for d in devices):
        return torch.device("cpu")
    return None


def _step_device(
    model: nn.Module, device: str | torch.device | None
) -> tuple[torch.device | None, str | None]:
    """The device the fake step runs on (None: each tensor's own) and the stand-in's type:
    fake CUDA tensors crash a torch built without CUDA in their backward, so an estimate for
    ``cuda`` there runs on the CPU."""
    try:
        dev = torch.device(device) if device is not None else _default_device(model)
    except (RuntimeError, TypeError) as exc:
        raise EstimateError(f"device={device!r} is no torch device: {exc}") from exc
    if dev is not None and dev.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu"), "cpu"
    return dev, None


def _precision_arg(precision: Any) -> Precision:
    try:
        return Precision.of(precision)
    except PrecisionError as exc:
        raise EstimateError(f"precision={precision!r}: {exc}") from exc


def _peak_besides(counter: Any, records: set[int], start: int) -> tuple[int, int, int]:
    """``(creation, bytes, grad bytes)``: the creation after ``start`` at which the bytes alive
    but those of ``records`` (made from then on, alive to the end) were most, those bytes, and
    the bytes of ``records`` alive then."""
    births = sorted((counter.records[i][0], counter.records[i][2]) for i in records)
    best_at, best, grads_then, grads, j = start, -1, 0, 0, 0
    for k in range(start + 1, len(counter.trace) + 1):
        while j < len(births) and births[j][0] <= k:
            grads += births[j][1]
            j += 1
        other = counter.trace[k - 1] - grads
        if other > best:
            best_at, best, grads_then = k, other, grads
    return best_at, max(best, 0), grads_then


def _distinct_storages(tensors: Any) -> list[tuple[Any, int]]:
    """Each distinct storage behind ``tensors``, with its bytes."""
    seen: dict[int, tuple[Any, int]] = {}
    for t in tensors:
        st = _storage(t)
        if st is not None:
            seen[id(st)] = (st, st.nbytes())
    return list(seen.values())


def _sizes(tensors: Any) -> list[int]:
    """The bytes of each distinct storage behind ``tensors``."""
    return [n for _, n in _distinct_storages(tensors)]


def _nbytes(tensors: Any) -> int:
    return sum(_sizes(tensors))


def _state_tensors(opt: Any) -> list[torch.Tensor]:
    return [
        v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    ]  # fmt: skip


def estimate_memory(
    sch: Any,
    batch: Any,
    *,
    optimizer: Any = "adamw",
    optimizer_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    device: str | torch.device | None = None,
    precision: Precision | str | torch.dtype | None = None,
    cast_params: bool = False,
) -> MemoryEstimate:
    """Predict the memory of one training step of ``sch`` on ``batch``, without allocating it.

    Args:
        sch: a schedule (its module, as scheduled, is estimated) or an ``nn.Module``.
        batch: what :func:`slapo.train_step` takes: a mapping of keyword arguments (the loss is
            the output's ``loss``), a tuple of positional ones, or a tensor. Real tensors (they
            stay real: they are small), or tensors on the meta device for a batch of any size.
        optimizer: the optimizer whose state counts: a ``torch.optim`` name (``"adamw"``,
            ``"sgd"``, ...), class or factory (with ``optimizer_kwargs``), an optimizer built
            for this model (its class and hyperparameters are used), or None for no state.
        loss_fn: ``loss_fn(output, target)`` as for :func:`slapo.train_step`.
        device: the device the model trains on, for a model on the meta device (default
            "cpu"); its tensors' own devices otherwise. ``"cuda"`` works without a GPU (the
            fake step then runs on the CPU, see ``stand_in``).
        precision: ``"fp32"`` (None), or mixed ``"bf16"``/``"fp16"``: float32 parameters,
            gradients and optimizer state, the forward under ``torch.autocast`` (the eager,
            DDP and pipeline targets).
        cast_params: with mixed ``precision``, the module computes with parameters in the
            compute dtype instead of autocasting (FSDP2's gathered parameters, DeepSpeed's and
            RoundPipe's cast module): ``params`` and ``grads`` are in that dtype, and the
            optimizer steps float32 master copies (``engine_parts[MASTER_WEIGHTS]``).

    Returns:
        A :class:`MemoryEstimate` (bytes; ``print`` it for a table). With a process group
        (tensor parallelism), every rank calls it and gets its own share.

    Raises:
        EstimateError: bad arguments, or the fake step failed (e.g. an op that reads tensor
            values, which fake tensors do not have); the message names the cause.

    Example:
        >>> import slapo
        >>> import torch, transformers
        >>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        ...     vocab_size=64, use_cache=False)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> sch = slapo.model_schedule.apply_schedule(model, ckpt_ratio=0.5)
        >>> ids = torch.randint(0, config.vocab_size, (2, 32))
        >>> est = slapo.estimate_memory(sch, {"input_ids": ids, "labels": ids},
        ...                             optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
        >>> print(est)
        memory estimate: LlamaForCausalLM on cpu, optimizer SGD
        ...
          optimizer state                      0 B
        ...
        >>> bf16 = slapo.estimate_memory(sch, {"input_ids": ids, "labels": ids}, precision="bf16")
        >>> bf16.activations < est.activations, bf16.grads == est.grads
        (True, True)
    """
    # deferred: fake tensors and the contract pull in modules `import slapo` does not need
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    from ..targets.contract import output_loss, split_batch

    model = _module_of(sch)
    prec = _precision_arg(precision)
    cast = bool(cast_params) and prec.mixed
    args, kwargs, target = split_batch(batch, with_target=loss_fn is not None)
    dev, stand_in = _step_device(model, device)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    by_name, fake_of, buffers = _fake_state(model, mode, dev, prec.compute_dtype if cast else None)
    params = list(fake_of.values())
    trainable = list({id(p): p for p in params if p.requires_grad}.values())
    if not trainable:
        raise EstimateError(
            f"no parameter of {type(model).__name__} requires grad: there is no training step "
            "to estimate (unfreeze some with requires_grad_(True))"
        )
    masters = _master_copies(trainable, mode) if cast else {}
    step_device = dev.type if dev is not None else params[0].device.type

    def place(x: Any) -> Any:  # meta (or off-device) inputs become fake ones where the model is
        if isinstance(x, torch.Tensor) and (
            x.device.type == "meta" or (dev is not None and x.device != dev)
        ):
            with mode:
                return torch.empty_strided(
                    x.size(), x.stride(), dtype=x.dtype, device=dev or "cpu"
                ).requires_grad_(x.requires_grad)
        return x

    args = tuple(place(a) for a in args)
    kwargs = {k: place(v) for k, v in kwargs.items()}
    target = place(target)
    inputs = [*args, *kwargs.values(), target]
    # the optimizer steps the parameters, or their master copies where the module is cast
    opt_of = fake_of
    if cast:
        opt_of = {k: masters[id(f)] for k, f in fake_of.items() if id(f) in masters}
    opt_params = trainable if not cast else list(masters.values())
    opt, opt_name = _fake_optimizer(optimizer, dict(optimizer_kwargs or {}), opt_of, opt_params)
    param_storages = {id(_storage(p)) for p in params}
    known = param_storages | {id(_storage(b)) for b in buffers}
    known |= {id(_storage(m)) for m in masters.values()}
    known |= {id(_storage(t)) for t in inputs if isinstance(t, torch.Tensor)}

    stack, handles = _module_stack(model)
    counter = _make_counter()(known, lambda: stack[-1] if stack else "", param_storages)
    saved: dict[int, int] = {}
    saved_at: dict[int, str] = {}
    keep: list[Any] = []  # every storage counted in the forward: no id is reused meanwhile

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = _storage(t)
        key = id(st)
        if st is not None and key not in param_storages and key not in saved:
            saved[key] = st.nbytes()
            saved_at[key] = stack[-1] if stack else ""  # the module that keeps it
            keep.append(st)
        return t

    def forward() -> Any:
        # as the eager, DDP and pipeline targets run it: the module's forward autocasts
        with prec.autocast(step_device) if not cast else contextlib.nullcontext():
            return model(*args, **kwargs)

    def step() -> dict[str, Any]:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
            loss = output_loss(out) if loss_fn is None else loss_fn(out, target)
        if not loss.requires_grad:
            raise EstimateError(
                "the loss does not require grad: no trainable parameter of the model takes part "
                "in it; there is no training step to estimate"
            )
        outputs = {id(_storage(t)) for t in [*_tensors(out), loss]}
        extra = {k: n for k, (_, n) in counter.alive.items() if k not in saved and k not in outputs}
        by_module: dict[str, int] = {}
        for k, n in [*saved.items(), *extra.items()]:
            where = saved_at.get(k, counter.origin.get(k, ""))
            by_module[where] = by_module.get(where, 0) + n
        kept = {**saved, **extra}
        facts: dict[str, Any] = {
            "activations": sum(kept.values()), "by_module": by_module,
            "activation_sizes": list(kept.values()),
            "weight_copies": sum(n for k, n in kept.items() if k in counter.copies),
        }  # fmt: skip
        keep.clear()  # counted: the backward frees them as it goes
        # the forward's peak (e.g. its end, where autocast's cache still holds a 16-bit copy of
        # every weight) and the backward's (e.g. the loss's float32 gradients) apart: each
        # grows with the model's depth at its own rate (slapo.plan.profile)
        facts["forward_peak"], counter.peak = counter.peak, counter.now
        activation_records = {counter.record_of[k] for k in kept if k in counter.record_of}
        temporaries = {"forward": counter.alive_at(counter.peak_at, activation_records)}
        backward_from = counter.created
        loss.backward()  # the output stays alive through backward, as in slapo.train_step
        del out, loss
        facts["grad_sizes"] = _sizes(p.grad for p in params if p.grad is not None)
        # the gradients alive at the forward/backward peak: those made before it (a peak at the
        # start of backward, around the loss, holds none)
        facts["grads_at_peak"] = sum(
            n for st, n in _distinct_storages(p.grad for p in params if p.grad is not None)
            if counter.born.get(id(st), 0) <= counter.peak_at
        )  # fmt: skip
        grad_records = {
            counter.record_of[id(st)] for st, _ in _distinct_storages(
                p.grad for p in params if p.grad is not None
            ) if id(st) in counter.record_of
        }  # fmt: skip
        temporaries["backward"] = counter.alive_at(
            counter.peak_at, activation_records | grad_records
        )
        # the backward's peak of all but its gradients: where a rank holding a share of the
        # gradients (FSDP, ZeRO) peaks, even when the whole model peaks later, among them
        at, other, grads_then = _peak_besides(counter, grad_records, backward_from)
        facts["backward_other_peak"], facts["grads_at_other_peak"] = other, grads_then
        temporaries["backward_other"] = counter.alive_at(at, activation_records | grad_records)
        facts["peak_temporaries"] = temporaries
        # In later steps the optimizer state is there from the start: it adds to this peak.
        facts["backward_peak"] = counter.peak
        facts["forward_backward_peak"] = max(facts["forward_peak"], counter.peak)
        counter.peak = counter.now
        for p in trainable if cast else ():  # the engine hands the gradients to the masters
            if p.grad is not None:
                masters[id(p)].grad = p.grad.to(torch.float32)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
            facts["state_sizes"] = _sizes(_state_tensors(opt))
        for p in trainable if cast else ():
            p.grad = None
        facts["optimizer_step_peak"] = counter.peak
        return facts

    try:
        with contextlib.ExitStack() as ctx:
            ctx.enter_context(torch.random.fork_rng(devices=[]))
            ctx.enter_context(_uncompiled())
            ctx.enter_context(fake_step_stand_ins(model))  # MoE ops that cannot run on fakes
            ctx.enter_context(_restore_tensor_attributes(model))
            ctx.enter_context(_reparametrize_module(model, by_name, tie_weights=True, strict=False))
            ctx.enter_context(counter)
            facts = step()
    except SlapoError:
        raise
    except Exception as exc:
        raise EstimateError(
            f"estimate_memory: the fake training step of {type(model).__name__} failed: "
            f"{type(exc).__name__}: {exc}. Fake tensors have shapes but no values: an op that "
            "reads a value of the model's tensors (.item(), a data-dependent shape) cannot run "
            "on them; a value of the batch can (keep the batch real, not on the meta device)"
        ) from exc
    finally:
        for h in handles:
            h.remove()
    return _estimate_of(
        model, facts, params, buffers, list(masters.values()), opt_name, prec,
        device=torch.device(device).type if device is not None else step_device,
        stand_in=stand_in,
    )  # fmt: skip


def _estimate_of(
    model: nn.Module,
    facts: dict[str, Any],
    params: list[torch.Tensor],
    buffers: list[torch.Tensor],
    masters: list[torch.Tensor],
    opt_name: str,
    precision: Precision,
    device: str,
    stand_in: str | None,
) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of a fake step's facts."""
    import torch.distributed as dist

    rank = world = None
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    state_sizes = facts.get("state_sizes", [])
    state = sum(state_sizes)
    created = max(facts["forward_backward_peak"] + state, facts["optimizer_step_peak"])
    held = _nbytes(params) + _nbytes(buffers) + _nbytes(masters)
    parts = {MASTER_WEIGHTS: _nbytes(masters)} if masters else {}
    rounding = {
        "params": allocator_rounding(_sizes(params)),
        "buffers": allocator_rounding(_sizes(buffers)),
        "grads": allocator_rounding(facts["grad_sizes"]),
        "optimizer_state": allocator_rounding(state_sizes),
        "activations": allocator_rounding(facts["activation_sizes"]),
        **{name: allocator_rounding(_sizes(masters)) for name in parts},
    }  # fmt: skip
    return MemoryEstimate(
        params=_nbytes(params),
        buffers=_nbytes(buffers),
        grads=sum(facts["grad_sizes"]),
        forward_peak=held + facts["forward_peak"] + state,
        backward_peak=held + facts["backward_peak"] + state,
        grads_at_peak=facts["grads_at_peak"],
        backward_other_peak=held + facts["backward_other_peak"] + state,
        grads_at_other_peak=facts["grads_at_other_peak"],
        peak_temporaries=facts["peak_temporaries"],
        optimizer_state=state,
        activations=facts["activations"],
        live_peak=held + created,
        by_module=facts["by_module"],
        model=type(model).__name__,
        optimizer=opt_name,
        device=device,
        rank=rank,
        world_size=world or 1,
        engine=sum(parts.values()),
        engine_parts=parts,
        precision=precision.name,
        weight_copies=facts["weight_copies"],
        rounding=rounding,
        stand_in=stand_in,
    )
